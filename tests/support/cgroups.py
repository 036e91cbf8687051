"""A real memory cgroup with a limit, as Docker's `--memory` or a Kubernetes pod's memory limit makes one, for a
command run inside it. Needs a writable memory hierarchy (root, cgroup v1's memory controller or v2's); the
tests that use it skip and say why without one."""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import time

from tfdp.startup.memory import memory_mounts

_NUMBERS = itertools.count()


def _writable_hierarchy() -> tuple[str, str] | None:
    """(mount point, "v1" | "v2") of a memory hierarchy this process can make a cgroup in, else None."""
    for _, mount, version in memory_mounts("self"):
        if version == "v2":
            with open(os.path.join(mount, "cgroup.subtree_control"), encoding="ascii") as f:
                if "memory" not in f.read().split():
                    continue
        if os.access(mount, os.W_OK):
            return mount, version
    return None


def why_no_memory_cgroup() -> str | None:
    """Why a memory cgroup cannot be made here, None where it can."""
    if _writable_hierarchy() is None:
        return "needs a writable memory cgroup hierarchy (root, cgroup v1's memory controller or v2's)"
    return None


@contextlib.contextmanager
def memory_limited(limit: int, depth: int = 1):
    """Yields a function that prefixes a command so it runs inside a fresh cgroup limited to `limit` bytes, or
    with `depth` > 1 in a cgroup that many levels below the limited one, which sets no limit of its own (a pod's
    container inside the pod's cgroup); the cgroups are removed afterwards, once every process in them has ended
    (a tfdp process's console reader outlives it by a moment: `tfdp.startup.console`)."""
    mount, version = _writable_hierarchy()
    folders = [os.path.join(mount, f"tfdp-test-{os.getpid()}-{next(_NUMBERS)}")]
    folders += [os.path.join(folders[0], *["inner"] * level) for level in range(1, depth)]
    try:
        for folder in folders:
            os.mkdir(folder)
        if version == "v2":  # a v2 cgroup's children get the memory controller only where it hands it down
            for folder in folders[:-1]:
                with open(os.path.join(folder, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory")
        with open(os.path.join(folders[0], "memory.limit_in_bytes" if version == "v1" else "memory.max"), "w") as f:
            f.write(str(limit))
        procs = shlex.quote(os.path.join(folders[-1], "cgroup.procs"))
        yield lambda command: ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command]
    finally:
        for folder in reversed(folders):
            if os.path.isdir(folder):
                _remove_when_empty(folder)


def _remove_when_empty(folder: str, seconds: float = 60) -> None:
    """Removes the cgroup once no process is left in it (the kernel refuses before: EBUSY), waiting up to
    `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.rmdir(folder)
            return
        except OSError:
            with open(os.path.join(folder, "cgroup.procs"), encoding="ascii") as f:
                left = f.read().split()
            if time.monotonic() > deadline:
                raise AssertionError(f"{folder}: processes {left} still in it after {seconds:g} s") from None
            time.sleep(0.1)
