"""Real multi-process clusters on 127.0.0.1: `tfdp launch` and hand-made TF_CONFIGs."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, last_line, read_jsonl, run_tfdp, tf_log_lines
from support.cluster_runs import FAST, deterministic, layer_weights
from support.operators import tfjob_tf_configs
from tfdp.distribute.cluster import free_ports
from tfdp.errors import PREEMPTED_EXIT_CODE

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

def assert_matches_two_replica_run(tmp_path, data_dir, rtol: float, atol: float, *extra: str) -> None:
    """The weights in tmp_path/mw after epoch 4 equal a one-process 2-replica run's (global batch 64) on `data_dir`
    with the flags `extra`: `tfdp train`, in this process (the 2 logical CPUs conftest splits) instead of a third
    `tfdp` process."""
    from support.inprocess import train_in_process
    train_in_process(*FAST, f"--model_dir={tmp_path}/mirrored", "--strategy=mirrored", "--cpu_replicas=2",
                     "--batch_size_per_replica=32", *deterministic(data_dir), *extra)
    ours = layer_weights(tmp_path / "mw" / "checkpoints" / "epoch-0004" / "model.weights.h5")
    reference = layer_weights(tmp_path / "mirrored" / "checkpoints" / "epoch-0004" / "model.weights.h5")
    assert ours.keys() == reference.keys() and len(ours) >= 8
    for name in ours:
        np.testing.assert_allclose(ours[name], reference[name], rtol=rtol, atol=atol, err_msg=name)


# Fine-tuning's switch (tests/optim/test_finetune.py): the backbone frozen for epoch 1, a learning rate per layer.
FREEZE_THEN_TRAIN = ["--set=train.freeze=[backbone]", "--set=train.freeze_epochs=1", "--set=optimizer.layer_decay=0.5"]


def test_two_workers_of_two_replicas_match_each_other_and_a_two_replica_run(tmp_path, tiny_dir):
    """2 workers of 2 replicas each with the whole step compiled by XLA (the update too) against Keras' own op-by-op
    step on 2 replicas of one process: the same weights to float tolerance, and identical on both workers. Each
    worker mirrors over 2 logical CPUs (`distribute.cpu_replicas_per_worker`), as a GPU host's worker over its
    cards: its input is dealt between its replicas and the all-reduce runs within each host and across them, 4
    replicas of 16 images, the same global batch of 64. Both runs fine-tune as test_finetune.py's do, the backbone
    frozen for epoch 1 and a learning rate per layer: the workers switch together, each to its second compiled
    step. (Workers of one replica each against the same reference without the switch:
    tests/optim/test_accumulation.py, with 2 micro-batches.)"""
    launched = run_tfdp("launch", "--workers=2", f"--launch_logs={tmp_path}/logs", "--", "train", *FAST,
                        f"--model_dir={tmp_path}/mw", "--batch_size_per_replica=16",
                        "--set=distribute.cpu_replicas_per_worker=2", *deterministic(tiny_dir),
                        "--set=train.jit_compile=true", *FREEZE_THEN_TRAIN, timeout=600)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    prints = dict(re.findall(r"tfdp: worker (\d) of 2: weights fingerprint (\w+)", launched.stdout))
    assert set(prints) == {"0", "1"} and prints["0"] == prints["1"]
    assert "on 4 replica(s), global batch 64" in launched.stdout
    for worker in (0, 1):
        devices = ", ".join(f"/job:worker/replica:0/task:{worker}/device:CPU:{i}" for i in range(2))
        assert f"[worker {worker}] tfdp: strategy multi_worker: 4 replica(s) on {devices}, 2 worker(s)" \
            in launched.stdout, launched.stdout[-3000:]
    assert "xla: on (train.jit_compile: true)" in launched.stdout
    # The workers' console is a one-host run's, each line after its [worker i]: none from TensorFlow's loggers.
    assert tf_log_lines(launched.stdout + launched.stderr) == [], launched.stdout[-3000:]
    for i in (0, 1):
        log = (tmp_path / "logs" / f"worker-{i}.log").read_text()
        assert "tfdp: fine-tuning: every layer trains from epoch 2 on" in log and "tfdp: done: 4 epochs" in log, log

    assert_matches_two_replica_run(tmp_path, tiny_dir, 1e-3, 1e-4, *FREEZE_THEN_TRAIN)
    # Only the chief wrote into model_dir; the other worker's temporary output is gone.
    assert [r["epoch"] for r in read_jsonl(tmp_path / "mw" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not [p for p in os.listdir("/tmp") if p.startswith("tfdp-worker1-")]


def start_launch(args, env=None):
    """A running `tfdp launch` and its workers' pids, read from its first lines."""
    launcher = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pids = {}
    while len(pids) < 2:
        line = launcher.stdout.readline()
        assert line, "launcher ended before starting its workers"
        if m := re.match(r"tfdp: launch: worker (\d) pid (\d+)", line):
            pids[int(m.group(1))] = int(m.group(2))
    return launcher, pids


