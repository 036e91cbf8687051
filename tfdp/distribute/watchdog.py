"""A separate process that ends a worker stuck waiting for its cluster.

TensorFlow's wait for absent workers holds the GIL in C++, so no Python thread
or signal handler in the worker itself can run until it returns (which is
never, when a worker is missing). This process sleeps beside it instead: if
the worker has not closed the pipe by the deadline, the watchdog names the
members that accept no connection, on the worker's stderr, and kills it.

  python -m tfdp.distribute.watchdog PID SECONDS   (TF_CONFIG in the environment; stdin is the pipe)

A SIGKILL reads like any other kill (the OOM killer's, say), so when
TFDP_WATCHDOG_MARK names a file the watchdog also writes its message there:
`tfdp launch` reads it to tell "the cluster never formed" from "killed".
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys

from tfdp.distribute import cluster as cluster_lib

MARK_ENV = "TFDP_WATCHDOG_MARK"


@contextlib.contextmanager
def deadline(seconds: float):
    """Watches the current process for `seconds`; leaving the block in time calls it off."""
    proc = subprocess.Popen([sys.executable, "-m", "tfdp.distribute.watchdog", str(os.getpid()), str(seconds)],
                            stdin=subprocess.PIPE)
    try:
        yield
    finally:
        proc.stdin.close()  # EOF: the watchdog exits quietly
        proc.wait()


def main() -> None:
    pid, seconds = int(sys.argv[1]), float(sys.argv[2])
    ready, _, _ = select.select([sys.stdin], [], [], seconds)
    if ready:
        return  # EOF before the deadline: the cluster came up
    missing = cluster_lib.unreachable(cluster_lib.parse_tf_config(os.environ["TF_CONFIG"]))
    message = (f"cluster did not come up within {seconds:g} s; not reachable: "
               f"{', '.join(missing) or 'none (they answer, but did not join the collective)'}")
    sys.stderr.write(f"tfdp: error: {message}\n")
    sys.stderr.flush()
    if os.environ.get(MARK_ENV):
        with open(os.environ[MARK_ENV], "w", encoding="utf-8") as f:
            f.write(message)
    os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
