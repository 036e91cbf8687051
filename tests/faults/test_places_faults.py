"""Faults at the edges of tfdp: an unreachable bucket, a launch whose
worker dies, start-up cost of commands that need no TensorFlow. Every case is a
real process (and, where one is needed, a real server on loopback)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, assert_one_line_error, run_tfdp
from support.imports import heavy, imported_modules
from tfdp.distribute.cluster import free_ports
from tfdp.distribute.launch import EXIT_CLUSTER_TIMEOUT, EXIT_WORKER_KILLED


# --- a bucket that cannot be reached --------------------------------------------------------

@contextlib.contextmanager
def silent_server():
    """A loopback server that accepts connections and never answers: a hung endpoint."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted, stop = [], threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(server.accept()[0])
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def train_from_bucket(endpoint: str, timeout_s: float):
    """`tfdp train` on gs://nobody/data with gcsfs pointed at `endpoint`; (result, seconds)."""
    start = time.monotonic()
    result = run_tfdp("train", "--data_format=image_folder", "--data_dir=gs://nobody/data",
                      "--model_dir=/tmp/tfdp-never-written", f"--set=data.remote_timeout={timeout_s}",
                      timeout=120, env_extra={"STORAGE_EMULATOR_HOST": endpoint})
    return result, time.monotonic() - start


def test_bucket_endpoint_that_never_answers_is_one_line_within_the_timeout():
    with silent_server() as port:
        result, seconds = train_from_bucket(f"http://127.0.0.1:{port}", 3)
    endpoint = f"http://127.0.0.1:{port}"
    assert_one_line_error(result, 2, endpoint, "did not answer within 3 s", "data.remote_timeout",
                          "gs://nobody/data")
    assert 3 <= seconds < 3 + 20, seconds  # the timeout, plus interpreter start-up; gcsfs alone took ~40 s


def test_bucket_endpoint_that_refuses_is_one_line_at_once():
    port = free_ports(1)[0]  # nothing listens there
    result, seconds = train_from_bucket(f"http://127.0.0.1:{port}", 30)
    assert_one_line_error(result, 2, f"http://127.0.0.1:{port}", "refused", "gs://nobody/data")
    assert seconds < 20, seconds  # long before the 30 s timeout: a refusal needs no waiting


def test_a_url_whose_driver_connects_as_it_is_made_is_one_line():
    """fsspec's ftp:// (and hdfs://, sftp://) driver connects when it is made, before tfdp's bucket probe: a
    refusal there is the same one line, for the data and for model.init_from alike (`storage.filesystem`)."""
    port = free_ports(1)[0]  # nothing listens there
    for setting in (f"--data_dir=ftp://127.0.0.1:{port}/data", f"--set=model.init_from=ftp://127.0.0.1:{port}/w.h5"):
        result = run_tfdp("train", "--data_format=image_folder", setting, "--model_dir=/tmp/tfdp-never-written",
                          timeout=120)
        assert_one_line_error(result, 2, f"cannot open ftp://127.0.0.1:{port}/", "Connection refused")


# --- tfdp launch: a worker that dies or never starts ----------------------------------------

SYNTHETIC = ["--data_format=synthetic", "--set=data.synthetic_examples=4096", "--model=simple_cnn",
             "--set=data.image_size=16", "--batch_size_per_replica=8", "--epochs=50", "--set=log.tensorboard=false"]


def scratch_left(tmpdir) -> list[str]:
    """Whatever a launch left in its temp dir: its scratch folder, or any worker's."""
    return [p.name for p in tmpdir.iterdir() if p.name.startswith(("tfdp-launch-", "tfdp-worker"))]


