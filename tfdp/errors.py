"""The one exception type that reaches the user as a single line.

Anything the user can fix (config, data, cluster spec) raises `UserError`; the
CLI prints it as `tfdp: error: ...` and exits non-zero. Everything else is a
bug and keeps its traceback.
"""


import re


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
