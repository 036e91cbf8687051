"""The project's own docker/slurm/train.sbatch, submitted to a real one-node Slurm cluster on loopback.

Two tasks on one node, no GPUs: they form one MultiWorkerMirroredStrategy
cluster from Slurm's variables, `scancel --signal=TERM` mid-run makes both save
at one step and exit 143 (128 + SIGTERM), the script requeues the job, and the
next attempt resumes at the following step. The job's log keeps every attempt, and no task
prints a line from TensorFlow's own loggers.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, digits_subset, read_jsonl, tf_log_lines
from support import slurm as slurm_support

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

TEMPLATE = os.path.join(REPO, "docker", "slurm", "train.sbatch")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture(scope="module")
def slurm():
    why = slurm_support.unavailable()
    if why:
        pytest.skip(why)
    started = slurm_support.slurm_cluster(cpus=2)
    try:
        cluster = started.__enter__()
    except RuntimeError as e:
        pytest.skip(f"a one-node Slurm cluster cannot be started here: {e}")
    try:
        yield cluster
    finally:
        started.__exit__(None, None, None)


@pytest.fixture(scope="module")
def slurm_data(digits_dir, tmp_path_factory):
    """160 training and 40 validation digits: 20 steps of 8 per epoch on 2 workers."""
    return digits_subset(digits_dir, tmp_path_factory.mktemp("slurm-data"), 16, 4)


def two_free_ports() -> int:
    """A port p with p and p + 1 free: the two tasks on the node listen on base + local task index.

    Below the kernel's ephemeral range: a requeued job binds the same two ports again some 20 s after its
    first attempt, and in between any outgoing connection of the suite's other processes could be given
    one of them as its local port if they were taken from that range."""
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="utf-8") as f:
        ephemeral_start = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(10000, ephemeral_start - 1)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("", port))
                b.bind(("", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def wait(what: str, ready, timeout: float, log=lambda: ""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout:.0f} s\n{log()}")


def attempts(log: str) -> list[tuple[int, int, str]]:
    """(attempt, SLURM_RESTART_COUNT, that attempt's lines) for each header the template printed."""
    parts = re.split(r"^tfdp: slurm job \d+ attempt (\d+) \(SLURM_RESTART_COUNT=(\d+)\).*$", log, flags=re.M)
    return [(int(parts[i]), int(parts[i + 1]), parts[i + 2]) for i in range(1, len(parts), 3)]


def saved_step(where: str, steps_per_epoch: int) -> int:
    """The global step a preemption line's `step N` or `the end of epoch E` names."""
    number = int(where.rsplit(" ", 1)[1])
    return number if where.startswith("step") else number * steps_per_epoch


@pytest.mark.full(reason="85 CPU-s of a Slurm job requeued: the SIGTERM save it relies on is "
                         "tests/train/test_resume.py's "
                         "test_sigterm_on_one_host_saves_where_it_is_and_loses_no_step, the requeue's exit "
                         "status tests/distribute/test_multi_worker.py's launcher tests")
def test_template_preempted_by_scancel_requeues_and_resumes_losing_no_step(slurm, slurm_data, tmp_path):
    model_dir = tmp_path / "run"
    env = {k: v for k, v in slurm.env.items() if k not in ("TF_CONFIG", "TFDP_WORKERS", "TFDP_WORKER_INDEX")}
    env.update(TFDP=os.path.join(os.path.dirname(sys.executable), "tfdp"), MODEL_DIR=str(model_dir),
               TFDP_SLURM_PORT_BASE=str(two_free_ports()))
    # The template as written, with what a CPU host must change on sbatch's command line (one node,
    # 2 tasks of 1 CPU, no GPUs, a time limit for a test), and a small run as the script's arguments.
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
         "--time=15", f"--output={tmp_path}/tfdp-%j.out", TEMPLATE,
         "--model=simple_cnn", f"--data_dir={slurm_data}", "--data_format=image_folder", "--epochs=2",
         "--batch_size_per_replica=4", "--set=train.checkpoint_every_steps=5"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    out = tmp_path / f"tfdp-{job_id}.out"

    def log() -> str:
        return out.read_text() if out.exists() else ""

    def diagnosis() -> str:
        return f"{log()[-4000:]}\n{slurm.job(job_id)}\n{slurm.logs()[-3000:]}"

    # Preempt mid-run: once the first mid-epoch checkpoint (step 5 of 40) is there.
    checkpoints = model_dir / "checkpoints"
    def step_saved() -> bool:
        return checkpoints.exists() and any(p.startswith("step-") for p in os.listdir(checkpoints))
    wait("step checkpoint", lambda: step_saved() or slurm.job(job_id)["JobState"] in ENDED, timeout=300,
         log=diagnosis)
    assert slurm.job(job_id)["JobState"] == "RUNNING", diagnosis()
    slurm.run("scancel", "--signal=TERM", job_id)

    # The script requeues the job; Slurm starts it again once the old attempt's credential has
    # expired (AuthInfo cred_expire: 120 s by default, 15 s on the test's cluster).
    final = wait("end of the requeued job", lambda: (j := slurm.job(job_id))["JobState"] in ENDED
                 and j["Restarts"] != "0" and j, timeout=400, log=diagnosis)
    assert (final["JobState"], final["Restarts"], final["ExitCode"]) == ("COMPLETED", "1", "0:0"), diagnosis()

    text = log()
    print(text)  # shown by pytest -s, or on failure
    runs = attempts(text)
    assert [(a, restarts) for a, restarts, _ in runs] == [(1, 0), (2, 1)], text[-4000:]
    first, second = runs[0][2], runs[1][2]
    for lines in (first, second):  # one cluster from Slurm's variables: rank r is worker task r of 2
        members = re.findall(r"^(\d): tfdp: strategy multi_worker: 2 replica\(s\) on /job:worker/replica:0/task:(\d)/"
                             r"device:CPU:0, 2 worker\(s\)$", lines, re.M)
        assert sorted(members) == [("0", "0"), ("1", "1")], lines[-3000:]

    # The first attempt: both tasks saved at one step, exit 143, and its lines are still in the log. The
    # TERM lands wherever the run is: mid-epoch (`saved at step N (epoch E, step S)`) or, on a loaded host,
    # at an epoch's end (`saved at the end of epoch E`); either way both ranks name the same place.
    steps_per_epoch = int(re.search(r"^0: tfdp: data: .* (\d+) steps/epoch$", first, re.M).group(1))
    saved = re.findall(r"^(\d): tfdp: preempted: saved at (step \d+|the end of epoch \d+)\b.*; exit 143 ", first, re.M)
    assert sorted(rank for rank, _ in saved) == ["0", "1"] and saved[0][1] == saved[1][1], first[-3000:]
    step = saved_step(saved[0][1], steps_per_epoch)
    assert re.search(r"attempt 1 ended with status 143$", first, re.M), first[-2000:]
    assert steps_per_epoch == 20 and 5 <= step < 2 * steps_per_epoch

    # The second: resumed at the step after the saved one (0 steps lost), finished, equal weights.
    epoch, in_epoch = divmod(step, steps_per_epoch)
    where = f", step {in_epoch + 1} of {steps_per_epoch}" if in_epoch else ""
    assert re.search(rf"^0: tfdp: resuming at epoch {epoch + 1} of 2{re.escape(where)} from ", second, re.M), \
        second[-3000:]
    assert "tfdp: preempted" not in second
    prints = dict(re.findall(r"^(\d): tfdp: worker \1 of 2: weights fingerprint (\w+)$", second, re.M))
    assert set(prints) == {"0", "1"} and prints["0"] == prints["1"], second[-3000:]
    assert re.search(r"attempt 2 ended with status 0$", second, re.M)
    assert [r["epoch"] for r in read_jsonl(model_dir / "metrics.jsonl")] == [1, 2]

    # A quiet console: what a one-host run prints, each line after its task's rank.
    assert tf_log_lines(text) == [], text[-4000:]
