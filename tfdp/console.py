"""What a run prints: what a person needs, and TensorFlow's internals only on request.

By default a run shows tfdp's own lines (the data and strategy, one line per
epoch or the live progress bar, warnings, the summary). TensorFlow's C++
start-up chatter (oneDNN, CUDA, CPU features) is printed while its shared
libraries load, before any setting can quiet it, so the import itself runs
with the process's stderr pointed at /dev/null; its Python INFO logs
(`cross_device_ops ... Reduce to ...`) stay below absl's WARNING threshold,
and its Python warnings below the "tensorflow" logger's ERROR threshold. The
same holds for every process tfdp runs: a one-host run, each worker of
`tfdp launch`, a Slurm task, a Kubernetes pod.
absl's own `--verbosity` flag (0 = INFO, 1 = DEBUG) brings all of it back.
No TensorFlow import at module level: `report` and `--help` use this module.
"""

from __future__ import annotations

import contextlib
import os
import sys

VERBOSE_ENV = "TFDP_VERBOSE"
TF_LOGGER = "tensorflow"  # the name tf.get_logger() uses


def verbose_requested(argv: list[str]) -> bool:
    """True when the command line asks for absl's verbosity (or TFDP_VERBOSE=1 is set)."""
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
        return True
    return any(a == "-v" or a.startswith(("--verbosity", "-v=")) for a in argv)


def prepare(argv: list[str]) -> None:
    """Before TensorFlow loads: with --verbosity, let its C++ logs through (unless the user set the level)."""
    import tfdp
    if verbose_requested(argv):
        os.environ[VERBOSE_ENV] = "1"  # workers started by `tfdp launch` inherit it
        if tfdp.TF_LOG_LEVEL_DEFAULTED:
            os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"


def set_python_logging() -> None:
    """absl's threshold: WARNING by default (tfdp prints its own lines), the flag's level on request.

    TensorFlow's own Python logger ("tensorflow") is held at ERROR by default,
    as its C++ logs are (TF_CPP_MIN_LOG_LEVEL): its warnings are about its
    internals (a strategy run eagerly, collective ops configured late), and a
    cluster task meets them where a one-host run does not, so without this each
    worker's log would open with lines the one-host console never shows.
    """
    import logging as std_logging

    from absl import logging
    if not verbose_requested(sys.argv):
        logging.set_verbosity(logging.WARNING)
        std_logging.getLogger(TF_LOGGER).setLevel(std_logging.ERROR)


@contextlib.contextmanager
def stderr_to_devnull() -> None:
    """File descriptor 2 pointed at /dev/null for the block (C++ writes bypass Python's sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def import_tensorflow() -> None:
    """Imports TensorFlow (and Keras), without its start-up chatter unless verbosity was asked for, and without
    what tfdp does not use (`tfdp.tf_setup`).

    A failing import still raises; Python prints its traceback after stderr is back.
    """
    from tfdp import tf_setup
    quiet = "tensorflow" not in sys.modules and not verbose_requested(sys.argv)
    with stderr_to_devnull() if quiet else contextlib.nullcontext(), tf_setup.without_scikit_learn():
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
    tf_setup.trace_own_functions_as_written()
