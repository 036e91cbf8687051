"""Elastic resume (`tfdp.elastic`): a checkpoint of W workers x R replicas goes on at W' x R' with the same global
batch and, step by step, the same examples in every global batch."""

import collections
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import REPO, assert_one_line_error, run_tfdp
from tfdp.config import validate
from tfdp.data import build_source
from tfdp.data.pipeline import Bookkeeping, StreamPosition, streams_dataset, train_dataset
from tfdp.elastic import plan_streams

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


def kill_after_first_step_checkpoint(args, model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "tfdp", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not (model_dir / "checkpoints" / "step-000000003").exists() and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers alike
    return proc.communicate()[0]


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [
    (["--cpu_replicas=2"], ["--cpu_replicas=1"]),                                            # 2 replicas -> 1
    (["--strategy=multi_worker"], ["--cpu_replicas=1"]),                                     # 2 workers -> 1
])
def test_killed_mid_epoch_and_resumed_on_fewer_replicas_ends_as_the_uninterrupted_run(tmp_path, small_dir, before,
                                                                                      after):
    """Killed after step 3 of 10, resumed on half the replicas at global batch 64 (32 per replica x 2
    accumulation steps): the learning rate and global batch are unchanged, and the final weights equal the
    uninterrupted run's on the original layout to float rounding (rtol 1e-4: the sums run in another order)."""
    launch = (lambda args: ["launch", "--workers=2", f"--launch_logs={tmp_path}/logs", "--", *args]) \
        if "--strategy=multi_worker" in before else (lambda args: args)
    clean = run_tfdp(*launch(demo(small_dir, tmp_path / "clean", 2, *before)), timeout=600)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert "global batch 64" in clean.stdout
    model_dir = tmp_path / "run"
    kill_after_first_step_checkpoint(launch(demo(small_dir, model_dir, 2, *before)), model_dir)
    resumed = run_tfdp(*demo(small_dir, model_dir, 1, *after, "--set=train.global_batch=64"), timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    out = resumed.stdout
    assert "tfdp: batch: global 64 = 32 per replica x 1 replica(s) x 2 accumulation step(s)" in out
    assert re.search(r"resuming at epoch 1 of 2, step 4 of 5", out), out
    if "--strategy=multi_worker" in before:
        assert "the checkpoint's 2 input streams go on exactly on 1 worker(s), 2 each" in out
    rows = [json.loads(line) for line in open(model_dir / "metrics.jsonl")]
    clean_rows = [json.loads(line) for line in open(tmp_path / "clean" / "metrics.jsonl")]
    assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in clean_rows], rel=1e-6)  # same schedule
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in clean_rows], rel=1e-3)  # metrics went on
    a, b = kernels(tmp_path / "clean"), kernels(model_dir)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_a_checkpoint_of_another_global_batch_is_refused_in_one_line(tmp_path, small_dir):
    first = run_tfdp(*demo(small_dir, tmp_path / "run", 2, "--epochs=1", "--set=schedule.warmup_epochs=0"),
                     timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_tfdp(*demo(small_dir, tmp_path / "run", 1), timeout=300)
    assert_one_line_error(again, 2, "was trained at global batch 64 (32 per replica x 2 replica(s) x 1",
                          "this run's config gives 32", "set train.global_batch=64")
