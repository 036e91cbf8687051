"""Elastic resume (`tfdp.train.input_streams`): a checkpoint of W workers x R replicas goes on at W' x R' with the same global
batch and, step by step, the same examples in every global batch."""

import collections
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import tensorflow as tf

from support.inprocess import train_in_process
from tests.conftest import REPO, assert_one_line_error, run_tfdp
from tfdp.config import validate
from tfdp.data import build_source
from tfdp.data.pipeline import Bookkeeping, StreamPosition, streams_dataset, train_dataset
from tfdp.train.input_streams import plan_streams

GLOBAL = 64


def data_cfg(small_dir):
    return validate({"data": {"format": "image_folder", "dir": small_dir, "image_size": 16, "hflip": False,
                              "deterministic": True}}).data


def steps_of(ds, batches_per_step, steps):
    """Each step's examples, as a multiset of (image bytes, label) digests."""
    out, it = [], iter(ds)
    for _ in range(steps):
        step = collections.Counter()
        for _ in range(batches_per_step):
            images, labels = next(it)
            for image, label in zip(images.numpy(), labels.numpy()):
                step[hashlib.sha1(image.tobytes() + bytes([label])).hexdigest()] += 1
        out.append(step)
    return out


def original_layout(split, data, steps, position=None):
    """2 workers, one replica each: step i = batch i of stream 0 + batch i of stream 1."""
    per_stream = []
    for s in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=s, num_replicas_in_sync=2)
        pos = StreamPosition()
        per_stream.append((steps_of(train_dataset(split, data, GLOBAL, 5, ctx, Bookkeeping(position=pos)), 1, steps), pos))
    merged = [a + b for a, b in zip(per_stream[0][0], per_stream[1][0])]
    return merged, [pos for _, pos in per_stream]


@pytest.mark.parametrize("replicas", [1, 2])
def test_two_streams_read_by_one_worker_hold_the_same_global_batches(small_dir, replicas):
    """A 2-worker run stopped after 2 of its 5 steps per epoch goes on from its checkpoint on 1 worker (1 or 2
    replicas): each later step holds exactly the examples it held on 2 workers, and the interrupted epoch's
    steps together hold every one of its 320 examples once."""
    data = data_cfg(small_dir)
    split = build_source(data).split("train")
    epoch_steps = split.num_examples // GLOBAL
    uninterrupted, positions = original_layout(split, data, epoch_steps + 2)
    stopped = [pos.after(2) for pos in positions]  # what the checkpoint after step 2 records
    assert stopped == [(32 * 2, 0), (32 * 2, 0)]
    ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=replicas)
    resumed = streams_dataset(split, data, GLOBAL, 5, 2, {s: Bookkeeping(start, StreamPosition())
                                                          for s, start in enumerate(stopped)}, ctx)
    went_on = steps_of(resumed, replicas, epoch_steps)  # the rest of the epoch, and 2 steps of the next
    assert went_on == uninterrupted[2:]
    epoch = sum(uninterrupted[:2] + went_on[:epoch_steps - 2], collections.Counter())
    assert sum(epoch.values()) == epoch_steps * GLOBAL
    whole = sum(uninterrupted[:epoch_steps], collections.Counter())
    assert epoch == whole  # none skipped, none repeated


