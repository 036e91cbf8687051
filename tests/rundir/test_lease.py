"""One writer per run (tfdp/rundir/lease.py): the chief's lease on model_dir, on local disk and on real GCS and S3
servers on loopback; a second run refused, a killed or expired holder taken over, the lease released."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_one_line_error, last_line, read_jsonl, run_tfdp, stopped
from tfdp.errors import UserError
from tfdp.rundir.lease import LEASE_FILE, Lease, process_alive, process_start, process_stat, store_for

HOST = socket.gethostname()


@pytest.fixture(scope="module")
def s3_bucket():
    from support.s3_server import s3_server
    with s3_server("tfdp-lease") as server:
        yield server.bucket


@pytest.fixture(params=["local", "gcs", "s3"])
def place(request, tmp_path):
    """A model_dir on local disk, in the GCS emulator's bucket, or in the S3 server's bucket (a new one per test)."""
    if request.param == "local":
        return str(tmp_path / "run")
    bucket = request.getfixturevalue("gcs_bucket" if request.param == "gcs" else "s3_bucket")
    return f"{bucket}/lease-{request.node.name.split('[')[0][-20:]}-{time.time_ns()}"


def hold_in_process(model_dir: str, timeout: float = 2.0, host: str = "") -> subprocess.Popen:
    """Another process holding the lease on `model_dir` (renewing it) until it is killed."""
    code = ("import sys, time; from tfdp.rundir.lease import Lease; "
            f"Lease({model_dir!r}, timeout={timeout}, host={host!r} or None).acquire(); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert proc.stdout.readline().strip() == "held"
    return proc


def needs_preconditions(place: str) -> None:
    if place.startswith("gs://"):
        pytest.skip("the GCS emulator (gcp-storage-emulator) ignores ifGenerationMatch; real GCS enforces it")


def lease_text(model_dir: str) -> str | None:
    return store_for(model_dir).read()[0]


def test_a_second_lease_is_refused_naming_the_holder_and_released_on_every_exit(place):
    first = Lease(place, timeout=2.0).acquire()
    holder = json.loads(lease_text(place))
    assert (holder["host"], holder["pid"]) == (HOST, os.getpid())
    with pytest.raises(UserError) as refused:
        Lease(place, timeout=2.0).acquire()
    message = str(refused.value)
    since = time.strftime("%Y-%m-%d %H:%M", time.gmtime(holder["started"]))
    assert f"model_dir {place} is in use by another run (host {HOST}, pid {os.getpid()}, since {since}" in message
    assert "\n" not in message
    time.sleep(1.0)  # past a renewal (every timeout/4)
    assert json.loads(lease_text(place))["renewed"] > holder["renewed"]
    first.release()
    assert lease_text(place) is None
    with pytest.raises(RuntimeError):  # an error inside the run releases it too
        with Lease(place, timeout=2.0):
            raise RuntimeError("boom")
    assert lease_text(place) is None


def test_the_lease_of_a_killed_process_on_this_host_is_taken_over_at_once(place, capsys):
    holder = hold_in_process(place, timeout=60.0)
    with pytest.raises(UserError, match=f"pid {holder.pid}"):
        Lease(place).acquire()  # alive: refused
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    with Lease(place, timeout=60.0):
        assert json.loads(lease_text(place))["pid"] == os.getpid()
    assert time.monotonic() - start < 10  # not the 60 s timeout: a dead pid on this host is known dead
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tfdp: lease:")]
    assert len(lines) == 1 and re.fullmatch(
        rf"tfdp: lease: took over model_dir {re.escape(place)} from host {re.escape(HOST)}, pid {holder.pid}, "
        rf"since [-0-9: ]+ UTC: its process \(pid {holder.pid}\) is gone", lines[0]), lines


def test_another_hosts_lease_is_refused_while_renewed_and_taken_over_once_expired(place, capsys):
    holder = hold_in_process(place, timeout=2.0, host="node-a")
    with pytest.raises(UserError, match="host node-a, pid"):
        Lease(place).acquire()  # watched until its next renewal
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    with Lease(place, timeout=2.0):
        pass
    assert 0.5 < time.monotonic() - start < 15  # waited for it to expire
    line = last_line(capsys.readouterr().out)
    assert re.fullmatch(rf"tfdp: lease: took over model_dir {re.escape(place)} from host node-a, pid {holder.pid}, "
                        r"since [-0-9: ]+ UTC: it was not renewed for [0-9.]+ s \(timeout 2 s\)", line), line


def test_a_holder_whose_lease_was_taken_over_says_so_and_leaves_the_new_lease_alone(place, capsys):
    """A holder stalled past its timeout on another host is taken over; its next renewal finds that out."""
    needs_preconditions(place)
    stalled = Lease(place, timeout=1.0, host="node-a").acquire()
    text, version = store_for(place).read()
    taker = json.dumps({**json.loads(text), "host": "node-b", "pid": 4242, "run_id": "taker"})
    assert store_for(place).replace(taker, version) is not None  # what a taker does: replace the version it read
    deadline = time.monotonic() + 10
    while not stalled.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    stalled.release()
    assert stalled.lost and json.loads(lease_text(place))["run_id"] == "taker"  # not renewed over, not removed
    line = last_line(capsys.readouterr().out)
    assert line.startswith(f"tfdp: lease: warning: the lease on model_dir {place} was taken over by host node-b, "
                           "pid 4242, since ") and line.endswith("this run is no longer its only writer"), line


def test_creation_is_exclusive(place):
    needs_preconditions(place)
    store = store_for(place)
    assert store.create("first") is not None
    assert store.create("second") is None
    text, version = store.read()
    assert text == "first"
    assert store.replace("third", "not the version read") is None
    assert store.replace("third", version) is not None and store.read()[0] == "third"


def demo_args(data_dir, model_dir, epochs):
    """The demo's recipe with the small CNN: who holds model_dir is the point, not the weights."""
    return ["train", "--config=configs/digits.yaml", "--model=simple_cnn", f"--data_dir={data_dir}",
            "--data_format=image_folder", f"--model_dir={model_dir}", f"--epochs={epochs}", "--set=data.image_size=16",
            "--set=train.checkpoint_every_steps=0"]


