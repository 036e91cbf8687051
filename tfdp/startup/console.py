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
import subprocess
import sys
import warnings

VERBOSE_ENV = "TFDP_VERBOSE"
TF_LOGGER = "tensorflow"  # the name tf.get_logger() uses
# The stderr pipe of a filter this process or its parent started: "device:inode" (see filter_native_stderr).
FILTER_ENV = "TFDP_STDERR_FILTER"
# What native libraries write straight to file descriptor 2, past every logger. libjpeg's messages about a corrupt
# JPEG (TensorFlow's decoder keeps libjpeg's default output_message; the texts of jerror.h a decoder can meet, printf
# fields as wildcards). tfdp names each corrupt image itself, once, with TensorFlow's reason (tfdp.data.corrupt);
# these lines would only repeat it, unnamed, every time the image is met. Anything else passes.
LIBJPEG_MESSAGES = (
    "Improper call to JPEG library in state %d", "Input file read error", "Empty input file",
    "Premature end of input file", "Premature end of JPEG file", "Not a JPEG file: starts with 0x%02x 0x%02x",
    "Bogus marker length", "Bogus Huffman table definition", "Bogus JPEG colorspace", "Bogus sampling factors",
    "Bogus DAC index %d", "Bogus DAC value 0x%x", "Bogus DHT index %d", "Bogus DQT index %d",
    "Invalid component ID %d in SOS", "DCT coefficient out of range", "Unsupported JPEG data precision %d",
    "Invalid progressive parameters Ss=%d Se=%d Ah=%d Al=%d", "Sampling factors too large for interleaved scan",
    "Too many color components: %d, max %d", "Unsupported color conversion request",
    "Empty JPEG image (DNL not supported)", "Didn't expect more than one scan", "Huffman code size table overflow",
    "Missing Huffman code table entry", "Maximum supported image dimension is %u pixels",
    "Huffman table 0x%02x was not defined", "Quantization table 0x%02x was not defined",
    "JPEG datastream contains no image", "Invalid JPEG file structure: %s", "Unsupported JPEG process: SOF type 0x%02x",
    "Unsupported marker type 0x%02x", "Image too wide for this implementation", "Insufficient memory (case %d)",
    "Unknown Adobe color transform code %d", "Inconsistent progression sequence for component %d coefficient %d",
    "Corrupt JPEG data: %s", "Warning: unknown JFIF revision number %d.%02d", "Invalid SOS parameters for sequential JPEG",
    "Warning: thumbnail image size does not match data length %u",
)


def _message_pattern(text: str) -> bytes:
    """A printf format as a regular expression over the line: each field any run of characters."""
    import re
    parts = re.split(r"%[0-9]*[duxs]", text)
    return ".+".join(re.escape(p) for p in parts).encode()


# The LiteRT interpreter's note on the CPU delegate it picks, printed once per interpreter (`tfdp export`'s check),
# and the TFLite calibrator's settings, printed once per int8 conversion (`--format=litert_int8`).
LITERT_MESSAGES = ("INFO: Created TensorFlow Lite XNNPACK delegate for CPU.",
                   "fully_quantize: %d, inference_type: %d, input_inference_type: %s, output_inference_type: %s")
NATIVE_NOISE = tuple(_message_pattern(m) for m in LIBJPEG_MESSAGES + LITERT_MESSAGES)
# The filter process: forwards its stdin to its stdout line by line, less NATIVE_NOISE. It ignores the signals a
# job's whole process group gets (Ctrl-C, Slurm's and Kubernetes' SIGTERM): it must outlive the command to pass on
# its last lines (a preemption's, an error's), and ends when every writer of the pipe has.
_FILTER_CODE = """
import os, re, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
noise = re.compile(b"^(?:" + b"|".join(NOISE) + b")\\r?\\n?$")
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    if not noise.match(line):
        out.write(line)
        out.flush()
"""


def say(line: str, err: bool = False) -> None:
    """Prints one of the run's own lines: the one place tfdp writes what a person reads.

    Flushed at once, so the lines keep their order among TensorFlow's native
    output and the workers' logs, and the last one is out before a crash or a
    preemption's exit; `err` for warnings that belong with the errors (stderr).
    """
    stream = sys.stderr if err else sys.stdout
    stream.write(f"{line}\n")
    stream.flush()


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


def filter_native_stderr() -> None:
    """Routes file descriptor 2 through a small filter process that drops NATIVE_NOISE (unless verbosity was asked
    for, or this process's stderr already goes through one, as a launched worker's may).

    C libraries write to the descriptor itself, so no Python setting reaches them. A separate process rather than a
    thread: lines written just before `os._exit` or a crash are still in the pipe, and only a reader that outlives
    the writer passes them on.
    """
    if verbose_requested(sys.argv) or os.environ.get(FILTER_ENV) == _identity(2):
        return
    sys.stderr.flush()
    read, write = os.pipe()
    code = f"NOISE = {NATIVE_NOISE!r}\n{_FILTER_CODE}"
    try:
        subprocess.Popen([sys.executable, "-S", "-c", code], stdin=read, stdout=2, stderr=subprocess.DEVNULL,
                         close_fds=True, start_new_session=True)
    except OSError:
        os.close(read)
        os.close(write)
        return  # no filter: the lines stay, nothing is lost
    os.close(read)
    os.dup2(write, 2)
    os.close(write)
    os.environ[FILTER_ENV] = _identity(2)


def _identity(fd: int) -> str:
    try:
        st = os.fstat(fd)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


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
        # Keras says so whenever a finite dataset ends before its `steps`; tfdp's evaluation and training streams
        # end where they should, and their counts are tfdp's own lines.
        warnings.filterwarnings("ignore", message=".*ran out of data.*", category=UserWarning)


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
    what tfdp does not use, and without the garbage collector walking what it creates (`tfdp.startup.tf_setup`).

    A failing import still raises; Python prints its traceback after stderr is back.
    """
    from tfdp.startup import tf_setup
    if "tensorflow" not in sys.modules:  # else imported already: only what the import made is frozen
        quiet = not verbose_requested(sys.argv)
        with (stderr_to_devnull() if quiet else contextlib.nullcontext(), tf_setup.without_unused_imports(),
              tf_setup.without_garbage_collection()):
            import keras  # noqa: F401
            import tensorflow  # noqa: F401
    tf_setup.trace_own_functions_as_written()