def test_streams_are_dealt_to_a_divisor_of_their_count_or_named_as_inexact():
    state = {"epoch": 0, "step": 3, "input": [[96, 0], [96, 1], [90, 0], [96, 0]]}
    streams, line = plan_streams(state, 2, 1, 3, GLOBAL, service=False)
    assert (streams.count, streams.mine, streams.starts) == (4, (2, 3), ((90, 0), (96, 0)))
    assert "4 input streams go on exactly on 2 worker(s), 2 each" in line
    streams, line = plan_streams(state, 3, 0, 3, GLOBAL, service=False)
    assert (streams.count, streams.mine, streams.starts) == (3, (0,), ((3 * (GLOBAL // 3), 0),))
    assert "cannot be dealt evenly to 3 worker(s)" in line and "may repeat or be skipped" in line
    _, line = plan_streams(state, 2, 0, 3, GLOBAL, service=True)
    assert "tf.data service" in line
    assert plan_streams({**state, "input": state["input"][:2]}, 2, 1, 3, GLOBAL, service=False)[1] == ""


def demo(data_dir, model_dir, replicas, *extra):
    """The demo's data, a model without batch norm, deterministic; a step checkpoint every 3 of 10 steps."""
    return ["train", "--config=configs/digits.yaml", f"--data_dir={data_dir}", "--data_format=image_folder",
            f"--model_dir={model_dir}", "--model=simple_cnn", "--set=data.image_size=16", "--epochs=2",
            "--set=train.deterministic=true", "--set=train.checkpoint_every_steps=3", f"--cpu_replicas={replicas}",
            "--set=train.batch_size_per_replica=32", *extra]


def kernels(model_dir):
    out = {}
    with h5py.File(os.path.join(model_dir, "checkpoints", "epoch-0002", "model.weights.h5")) as f:
        f["layers"].visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset)
                               else None)
    return out


def epoch_states(model_dir):
    """Each epoch checkpoint's state.json: its step, input streams' positions and the batch that wrote it."""
    return {epoch: json.loads((model_dir / "checkpoints" / f"epoch-{epoch:04d}" / "state.json").read_text())
            for epoch in (1, 2)}


def kill_after_first_step_checkpoint(args, model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "tfdp", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not (model_dir / "checkpoints" / "step-000000003").exists() and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers alike
    out = proc.communicate()[0]
    # The workers, orphaned, may still be dying when the launcher's output ends: until the kernel has ended them
    # the lease the chief held names a running process (a resume that starts at once, in this process, would be
    # refused). Waited for until the group is gone (an ended but unreaped worker no longer holds the lease).
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    return out


@pytest.fixture(scope="module")
def two_replica_runs(tmp_path_factory, small_dir):
    """The demo on 2 replicas (global batch 64 = 32 x 2), once uninterrupted (in this process) and once killed
    (SIGKILL, a `tfdp` process) after its step checkpoint of step 3 of 10: (the clean run's model_dir, the killed
    one's)."""
    root = tmp_path_factory.mktemp("two_replicas")
    _, clean = train_in_process(*demo(small_dir, root / "clean", 2)[1:])  # no kill: the process is not the point
    assert "global batch 64" in clean
    kill_after_first_step_checkpoint(demo(small_dir, root / "killed", 2), root / "killed")
    return root / "clean", root / "killed"


def resume(args, replicas):
    """The resumed run's stdout: in this process on 1 or 2 replicas, a `tfdp` process on more (the test process
    cannot split its CPU again)."""
    if replicas <= 2:
        return train_in_process(*args[1:])[1]
    resumed = run_tfdp(*args, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return resumed.stdout


def resumed_copy(killed, tmp_path):
    """A copy of the killed run's model_dir, so each test resumes the same checkpoint."""
    model_dir = tmp_path / "run"
    shutil.copytree(killed, model_dir)
    return model_dir


def assert_ends_as(model_dir, clean_dir):
    """Same learning rate per epoch, metrics continued, every epoch checkpoint at the same step and input
    position, and the final weights of the uninterrupted run to float rounding: each weight within 1e-5 of
    itself and of its tensor's largest weight (the all-reduce's order, see the next test)."""
    rows = [json.loads(line) for line in open(model_dir / "metrics.jsonl")]
    clean_rows = [json.loads(line) for line in open(clean_dir / "metrics.jsonl")]
    assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in clean_rows], rel=1e-6)  # same schedule
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in clean_rows], rel=1e-3)  # metrics went on
    states, clean_states = epoch_states(model_dir), epoch_states(clean_dir)
    for epoch in (1, 2):  # the stream went on where it stopped: the same records consumed after each epoch
        assert (states[epoch]["step"], states[epoch]["input"], states[epoch]["global_batch"]) == \
            (clean_states[epoch]["step"], clean_states[epoch]["input"], 64), epoch
    a, b = kernels(clean_dir), kernels(model_dir)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-5 * np.abs(a[name]).max(), err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("replicas,cut", [
    (1, "1 replica x 32 x 2 micro-batches"),      # fewer replicas: accumulation makes up for them
    (4, "4 replicas x 16 x 1 micro-batch"),       # more: the per-replica batch shrinks
])
def test_a_requeued_run_on_other_replicas_goes_on_at_the_checkpoints_global_batch(two_replica_runs, tmp_path,
                                                                                  small_dir, replicas, cut):
    """Killed after step 3 of 10 on 2 replicas and restarted by the same command on 1 or 4 (nothing else
    changed, as a requeued Slurm or Kubernetes job on other hardware; on 1 replica the resumed run is `tfdp train`'s
    function in this process, on 4 a `tfdp` process): the run keeps the checkpoint's global
    batch 64, continues its input stream where it stopped and ends with the uninterrupted run's weights.

    Not bit for bit in general: each replica's gradient is the mean over its own images and the all-reduce
    sums the replicas', so 4 replicas of 16 add the same 64 per-example gradients in another order than 2
    of 32 (or 1 replica's 2 micro-batches of 32, which happen to repeat the 2 replicas' order), and float32
    rounds differently: at most a few 1e-6 of a tensor's largest weight after 7 steps of SGD with momentum.
    The tolerance, 1e-5 of it, is far below what one changed example, step or learning rate would move
    them."""
    clean_dir, killed = two_replica_runs
    model_dir = resumed_copy(killed, tmp_path)
    out = resume(demo(small_dir, model_dir, replicas), replicas)
    assert f"tfdp: resuming at the checkpoint's global batch 64: {cut} " \
           f"(the checkpoint's: 2 replicas x 32 x 1 micro-batch)" in out, out
    assert re.search(r"resuming at epoch 1 of 2, step 4 of 5", out), out
    assert epoch_states(model_dir)[2]["layout"]["replicas"] == replicas  # the new layout wrote the rest
    assert_ends_as(model_dir, clean_dir)


