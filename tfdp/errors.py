"""The one exception type that reaches the user as a single line.

Anything the user can fix (config, data, cluster spec) raises `UserError`; the
CLI prints it as `tfdp: error: ...` and exits non-zero. Everything else is a
bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""