def worker(tf_config, *extra, timeout=120):
    env = {**os.environ, "TF_CONFIG": tf_config if isinstance(tf_config, str) else json.dumps(tf_config)}
    start = time.time()
    result = subprocess.run([sys.executable, "-m", "tfdp", "train", *FAST, "--strategy=multi_worker",
                             "--model_dir=/tmp/tfdp-never-written", *extra],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return result, time.time() - start


def two_workers(ports, index=0):
    return {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}


@pytest.mark.parametrize("tf_config, message", [
    ('{"cluster": {"worker": ["127.0.0.1:1"]}', "TF_CONFIG is not valid JSON: Expecting ',' delimiter at character 39"),
    (two_workers([2001, 2002], index=5), "TF_CONFIG task index 5 is out of range: the cluster has 2 'worker' task(s)"),
    ({"cluster": {"worker": ["127.0.0.1:2001"]}, "task": {"type": "chief", "index": 0}},
     "TF_CONFIG task type 'chief' is not in the cluster (it has: worker)"),
    (two_workers([2001, 2001]), "TF_CONFIG lists 127.0.0.1:2001 twice (worker 0 and worker 1)"),
])
def test_bad_cluster_spec_is_one_line_and_fast(tf_config, message):
    result, seconds = worker(tf_config)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert last_line(result.stderr) == f"tfdp: error: {message}"
    assert seconds < 60


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        result, _ = worker(two_workers([port, free_ports(1)[0]]))
    assert result.returncode == 2
    assert last_line(result.stderr) == f"tfdp: error: port {port} of worker 0 (127.0.0.1:{port}) is already in use"


def test_worker_that_never_comes_up_is_named_within_the_timeout():
    ports = free_ports(2)
    result, seconds = worker(two_workers(ports), "--set=distribute.startup_timeout=8")
    assert result.returncode == -9  # killed by its watchdog: TensorFlow's wait cannot be interrupted
    assert last_line(result.stderr) == (f"tfdp: error: cluster did not come up within 8 s; "
                                        f"not reachable: worker 1 (127.0.0.1:{ports[1]})")
    assert seconds < 60


# A ResNet with batch norm (per-replica statistics a resume must restore): the demo's ResNet-18 with one block per
# stage (the same stem and layer groups), at 0.6x its CPU.
BN_MODEL = "--model=resnet10_small"


def demo_on_workers(data_dir, model_dir, logs, checkpoint_every_steps=0, *extra):
    """The demo's recipe with a batch-norm ResNet (resnet10_small) on 2 workers, deterministic, epoch checkpoints
    only unless told, with the random flip on (a random layer whose stream a resume must continue on every replica
    of every worker); at 8 px, its smallest input. Where the images are read from, where the run is kept and how
    often it saves change nothing it computes: every variant ends with `clean_demo_run`'s weights."""
    return ["launch", "--workers=2", f"--launch_logs={logs}", "--", "train", "--config=configs/digits.yaml",
            BN_MODEL, f"--data_dir={data_dir}", "--data_format=image_folder", f"--model_dir={model_dir}", "--epochs=2",
            "--set=data.image_size=8", f"--set=train.checkpoint_every_steps={checkpoint_every_steps}",
            "--set=train.deterministic=true", "--set=data.hflip=true", *extra]


@pytest.fixture(scope="module")
def clean_demo_run(small_dir, tmp_path_factory):
    """`demo_on_workers` never interrupted: (its `tfdp launch` result, its model_dir). One run for the module: the
    SIGTERM test and the killed-worker test (on a bucket) each resume an interrupted copy of it and compare with it."""
    root = tmp_path_factory.mktemp("clean")
    clean = run_tfdp(*demo_on_workers(small_dir, root / "clean", root / "l0"), timeout=600)
    assert clean.returncode == 0, clean.stdout[-3000:]
    return clean, root / "clean"


def start_pods(tf_configs: dict, args: list[str], logs) -> dict:
    """One `python -m tfdp ARGS` process per pod (name → TF_CONFIG), as the operator starts the same command on
    every pod of a TFJob; each pod's output in logs/<name>.log."""
    logs.mkdir(parents=True, exist_ok=True)
    pods = {}
    for name, tf_config in tf_configs.items():
        with open(logs / f"{name}.log", "w") as log:
            pods[name] = subprocess.Popen([sys.executable, "-m", "tfdp", *args], cwd=REPO, stdout=log,
                                          stderr=subprocess.STDOUT, env={**os.environ, "TF_CONFIG": tf_config})
    return pods


def wait_pods(pods: dict, logs, timeout: float = 600) -> dict:
    """Each pod's exit status and output, once all have ended (killed if they outlive `timeout`)."""
    deadline = time.time() + timeout
    try:
        codes = {name: p.wait(timeout=max(deadline - time.time(), 1)) for name, p in pods.items()}
    finally:
        for p in pods.values():
            if p.poll() is None:
                p.kill()
    return {name: (codes[name], (logs / f"{name}.log").read_text()) for name in pods}


def test_sigterm_to_one_worker_saves_one_step_everywhere_and_resumes_exactly(tmp_path, small_dir, clean_demo_run):
    """SIGTERM to one pod of a TFJob: both save at one agreed step and exit 143 (128 + SIGTERM, which TFJob's
    `restartPolicy: ExitCode` restarts); the same command on the same pods then resumes with 0 steps lost, to
    the weights of the run never stopped. The pods get TF_CONFIG as Kubeflow's operator writes it, for a job of
    Master, Worker and Evaluator (support/operators.py): the master is the chief (rank 0, TensorFlow's
    /job:chief), and the evaluator's entry is in every training pod's cluster but no member of the training
    (2 workers). Chief + Workers + Evaluator pods: test_a_tfjob_with_an_evaluator_trains_on_three_pods_..."""
    clean, clean_dir = clean_demo_run   # the module's run of the same command, never stopped
    prints = dict(re.findall(r"tfdp: worker (\d) of 2: weights fingerprint (\w+)", clean.stdout))
    assert set(prints) == {"0", "1"} and prints["0"] == prints["1"]  # batch-norm statistics included
    rows = read_jsonl(clean_dir / "metrics.jsonl")
    from support.inprocess import evaluate_in_process   # `tfdp evaluate`'s function, in this process
    _, evaluated = evaluate_in_process("--config=configs/digits.yaml", BN_MODEL, f"--data_dir={small_dir}",
                                       "--data_format=image_folder", "--set=data.image_size=8",
                                       checkpoint=f"{clean_dir}/checkpoints/epoch-0002/model.weights.h5")
    assert f"loss {rows[-1]['val_loss']:.4f}, top1 {rows[-1]['val_top1']:.4f}" in evaluated

    model_dir = tmp_path / "preempted"
    train = demo_on_workers(small_dir, model_dir, tmp_path / "unused")
    command = [*train[train.index("--") + 1:], "--strategy=multi_worker"]  # the same command on every pod
    ports = iter(free_ports(3))
    local = {(rtype, 0): f"127.0.0.1:{next(ports)}" for rtype in ("Master", "Worker", "Evaluator")}
    tf_configs = tfjob_tf_configs({"Master": 1, "Worker": 1, "Evaluator": 1}, lambda rtype, i: local[rtype, i])
    trainers = {f"{rtype.lower()}-{i}": tf_configs[rtype, i] for rtype, i in (("Master", 0), ("Worker", 0))}
    pods = start_pods(trainers, command, tmp_path / "attempt-1")
    deadline = time.time() + 300
    while not (model_dir / "checkpoints" / "epoch-0001").exists() and time.time() < deadline:
        time.sleep(0.02)
    # At once, not after a pause into epoch 2: the flag is read at each step's end but an epoch's last, so a signal
    # after epoch 1's checkpoint is saved at step 6 to 9 whenever it comes, if before epoch 2's step 9 ends.
    pods["worker-0"].send_signal(signal.SIGTERM)  # only the non-chief is told
    ended = wait_pods(pods, tmp_path / "attempt-1")
    for name, (code, log) in ended.items():
        assert code == PREEMPTED_EXIT_CODE == 143, f"{name}: {code}\n{log[-3000:]}"
        job = {"master": "chief"}.get(name.split("-")[0], "worker")  # TensorFlow's job: the master is its chief
        assert re.search(rf"^tfdp: strategy multi_worker: 2 replica\(s\) on /job:{job}/replica:0/task:0/device:CPU:0, "
                         r"2 worker\(s\)$", log, re.M), log[-3000:]
    # Where both pods stop depends on when the signal lands: at a step of epoch 2, or at epoch 1's end when it
    # comes while epoch 1's checkpoint is being written. Either way both pods say the same place.
    saved = {name: re.findall(r"^tfdp: preempted: saved (at step \d+ \(epoch 2, step \d\)|at the end of epoch 1); "
                              r"exit 143 \(run the same command to continue\)$", log, re.M)
             for name, (_, log) in ended.items()}
    assert saved["master-0"] == saved["worker-0"] and len(saved["master-0"]) == 1, saved  # both pods, one place
    at_step = re.match(r"at step (\d+)", saved["master-0"][0])
    if at_step:
        step = int(at_step.group(1))
        assert 5 < step < 10 and (model_dir / "checkpoints" / f"step-{step:09d}").exists()

    again = wait_pods(start_pods(trainers, command, tmp_path / "attempt-2"), tmp_path / "attempt-2")
    assert {name: code for name, (code, _) in again.items()} == {"master-0": 0, "worker-0": 0}, again
    chief_log = again["master-0"][1]
    resumed_at = re.search(r"^tfdp: resuming at epoch 2 of 2(, step \d+ of 5)? from ", chief_log, re.M)
    assert resumed_at, chief_log[-3000:]  # 0 steps lost: the step after the saved one
    assert resumed_at.group(1) == (f", step {step - 5 + 1} of 5" if at_step else None), resumed_at.group(0)
    resumed = dict(re.findall(r"tfdp: worker (\d) of 2: weights fingerprint (\w+)", chief_log + again["worker-0"][1]))
    assert resumed == prints  # bit-identical to the run never stopped
    assert [r["epoch"] for r in read_jsonl(model_dir / "metrics.jsonl")] == [1, 2]


def test_after_one_preempted_exit_the_launcher_lets_the_others_exit_on_their_own():
    """Workers that saved at an agreed step end a moment apart. The first one's status 143 must not get the
    others a SIGTERM while they finish (their preemption handler is gone by then, so it would kill them
    before they say where they saved): each says its line and ends with 143 itself."""
    from tfdp.distribute.launch import _wait
    finishing = ("import sys, time; time.sleep({}); print('saved at step 7', flush=True); sys.exit(%d)"
                 % PREEMPTED_EXIT_CODE)
    procs = [subprocess.Popen([sys.executable, "-c", finishing.format(delay)], stdout=subprocess.PIPE, text=True)
             for delay in (0.0, 1.5)]
    index, code = _wait(procs)
    assert (index, code) == (0, 143)
    assert [p.wait() for p in procs] == [143, 143]
    assert [p.stdout.read() for p in procs] == ["saved at step 7\n"] * 2


@pytest.mark.full(reason="80 CPU-s of three pods: the TFJob's manifests are checked by "
                         "tests/distribute/test_operators.py, two workers training as one by "
                         "test_two_workers_of_two_replicas_match_each_other_and_a_two_replica_run")
def test_a_tfjob_with_an_evaluator_trains_on_three_pods_and_evaluates_each_epoch_once(tmp_path, tiny_dir):
    """Chief, 2 Workers and an Evaluator, each pod the same `tfdp train` with TF_CONFIG as Kubeflow's operator
    writes it (support/operators.py). The three trainers skip their own validation (train.validate: auto) and
    end with one set of weights; the evaluator pod joins no collective, evaluates every epoch's checkpoint
    once, keeps the best one, and ends with the run; its figures are `tfdp evaluate`'s on the same file. The
    model is the small ViT (`vit_mini_patch4_small`, drop path on) at 8 px (2 x 2 patches of 4 px): a transformer
    trains as one on 3 workers."""
    model_dir = tmp_path / "run"
    vit = [*FAST, "--model=vit_mini_patch4_small", "--set=model.drop_path=0.1"]
    command = ["train", *vit, f"--data_dir={tiny_dir}", "--data_format=image_folder", f"--model_dir={model_dir}",
               "--strategy=multi_worker", "--batch_size_per_replica=16", "--epochs=2",
               "--set=train.checkpoint_every_steps=0", "--poll_seconds=0.2"]
    replicas = {"Chief": 1, "Worker": 2, "Evaluator": 1}
    ports = dict(zip([(r, i) for r, n in replicas.items() for i in range(n)], free_ports(4)))
    tf_configs = tfjob_tf_configs(replicas, lambda rtype, i: f"127.0.0.1:{ports[rtype, i]}")
    pods = {f"{rtype.lower()}-{i}": tf_config for (rtype, i), tf_config in tf_configs.items()}
    ended = wait_pods(start_pods(pods, command, tmp_path / "logs"), tmp_path / "logs")
    assert {name: code for name, (code, _) in ended.items()} == dict.fromkeys(pods, 0), {
        name: log[-2000:] for name, (_, log) in ended.items()}

    trainers = [log for name, (_, log) in ended.items() if not name.startswith("evaluator")]
    prints = [re.findall(r"tfdp: worker (\d) of 3: weights fingerprint (\w+)", log) for log in trainers]
    assert sorted(p[0][0] for p in prints) == ["0", "1", "2"] and len({p[0][1] for p in prints}) == 1, prints
    for log in trainers:
        assert "tfdp: validation: not on the workers (train.validate: auto): the cluster's evaluator task" in log
    assert not [r for r in read_jsonl(model_dir / "metrics.jsonl") if "val_top1" in r]

    evaluator = ended["evaluator-0"][1]
    assert "tfdp: strategy mirrored: 2 replica(s)" in evaluator   # its own devices: no member of the cluster
    assert "weights fingerprint" not in evaluator and "Epoch 1/" not in evaluator
    lines = re.findall(rf"^tfdp: evaluate: {model_dir}/checkpoints/(epoch-\d+): (loss .*)$", evaluator, re.M)
    assert [name for name, _ in lines] == ["epoch-0001", "epoch-0002"], evaluator[-3000:]
    assert "tfdp: evaluate: training ended (epoch 2 of 2 evaluated); 2 checkpoint(s) evaluated" in evaluator
    rows = read_jsonl(model_dir / "eval_metrics.jsonl")
    assert [(r["checkpoint"], r["epoch"], r["examples"]) for r in rows] == [("epoch-0001", 1, 40),
                                                                             ("epoch-0002", 2, 40)]
    best = json.loads((model_dir / "checkpoints" / "best.json").read_text())
    assert best["value"] == max(r["val_top1"] for r in rows)

    from support.inprocess import evaluate_in_process   # `tfdp evaluate`'s function, in this process
    _, evaluated = evaluate_in_process(*vit, f"--data_dir={tiny_dir}", "--data_format=image_folder",
                                       "--batch_size_per_replica=16",
                                       checkpoint=f"{model_dir}/checkpoints/epoch-0002/model.weights.h5")
    assert f"tfdp: evaluate: {lines[1][1]}" in evaluated


@pytest.mark.full(reason="150 CPU-s, two workers killed twice: a checkpoint without its marker is never resumed "
                         "from (tests/rundir/test_bucket_run.py's uncommitted-checkpoint test), and two workers "
                         "resume exactly "
                         "(test_sigterm_to_one_worker_saves_one_step_everywhere_and_resumes_exactly)")
def test_two_workers_killed_between_a_checkpoints_objects_and_its_marker_resume_exactly(small_dir, tmp_path,
                                                                                        clean_demo_run):
    """`demo_on_workers` reading its images from a bucket and keeping the run there (a real S3 server on loopback,
    tests/rundir/test_bucket_run.py has the rest of a bucket run). The chief is killed with -9 mid-epoch (the
    launcher names the signal, stops the other worker and exits 4) at the worst moment: a step checkpoint's objects
    are in the bucket and its marker's PUT is on the wire (a proxy in front of the server holds it back). The same
    command resumes from the previous committed checkpoint to the weights of the module's `clean_demo_run` (local
    images, local model_dir, epoch checkpoints only: none of that changes what is computed), and the uncommitted
    objects never count. A step checkpoint every 3 steps (3, 6, 9 and the epochs'): each is 38 MB of weights
    through the server."""
    import fsspec
    from support.holding_proxy import holding_proxy
    from support.s3_server import s3_server
    from test_bucket_run import committed, objects
    clean, _ = clean_demo_run
    prints = dict(re.findall(r"tfdp: worker (\d) of 2: weights fingerprint (\w+)", clean.stdout))
    with s3_server("tfdp-workers") as s3:
        fs, _ = fsspec.core.url_to_fs(s3.bucket)
        fs.put(small_dir, f"{s3.bucket}/data", recursive=True)
        run = f"{s3.bucket}/killed"
        launch = demo_on_workers(f"{s3.bucket}/data", run, tmp_path / "logs", 3,
                                 f"--set=data.cache_dir={tmp_path}/cache", f"--set=scratch_dir={tmp_path}/scratch")
        marker = "/killed/checkpoints/step-000000009/commit.json"   # epoch 2, step 4 of 5
        with holding_proxy(s3.endpoint, lambda method, path: method == "PUT" and path.endswith(marker)) as proxy:
            env = {**os.environ, **s3.env, "AWS_ENDPOINT_URL": proxy.url}
            launcher, pids = start_launch([sys.executable, "-m", "tfdp", *launch], env=env)
            if not proxy.held.wait(300):
                launcher.kill()
                pytest.fail("the marker was never sent: " + launcher.communicate()[1][-3000:])
            os.kill(pids[0], signal.SIGKILL)   # the chief, its marker on the wire
            _, err = launcher.communicate(timeout=120)
        assert launcher.returncode == 4   # EXIT_WORKER_KILLED
        assert ("tfdp: error: worker 0 was killed by SIGKILL (signal 9), which the launcher did not send; "
                "stopped the other workers") in err
        for pid in pids.values():  # nothing left running
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
        listing = objects(fs, run)
        assert {"checkpoints/step-000000009/model.weights.h5", "checkpoints/step-000000009/state.json"} <= set(listing)
        assert "step-000000006" in committed(listing) and "step-000000009" not in committed(listing)

        again = run_tfdp(*launch, env_extra=s3.env, timeout=600)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
        assert "resuming at epoch 2 of 2, step 2 of 5 from checkpoints/step-000000006" in again.stdout
        assert dict(re.findall(r"tfdp: worker (\d) of 2: weights fingerprint (\w+)", again.stdout)) == prints
        listing = objects(fs, run)
    assert sorted(p for p in listing if p.startswith("metrics/")) == [
        "metrics/epoch-000001.jsonl", "metrics/epoch-000002.jsonl"]
    assert {p.split("/")[1] for p in listing if p.startswith("checkpoints/") and p.count("/") > 1} == set(
        committed(listing))