def start_train(args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tfdp", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(path, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_run_on_one_model_dir_is_refused_and_the_first_finishes_untouched(tmp_path, small_dir):
    """The first run is stopped (SIGSTOP) while it holds the lease, as a run stalled on its input or its disk
    would be: alive, so the second is refused however fast either would train; then it goes on and finishes."""
    model_dir = tmp_path / "run"
    args = demo_args(small_dir, model_dir, epochs=2)
    first = start_train(args)
    wait_for(model_dir / "config.yaml", first)   # written after the lease is taken, outside its lock
    assert (model_dir / LEASE_FILE).exists()
    with stopped(first):
        second = run_tfdp(*args)
        assert first.poll() is None  # still alive while refused
    line = assert_one_line_error(second, 2, f"model_dir {model_dir} is in use by another run",
                                 f"host {HOST}, pid {first.pid}, since ")
    assert "tfdp: config:" not in second.stdout  # it wrote nothing
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert "tfdp: lease:" not in out + err and "tfdp: done: 2 epochs" in out
    assert [r["epoch"] for r in read_jsonl(model_dir / "metrics.jsonl")] == [1, 2]
    assert sorted(p for p in os.listdir(model_dir / "checkpoints") if p.startswith("epoch-")) == [
        "epoch-0001", "epoch-0002"]
    assert not (model_dir / LEASE_FILE).exists(), line  # released at the end


@pytest.mark.slow
def test_a_lease_left_by_kill_9_is_taken_over_and_a_preempted_run_releases_it(tmp_path, small_dir):
    model_dir = tmp_path / "run"
    args = demo_args(small_dir, model_dir, epochs=20)   # more than it trains before its SIGTERM: no race with its end
    killed = start_train(args)
    wait_for(model_dir / LEASE_FILE, killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert (model_dir / LEASE_FILE).exists()
    taker = start_train(args)
    wait_for(model_dir / "checkpoints" / "epoch-0001", taker)
    taker.send_signal(signal.SIGTERM)
    out, err = taker.communicate(timeout=300)
    assert taker.returncode == 143, err[-3000:]
    taken = [line for line in out.splitlines() if line.startswith("tfdp: lease:")]
    assert len(taken) == 1 and taken[0].startswith(f"tfdp: lease: took over model_dir {model_dir} from host {HOST}, "
                                                   f"pid {killed.pid}, since "), out[-3000:]
    assert taken[0].endswith(f": its process (pid {killed.pid}) is gone")
    assert not (model_dir / LEASE_FILE).exists()  # exit 143 released it


def test_a_holder_that_exited_but_was_never_reaped_is_not_alive():
    """A zombie (exited, its parent has not reaped it: here this test is that parent) holds no lease: its pid and
    start time are still listed, its state is Z."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = process_start(proc.pid)
        assert start is not None and process_alive(proc.pid, start)
        proc.stdin.close()   # the child reads EOF and exits; nothing waits for it yet
        deadline = time.time() + 30
        while (process_stat(proc.pid) or ("?",))[0] != "Z" and time.time() < deadline:
            time.sleep(0.01)
        assert process_stat(proc.pid) == ("Z", start)
        assert not process_alive(proc.pid, start)
    finally:
        proc.wait()
    assert process_stat(proc.pid) is None and not process_alive(proc.pid, start)