@pytest.mark.full(reason="60 CPU-s of a cluster: a resume on other replicas keeping the global batch is "
                         "test_a_requeued_run_on_other_replicas_goes_on_at_the_checkpoints_global_batch")
@pytest.mark.slow
@pytest.mark.multiworker
def test_killed_on_two_workers_and_resumed_on_one_ends_as_the_uninterrupted_run(tmp_path, small_dir):
    """Killed after step 3 of 10 on 2 workers (1 replica each), restarted on 1 worker and 1 replica: the
    checkpoint's 2 input streams are both read by the one worker, at the checkpoint's global batch 64 (32 x 2
    micro-batches), and the run ends with the uninterrupted 2-worker run's weights to float rounding (the
    all-reduce sums in another order; see the test above). The resumed run is `tfdp train`'s function in this
    process."""
    launch = lambda args: ["launch", "--workers=2", f"--launch_logs={tmp_path}/logs", "--", *args]  # noqa: E731
    clean = run_tfdp(*launch(demo(small_dir, tmp_path / "clean", 2, "--strategy=multi_worker")), timeout=600)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    model_dir = tmp_path / "run"
    kill_after_first_step_checkpoint(launch(demo(small_dir, model_dir, 2, "--strategy=multi_worker")), model_dir)
    out = resume(demo(small_dir, model_dir, 1), 1)
    assert "tfdp: batch: global 64 = 32 per replica x 1 replica(s) x 2 accumulation step(s)" in out
    assert re.search(r"resuming at epoch 1 of 2, step 4 of 5", out), out
    assert "the checkpoint's 2 input streams go on exactly on 1 worker(s), 2 each" in out
    assert_ends_as(model_dir, tmp_path / "clean")


@pytest.mark.parametrize("flags,fragments", [
    (["--set=train.global_batch=32"],                                   # another global batch, set explicitly
     ("the checkpoint step-000000003 was trained at global batch 64 (32 per replica x 2 replica(s) x 1 "
      "accumulation step(s))", "train.global_batch is 32", "train.global_batch=64 or 0")),
    (["--cpu_replicas=3"],                                              # hardware the global batch cannot divide
     ("step-000000003 was trained at global batch 64", "the 3 replicas found cannot split evenly",
      "divides 64 (1, 2, 4, 8, 16, 32, 64)")),
])
def test_a_resume_that_cannot_keep_the_checkpoints_global_batch_is_refused_in_one_line(two_replica_runs, tmp_path,
                                                                                       small_dir, flags, fragments):
    model_dir = resumed_copy(two_replica_runs[1], tmp_path)
    again = run_tfdp(*demo(small_dir, model_dir, 1, *flags), timeout=300)
    assert_one_line_error(again, 2, *fragments)
    assert [p for p in os.listdir(model_dir / "checkpoints") if not p.startswith(".")] == ["step-000000003"]
