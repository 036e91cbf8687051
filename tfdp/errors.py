"""The one exception type that reaches the user as a single line.

Anything the user can fix (config, data, cluster spec) raises `UserError`; the
CLI prints it as `tfdp: error: ...` and exits non-zero. Everything else is a
bug and keeps its traceback. A write that fails for a reason the user can fix
(disk full, read-only, no permission) is one of them (`write_errors`,
`atomic_write_text`: every module that writes a run's files uses these).
"""

import contextlib
import errno
import os
import re
import shutil
from typing import Iterator


def first_line(error: BaseException, limit: int = 160) -> str:
    """The first line of an error's message (a TensorFlow error's, without its `{{function_node ...}}`
    prefix), cut to `limit` characters: what a one-line report quotes; the error's type if it says nothing."""
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", getattr(error, "message", None) or str(error)).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:limit]


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback; the process exits
    `exit_code` (2: fix the input and run again)."""
    exit_code = 2


# Exit status of a run whose training loss (or weights) stopped being finite: a permanent error, never
# retried by a scheduler (a restart from the last good checkpoint with the same settings diverges again).
DIVERGED_EXIT_CODE = 5


class Diverged(UserError):
    """The training loss became nan or inf: the run stops before any checkpoint of that step is written,
    keeping the last good one; exit DIVERGED_EXIT_CODE."""
    exit_code = DIVERGED_EXIT_CODE


# The exit-status contract every scheduler reads the same way (docs/faults.md): 1-127 is permanent, something
# the user must fix (2 a bad config or bad data), never worth a retry; 128-255 is retryable, and the same
# command continues from the last checkpoint. It is Kubeflow's: a TFJob's `restartPolicy: ExitCode` restarts
# 128-255 and fails the job on 1-127 (kubeflow/training-operator pkg/util/train/train_util.go,
# IsRetryableExitCode), and it is what a process ended by a signal reports (128 + N), so a worker killed
# before it could save is retried too.
RETRYABLE_EXIT_CODES = range(128, 256)

# Exit status of a run that stopped with everything saved and wants the same command again: a preemption
# notice (SIGTERM: 128 + 15, what an unhandled TERM would have reported), a lost peer, a lost tf.data
# service, a bucket silent past its retries. The docker/ templates (podFailurePolicy, Slurm's requeue,
# Compose's on-failure) restart on it.
PREEMPTED_EXIT_CODE = 143


def is_retryable(exit_code: int) -> bool:
    """Whether a process's exit status asks for the same command again (the contract above)."""
    return exit_code in RETRYABLE_EXIT_CODES


class Restartable(Exception):
    """The run stopped in a state that the same command continues from; exit PREEMPTED_EXIT_CODE."""


class Preempted(Restartable):
    """Raised once every worker has saved at the step they agreed on after a preemption notice."""


class PeerLost(Restartable):
    """Another worker of a multi-worker run stopped answering; the last checkpoint is where to go on."""


class ServiceLost(Restartable):
    """The tf.data service no longer knows the run's input job; a new run makes a new one."""


class StorageLost(Restartable):
    """A bucket the run reads or writes stopped answering for longer than its retries; the last (committed)
    checkpoint is where the same command goes on."""


# --- writes that fail in one line -------------------------------------------

def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with write_errors(f"{os.path.basename(path)}", os.path.dirname(path) or ".", len(text.encode())):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


@contextlib.contextmanager
def write_errors(what: str, where: str, size: int = 0) -> Iterator[None]:
    """Turns a failed write (disk full, read-only, no permission) into one line naming it."""
    try:
        yield
    except OSError as e:
        code = e.errno if e.errno is not None else _errno_in(str(e))
        if code == errno.ENOSPC:
            free = shutil.disk_usage(where).free if os.path.isdir(where) else 0
            raise UserError(f"no space left on the device while writing {what} in {where} "
                            f"(needed about {_mb(size)} MB, {_mb(free)} MB free)") from None
        if code in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise UserError(f"cannot write {what} in {where}: {os.strerror(code).lower()}") from None
        raise


def _errno_in(message: str) -> int | None:
    """h5py reports errors as text ('errno = 28'); fish the code out."""
    match = re.search(r"errno\s*=\s*(\d+)", message)
    return int(match.group(1)) if match else None


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f}" if size >= 1e6 else f"{size / 1e6:.2f}"
