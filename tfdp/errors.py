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
    """A problem with the user's input, reported as one line without a traceback."""


# Exit status of a run that saved a checkpoint on a preemption notice (SIGTERM) and stopped:
# EX_TEMPFAIL from sysexits.h, "try again later". Schedulers restart on it (docker/ templates).
PREEMPTED_EXIT_CODE = 75


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
