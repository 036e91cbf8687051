"""Shared fixtures. The CPU is split into 2 logical devices once, at collection,
before any test initialises TensorFlow, so in-process tests can run real
2-replica MirroredStrategy."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

import tfdp  # noqa: F401  (sets TensorFlow's environment defaults before TF loads)
from tfdp.startup import allocator
from tfdp.startup.console import import_tensorflow

import_tensorflow()  # as tfdp's own processes import it (tfdp.startup.tf_setup), before anything else does
from tfdp.distribute.strategy import split_cpu  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_DEVICES = split_cpu(2)


DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")
# Runs the tests marked `full` too: dear runs whose mechanism a cheaper test of the default run checks (an accuracy
# outcome, one more family of a conversion already covered), kept out of CI's run for the suite's time.
FULL_ENV = "TFDP_FULL"


def pytest_configure(config):
    """The test processes xdist starts, and what they start, run on the allocator tfdp's own processes use
    (`tfdp.startup.allocator`); this one, already running, keeps its own. (In a worker it is already preloaded, so
    nothing changes there.)"""
    env = allocator.with_tcmalloc(os.environ)
    if env is not None:
        os.environ.update(env)
    # The suite starts a few hundred Python processes (xdist's, `tfdp` runs, cluster workers). Where the environment
    # says not to write bytecode (PYTHONDONTWRITEBYTECODE, as on the project's CI host), each compiled tfdp's and the
    # tests' sources anew, about 0.2 CPU-s a process: the test processes and theirs write it, into the __pycache__
    # folders git and the Docker context ignore.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help="write each test file's total seconds in this tier to tests/durations.json (the schedule's "
                          "order)")


def tier() -> str:
    """The run's key in tests/durations.json: a file's seconds differ between the README's run and the full tier's
    (test_export_zoo.py holds 5 rows of the one and 11 of the other), so each run is ordered by its own."""
    return "full" if os.environ.get(FULL_ENV) == "1" else "default"


def pytest_collection_modifyitems(config, items):
    """Longest files first, each file's own order kept (longest-processing-time-first scheduling).

    The suite is split over worker processes file by file (`--dist loadfile --no-loadscope-reorder`): the
    longest files start at once and the short ones fill the gaps at the end, instead of one process
    running a long file alone while the others idle. The seconds come from tests/durations.json, this tier's
    (refresh with `--store-durations`); a file missing from it counts as 60 s, a typical file with a training run.
    Tests marked `full` skip, with the marker's reason, unless TFDP_FULL=1; `gpu` ones skip on a host without one.
    """
    with open(DURATIONS, encoding="utf-8") as f:
        seconds = json.load(f)[tier()]
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 60))
    if tier() != "full":
        for item in items:
            if marker := item.get_closest_marker("full"):
                item.add_marker(pytest.mark.skip(reason=f"runs with {FULL_ENV}=1: {marker.kwargs['reason']}"))
    if not has_gpu():
        skip = pytest.mark.skip(reason="needs a GPU: no NVIDIA device on this host (/dev/nvidiactl)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def has_gpu() -> bool:
    """An NVIDIA GPU's device node, which its driver makes; asked without loading TensorFlow."""
    return os.path.exists("/dev/nvidiactl")


_file_seconds: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    """Sums each file's setup, call and teardown seconds (in the controller, from every worker)."""
    _file_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session, exitstatus):
    """With `--store-durations`, after a passing run: the files it ran get their new seconds in this tier, the others
    keep theirs."""
    if not session.config.getoption("--store-durations") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if exitstatus != 0 or not _file_seconds:
        return
    with open(DURATIONS, encoding="utf-8") as f:
        tiers = json.load(f)
    seconds = {**tiers[tier()], **{k: round(v) for k, v in _file_seconds.items()}}
    tiers[tier()] = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
    with open(DURATIONS, "w", encoding="utf-8") as f:
        json.dump(tiers, f, indent=1)
        f.write("\n")


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> str:
    """The real demo dataset (1,797 JPEGs), written once per test session."""
    from tfdp.data.layouts.digits import write_digits
    out = str(tmp_path_factory.mktemp("data") / "digits")
    write_digits(out, progress=False)
    return out