def start_launch(tmp_path, *train_args: str):
    """A `tfdp launch --workers=2` in its own TMPDIR; (process, tmpdir, {worker index: (pid, address)})."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    args = [sys.executable, "-m", "tfdp", "launch", "--workers=2", f"--launch_logs={tmp_path}/logs", "--", "train",
            *train_args, f"--model_dir={tmp_path}/run"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmpdir)})
    pids = {}
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line, "launcher ended before starting its workers"
        if m := re.match(r"tfdp: launch: worker (\d) pid (\d+) at ([\d.:]+),", line):
            pids[int(m.group(1))] = (int(m.group(2)), m.group(3))
    return proc, tmpdir, pids


def finish(proc, timeout=180):
    """Waits for the launcher; a CompletedProcess-like result for the shared assertions."""
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.multiworker
def test_launch_removes_its_scratch_and_a_dead_launchers_after_a_worker_fails(tmp_path):
    """A worker's own failure is passed on; the scratch goes, and so does one a SIGKILLed launcher left."""
    tmpdir = tmp_path / "tmp"
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmpdir / f"tfdp-launch-{dead.pid}-x" / "tfdp-worker1-y"
    stale.mkdir(parents=True)
    result = run_tfdp("launch", "--workers=1", f"--launch_logs={tmp_path}/logs", "--", "train", "--set=no.such=1",
                      timeout=120, env_extra={"TMPDIR": str(tmpdir)})
    assert_one_line_error(result, 2, "worker 0 exited with status 2", "stopped the other workers")
    assert "unknown config key 'no'" in result.stdout  # the worker's own line, prefixed [worker 0]
    assert scratch_left(tmpdir) == []


@pytest.mark.multiworker
def test_killed_worker_leaves_no_scratch_and_a_documented_status(tmp_path):
    proc, tmpdir, pids = start_launch(tmp_path, *SYNTHETIC)
    deadline = time.monotonic() + 240
    while not list(tmpdir.glob("tfdp-launch-*/tfdp-worker1-*")):  # worker 1 is training, with scratch
        assert proc.poll() is None and time.monotonic() < deadline, "worker 1 never started training"
        time.sleep(0.1)
    os.kill(pids[1][0], signal.SIGKILL)
    result = finish(proc)
    assert_one_line_error(result, EXIT_WORKER_KILLED, "worker 1 was killed by SIGKILL (signal 9)",
                          "the launcher did not send", own_lines_only=True)
    assert scratch_left(tmpdir) == []
    assert not any(os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read().lower()
                   for pid, _ in pids.values())


@pytest.mark.multiworker
def test_worker_that_never_starts_is_not_reported_as_killed(tmp_path):
    """A frozen worker 1: worker 0's watchdog gives up, and the launcher says so, with its own status."""
    proc, tmpdir, pids = start_launch(tmp_path, *SYNTHETIC, "--set=distribute.startup_timeout=5")
    os.kill(pids[1][0], signal.SIGSTOP)
    try:
        result = finish(proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1][0], signal.SIGKILL)
    line = assert_one_line_error(result, EXIT_CLUSTER_TIMEOUT, "worker 0 gave up: cluster did not come up within 5 s",
                                 f"not reachable: worker 1 ({pids[1][1]})", own_lines_only=True)
    assert result.returncode != 137, line
    assert scratch_left(tmpdir) == []


# --- commands that need no TensorFlow do not import it --------------------------------------

def write_metrics(model_dir) -> None:
    rows = [{"epoch": e, "loss": 2.0 / e, "val_loss": 1.9 / e, "top1": 0.2 * e, "val_top1": 0.25 * e,
             "val_top5": 0.3 * e, "lr": 0.1 / e, "images_per_sec": 100.0 * e, "seconds": 3.0 / e} for e in (1, 2)]
    model_dir.mkdir(exist_ok=True)
    (model_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_draws_without_importing_tensorflow(tmp_path):
    write_metrics(tmp_path / "run")
    result, modules = imported_modules("report", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "report" / "loss.png").exists()
    assert "matplotlib" in modules  # the check sees real imports
    assert heavy(modules) == set()


def test_report_error_does_not_import_tensorflow(tmp_path):
    result, modules = imported_modules("report", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"no metrics.jsonl in {tmp_path}" in result.stderr
    assert heavy(modules) == set()


@pytest.mark.parametrize("args", [["--help"], ["--helpfull"], ["train", "--help"], ["launch", "--help"],
                                  ["report", "--help"], ["benchmark", "--help"]])
def test_help_does_not_import_tensorflow(args):
    result, modules = imported_modules(*args)
    assert "tfdp COMMAND" in result.stdout and "Traceback" not in result.stderr
    assert heavy(modules) == set()


def test_the_import_check_does_see_tensorflow():
    """What `report` imported before (the Keras callbacks' module): the check must see it, or the tests above prove nothing."""
    result, modules = imported_modules("-c", "import tfdp.train.callbacks", module=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tensorflow" in heavy(modules)