def digits_subset(digits_dir: str, root, train: int, val: int) -> str:
    """The first `train` and `val` images of every class of the digits, copied into `root`."""
    for split, per_class in (("train", train), ("val", val)):
        for cls in sorted(os.listdir(os.path.join(digits_dir, split))):
            os.makedirs(root / split / cls)
            for f in sorted(os.listdir(os.path.join(digits_dir, split, cls)))[:per_class]:
                shutil.copy(os.path.join(digits_dir, split, cls, f), root / split / cls / f)
    return str(root)


@pytest.fixture(scope="session")
def small_dir(digits_dir, tmp_path_factory):
    """320 training and 40 validation digits: 5 steps of 64 per epoch, seconds per step for the demo's ResNet."""
    return digits_subset(digits_dir, tmp_path_factory.mktemp("small"), 32, 4)


@pytest.fixture(scope="session")
def tiny_dir(digits_dir, tmp_path_factory):
    """64 training digits (7 of classes 0-3, 6 of the others) and 40 validation: with a global batch of 64
    every step sees all of them, whatever the topology."""
    root = tmp_path_factory.mktemp("tiny")
    digits_subset(digits_dir, root, 7, 4)
    for cls in sorted(os.listdir(root / "train"))[4:]:
        os.remove(root / "train" / cls / sorted(os.listdir(root / "train" / cls))[-1])
    assert sum(len(os.listdir(root / "train" / c)) for c in os.listdir(root / "train")) == 64
    return str(root)


@contextlib.contextmanager
def stopped(proc: subprocess.Popen):
    """`proc` held with SIGSTOP for the block (alive, doing nothing), then let go on with SIGCONT."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def run_tfdp(*args: str, timeout: float = 300, cwd: str = REPO, env_extra: dict | None = None
             ) -> subprocess.CompletedProcess:
    """Runs the real command line, as a user would, in a fresh process."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "tfdp", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def train_one_epoch(data_format: str, data_dir, model_dir, *extra: str,
                    env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """The run a layout's tests make of its dataset: `tfdp train`, the small CNN at 8 px, one epoch on 2 replicas."""
    return run_tfdp("train", "--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=8",
                    f"--data_format={data_format}", f"--data_dir={data_dir}", f"--model_dir={model_dir}", "--epochs=1",
                    "--set=schedule.warmup_epochs=0", *extra, env_extra=env_extra)


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def assert_one_line_error(result, exit_code: int, *fragments: str, own_lines_only: bool = False) -> str:
    """The run ended with `exit_code`, no traceback, and its last line names every fragment.

    `own_lines_only` leaves out the workers' echoed output (`[worker i] ...`) of a launch: the
    survivors of a killed peer print TensorFlow's collective error, which is the trainer's to word.
    """
    stdout = result.stdout
    if own_lines_only:
        stdout = "\n".join(line for line in stdout.splitlines() if not line.startswith("[worker "))
    output = stdout + result.stderr
    assert result.returncode == exit_code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    line = last_line(result.stderr)
    assert line.startswith("tfdp: error: "), output[-3000:]
    for fragment in fragments:
        assert fragment in line, line
    return line


# A line from TensorFlow's loggers: absl/glog's "W1123 22:15:24.531337 1402 file.py:101] ..." (Python and
# C++ alike, "I0000 00:00:1795472956.490876 ..." before C++ absl is set up), C++ absl's own notice, or
# Python logging's default "WARNING:tensorflow:...".
TF_LOG_LINE = re.compile(r"(^|\s)[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+\s+\S+:\d+\]"
                         r"|\babsl::InitializeLog\(\)|\b(INFO|WARNING|ERROR):tensorflow:")


def tf_log_lines(text: str) -> list[str]:
    """The lines of a console or log that come from TensorFlow's own loggers (none, at default verbosity)."""
    return [line for line in text.splitlines() if TF_LOG_LINE.search(line)]


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def gcs_bucket():
    """A real GCS emulator server on loopback; yields its bucket's gs:// URL."""
    from support.gcs_emulator import gcs_emulator
    with gcs_emulator("tfdp-test") as bucket:
        yield bucket
