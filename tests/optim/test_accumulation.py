"""Gradient accumulation (`train.grad_accum_steps`) and the fixed global batch (`train.global_batch`).

Exactness: on a model without batch norm, k micro-batches of b per replica train exactly as one batch of
k x b does (same weights, optimizer state and EMA after several steps), on 1 replica and on 2 (real
MirroredStrategy on the 2 logical CPUs conftest splits), with and without whole-step XLA, for SGD with
momentum, AdamW and LAMB, in float32, bfloat16 and float16 with loss scaling.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import assert_one_line_error, run_tfdp
from support.cluster_runs import FAST, deterministic, layer_weights
from support.fixed_steps import train_fixed_batches
from tfdp.train.global_batch import CheckpointBatch, batch_layout, resumed_layout
from tfdp.config import validate
from tfdp.errors import UserError
from tfdp.keras_patches import train_step as train_step_module
from tfdp.distribute.replica_state import replica_copies

STEPS = 4
GLOBAL_BATCH = 32


def make_cfg(digits_dir, replicas, accum, optimizer="sgd", precision="float32", jit=False, ema=0.0):
    return validate({
        "data": {"format": "image_folder", "dir": digits_dir, "image_size": 16, "eval_crop_fraction": 1.0,
                 "hflip": False},
        "model": {"name": "simple_cnn"},
        "optimizer": {"name": optimizer, "lr": 0.2 if optimizer == "sgd" else 0.01, "momentum": 0.9,
                      "weight_decay": 1e-4 if optimizer != "sgd" else 0.0, "ema_decay": ema},
        "train": {"batch_size_per_replica": GLOBAL_BATCH // (replicas * accum), "grad_accum_steps": accum,
                  "epochs": 1, "seed": 3, "jit_compile": jit, "precision": precision},
        "distribute": {"strategy": "mirrored", "cpu_replicas": replicas},
    })


def train_steps(digits_dir, replicas, accum, start=None, **kwargs):
    """STEPS optimizer steps on a fixed sequence of global batches of GLOBAL_BATCH; (model, initial weights).

    The data is the same whatever `accum`: each replica gets GLOBAL_BATCH / replicas images per step, which
    the accumulating step cuts into `accum` micro-batches."""
    cfg = make_cfg(digits_dir, replicas, accum, **kwargs)
    return train_fixed_batches(cfg, STEPS, GLOBAL_BATCH, start)[1:]


def state(model):
    """Weights, then every optimizer variable (momenta, moments, EMA, iteration and loss-scale counters), in
    order (the optimizer's name, in its variables' paths, differs between models of one process)."""
    return [(v.path, v.numpy()) for v in model.weights + model.optimizer.variables]


# (replicas, optimizer, precision, whole-step XLA, EMA decay): each row one comparison, k = 2 or 4. Each row
# takes its own path through tfdp/keras_patches/train_step.py: 1 replica runs `whole_step` (with XLA or op by op),
# 2 replicas `forward_backward`, one all-reduce and `update`, float16's loss scaling `forward_backward` and Keras'
# `apply_gradients`. Rows left out as the same path as one kept: (1, lamb, float32, XLA) as the first row's (LAMB's
# update is the last row's but one), (2, sgd, float32, XLA) as (2, adamw, float32, XLA)'s (SGD in the first row),
# (2, adamw, mixed_bfloat16, op by op) as (2, lamb, float32, op by op)'s (bfloat16 in the 1-replica row).
# float16 runs `forward_backward` on 1 replica with XLA and on 2 op by op (the costly pairing, 2 replicas with XLA,
# is the float32 rows' path for all but the loss scale).
CASES = [
    (1, "sgd", "float32", True, 0.9, 2),
    (1, "adamw", "float32", False, 0.0, 4),
    (2, "adamw", "float32", True, 0.9, 2),
    (2, "lamb", "float32", False, 0.9, 2),
    (1, "sgd", "mixed_bfloat16", True, 0.0, 2),
    (1, "sgd", "mixed_float16", True, 0.9, 2),
    (2, "adamw", "mixed_float16", False, 0.0, 2),
]
# The row whose accumulating run also counts its all-reduces (test_one_all_reduce_per_optimizer_step_...).
COUNTED = CASES[2]


_kept: dict = {}


def compared_runs(digits_dir, replicas, optimizer, precision, jit, ema, k):
    """One CASES row: the whole-batch run and the k-micro-batch run from its initial weights; (whole,
    accumulated, initial, all-reduces of the accumulating run: None but for the COUNTED row). The first and the
    COUNTED rows' are kept for the module: the one-program and the one-all-reduce tests below read their
    accumulating runs instead of training the same again."""
    row = (replicas, optimizer, precision, jit, ema, k)
    if (digits_dir, row) in _kept:
        return _kept[digits_dir, row]
    options = dict(optimizer=optimizer, precision=precision, jit=jit, ema=ema)
    whole, initial = train_steps(digits_dir, replicas, 1, **options)
    calls = None
    original = train_step_module.all_reduce_sum
    if row == COUNTED:
        with tf.init_scope():
            calls = tf.Variable(0, dtype=tf.int64, trainable=False)

        def counted(gradients):   # where the collective runs: each replica calls it once per all-reduce
            calls.assign_add(1)
            return original(gradients)
        train_step_module.all_reduce_sum = counted
    try:
        accumulated, _ = train_steps(digits_dir, replicas, k, start=initial, **options)
    finally:
        train_step_module.all_reduce_sum = original
    result = whole, accumulated, initial, None if calls is None else int(calls.numpy())
    if row in (CASES[0], COUNTED):
        _kept[digits_dir, row] = result
    return result


@pytest.mark.parametrize("replicas,optimizer,precision,jit,ema,k", CASES)
def test_k_micro_batches_of_b_train_as_one_batch_of_k_times_b(digits_dir, replicas, optimizer, precision, jit,
                                                              ema, k):
    whole, accumulated, initial, _ = compared_runs(digits_dir, replicas, optimizer, precision, jit, ema, k)
    # float16: the loss scale starts high and both runs skip the same overflowing first step(s), if any.
    applied = int(whole.optimizer.iterations.numpy())
    assert int(accumulated.optimizer.iterations.numpy()) == applied
    assert applied == STEPS if precision != "mixed_float16" else 0 < applied <= STEPS
    a, b = state(whole), state(accumulated)
    assert len(a) == len(b)
    if ema:
        assert any("average" in p for p, _ in a)  # the EMA is among the compared variables
    moved = max(float(np.abs(w.numpy() - i).max()) for w, i in zip(whole.weights, initial))
    assert moved > 1e-3  # the weights trained, so equality is not vacuous
    if precision == "float32":  # the sums differ only in order
        for (path, x), (_, y) in zip(a, b):
            np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5, err_msg=path)
        return
    # 16-bit: each image's forward pass is the same, but the gradient sums round in 16 bits over b images
    # instead of k x b (and Adam's normalisation magnifies that on tiny gradients): each weight tensor lands
    # within 5% (2-norm) of how far it moved.
    for w, (path, x), (_, y), init in zip(whole.weights, a, b, initial):
        assert np.linalg.norm(y - x) <= 0.05 * np.linalg.norm(x - init), path


def test_one_all_reduce_per_optimizer_step_not_per_micro_batch(digits_dir):
    """The gradients are all-reduced once per optimizer step: a counter incremented where the collective runs
    (each replica calls it once per all-reduce) reads replicas x steps after 4 steps of 2 micro-batches (once per
    micro-batch would read twice that). The accumulating run of the COUNTED row (2 replicas, XLA), trained once
    for both tests."""
    _, model, _, calls = compared_runs(digits_dir, *COUNTED)
    assert COUNTED[0] == 2 and COUNTED[3] and COUNTED[5] == 2
    assert int(model.optimizer.iterations.numpy()) == STEPS
    assert calls == 2 * STEPS


def test_accumulation_loop_is_one_xla_program_on_one_replica(digits_dir):
    """One replica under XLA: forward, backward over the k micro-batches and the update (EMA included) are one
    program. The accumulating run of CASES' first row (1 replica, SGD, XLA, EMA, k = 2), trained once for both
    tests."""
    _, model, _, _ = compared_runs(digits_dir, *CASES[0])
    assert CASES[0][:4] == (1, "sgd", "float32", True) and int(model.optimizer.iterations.numpy()) == STEPS
    forward_backward, whole_step, update = model.tfdp_step_functions
    assert [f.experimental_get_tracing_count() > 0 for f in (forward_backward, whole_step, update)] == \
        [False, True, False]


@pytest.mark.parametrize("train,replicas,expected", [
    ({"batch_size_per_replica": 16}, 2, (32, 16, 2, 1)),                                   # as before
    ({"batch_size_per_replica": 16, "grad_accum_steps": 2}, 2, (64, 16, 2, 2)),
    ({"global_batch": 64, "batch_size_per_replica": 16}, 2, (64, 16, 2, 2)),              # accumulation derived
    ({"global_batch": 64, "batch_size_per_replica": 16}, 1, (64, 16, 1, 4)),
    ({"global_batch": 64, "batch_size_per_replica": 64}, 2, (64, 32, 2, 1)),              # fits without it
    ({"global_batch": 64, "batch_size_per_replica": 20}, 1, (64, 16, 1, 4)),              # the fewest steps
    ({"global_batch": 64, "grad_accum_steps": 4}, 2, (64, 8, 2, 4)),                      # per-replica derived
])
def test_global_batch_layout(train, replicas, expected):
    layout = batch_layout(validate({"train": train}).train, replicas)
    assert (layout.global_batch, layout.per_replica, layout.replicas, layout.accum_steps) == expected
    assert layout.line() == (f"tfdp: batch: global {expected[0]} = {expected[1]} per replica x {expected[2]} "
                             f"replica(s) x {expected[3]} accumulation step(s)")


@pytest.mark.parametrize("train,replicas,fragments", [
    ({"global_batch": 63}, 2, ("train.global_batch 63", "2 replicas", "multiple of 2")),
    ({"global_batch": 64, "grad_accum_steps": 4}, 3, ("train.global_batch 64", "3 replicas")),
    ({"global_batch": 32, "grad_accum_steps": 4}, 16, ("16 replicas x 4 accumulation steps", "multiple of 64")),
])
def test_global_batch_that_cannot_divide_is_one_line(train, replicas, fragments):
    with pytest.raises(UserError) as e:
        batch_layout(validate({"train": train}).train, replicas)
    assert "\n" not in str(e.value) and all(f in str(e.value) for f in fragments)


# A checkpoint of global batch 64 written on 2 replicas x 32 x 1 micro-batch, as its state.json records it.
CHECKPOINT = CheckpointBatch.of({"global_batch": 64, "path": "/run/checkpoints/step-000000003",
                                 "layout": {"workers": 1, "replicas": 2, "per_replica": 32, "accum_steps": 1}})


@pytest.mark.parametrize("train,replicas,expected,line", [
    ({"batch_size_per_replica": 32}, 2, (64, 32, 2, 1), ""),                         # the checkpoint's own cut
    ({"batch_size_per_replica": 32}, 1, (64, 32, 1, 2),                              # accumulation makes up
     "tfdp: resuming at the checkpoint's global batch 64: 1 replica x 32 x 2 micro-batches "
     "(the checkpoint's: 2 replicas x 32 x 1 micro-batch)"),
    ({"batch_size_per_replica": 32}, 4, (64, 16, 4, 1),                              # the per-replica batch shrinks
     "tfdp: resuming at the checkpoint's global batch 64: 4 replicas x 16 x 1 micro-batch "
     "(the checkpoint's: 2 replicas x 32 x 1 micro-batch)"),
    ({"batch_size_per_replica": 16}, 2, (64, 16, 2, 2),                              # never above what fits
     "tfdp: resuming at the checkpoint's global batch 64: 2 replicas x 16 x 2 micro-batches "
     "(the checkpoint's: 2 replicas x 32 x 1 micro-batch)"),
    ({"batch_size_per_replica": 16, "grad_accum_steps": 2}, 1, (64, 16, 1, 4),       # the config's k gives 32
     "tfdp: resuming at the checkpoint's global batch 64: 1 replica x 16 x 4 micro-batches "
     "(the checkpoint's: 2 replicas x 32 x 1 micro-batch)"),
    ({"global_batch": 64, "batch_size_per_replica": 32}, 1, (64, 32, 1, 2),          # set explicitly, the same
     "tfdp: resuming at the checkpoint's global batch 64: 1 replica x 32 x 2 micro-batches "
     "(the checkpoint's: 2 replicas x 32 x 1 micro-batch)"),
])
def test_a_resume_keeps_the_checkpoints_global_batch_on_any_replicas(train, replicas, expected, line):
    """The schedule, steps per epoch and stream position of a checkpoint are counted in its global batch, so a
    job requeued on other hardware keeps it: replicas, per-replica batch (at most batch_size_per_replica) and
    accumulation are cut from it as for an explicit train.global_batch, and one line says how."""
    layout, said = resumed_layout(validate({"train": train}).train, replicas, CHECKPOINT)
    assert (layout.global_batch, layout.per_replica, layout.replicas, layout.accum_steps) == expected
    assert said == line
    fresh, said = resumed_layout(validate({"train": train}).train, replicas, None)  # no checkpoint: the config's
    assert fresh == batch_layout(validate({"train": train}).train, replicas) and said == ""


@pytest.mark.parametrize("train,replicas,fragments", [
    ({"global_batch": 32}, 1, ("the checkpoint step-000000003 was trained at global batch 64 (32 per replica x 2 "
                               "replica(s) x 1 accumulation step(s))", "train.global_batch is 32",
                               "train.global_batch=64 or 0", "a new model_dir")),
    ({"batch_size_per_replica": 32}, 3, ("step-000000003 was trained at global batch 64", "3 replicas",
                                         "divides 64 (1, 2, 4, 8, 16, 32, 64)", "a new model_dir")),
    ({"global_batch": 64}, 3, ("global batch 64", "3 replicas", "divides 64")),
])
def test_a_resume_that_cannot_keep_the_checkpoints_global_batch_is_one_line(train, replicas, fragments):
    with pytest.raises(UserError) as e:
        resumed_layout(validate({"train": train}).train, replicas, CHECKPOINT)
    assert "\n" not in str(e.value) and all(f in str(e.value) for f in fragments), str(e.value)


def test_global_batch_not_a_multiple_of_the_accumulation_is_a_config_error(tmp_path):
    result = run_tfdp("train", f"--model_dir={tmp_path}/m", "--set", "train.global_batch=30",
                      "--set", "train.grad_accum_steps=4", timeout=120)
    assert_one_line_error(result, 2, "train.global_batch (30)", "train.grad_accum_steps (4)")


@pytest.mark.full(reason="55 CPU-s: micro-batches are test_k_micro_batches_of_b_train_as_one_batch_of_k_times_b, "
                         "sync BN's merge tests/distribute/test_mirrored.py's torch comparison")
@pytest.mark.slow
def test_sync_bn_with_accumulation_normalises_each_micro_batch_over_both_replicas(digits_dir, monkeypatch):
    """model.sync_bn with accumulation (op by op, its all-reduce once per micro-batch): both replicas see the
    statistics of the same global micro-batch, so their batch-norm moving statistics stay identical (plain
    batch norm would leave each replica its own)."""
    original = make_cfg

    def with_sync_bn(*args, **kwargs):
        cfg = original(*args, **kwargs)
        cfg.model.name, cfg.model.sync_bn = "resnet10_small", True  # a ResNet: batch norm
        return cfg
    monkeypatch.setattr(f"{__name__}.make_cfg", with_sync_bn)
    model, initial = train_steps(digits_dir, 2, 2, jit=False)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    moving = [(v, i) for v, i in zip(model.weights, initial) if "moving_mean" in v.path]
    assert moving
    for v, init in moving:
        first, second = replica_copies(v)
        np.testing.assert_allclose(first, second, rtol=1e-5, atol=1e-6, err_msg=v.path)
    assert max(float(np.abs(v.numpy() - init).max()) for v, init in moving) > 1e-3  # the statistics moved


def test_keras_own_gradient_accumulation_cannot_run_under_mirrored_strategy():
    """Why tfdp accumulates in its own step: Keras 3's `gradient_accumulation_steps` puts the TensorFlow
    optimizer's gradient all-reduce (a merge_call) inside a conditional, which tf.distribute refuses on 2
    replicas. If this starts passing, Keras changed: re-check docs/global-batch.md's decision."""
    import keras
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
    x, y = np.ones((32, 4), "float32"), np.ones((32, 2), "float32")
    with pytest.raises(RuntimeError, match="merge_call"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.full(reason="25 CPU-s of a cluster: accumulation's path on 2 replicas (micro-batches, one all-reduce, "
                  "the XLA update) is the in-process CASES rows', and a cluster's fit with the XLA step is "
                  "test_multi_worker.py's 2 workers x 2 replicas run")
def test_two_workers_accumulating_train_as_two_replicas_on_the_whole_batch(tmp_path, tiny_dir):
    """2 workers (`tfdp launch`), whole-step XLA, 2 micro-batches of 16 per worker and step, against one process
    with 2 replicas of 32 and Keras' own step: the same weights after 4 steps (rtol 1e-4, atol 1e-5)."""
    from support.inprocess import train_in_process
    launched = run_tfdp("launch", "--workers=2", f"--launch_logs={tmp_path}/logs", "--", "train", *FAST,
                        f"--model_dir={tmp_path}/mw", "--set=train.global_batch=64", "--set=train.grad_accum_steps=2",
                        *deterministic(tiny_dir), "--set=train.jit_compile=true", timeout=600)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    assert "tfdp: batch: global 64 = 16 per replica x 2 replica(s) x 2 accumulation step(s)" in launched.stdout
    # The reference: test_multi_worker's one-process 2-replica run (`assert_matches_two_replica_run`, without its
    # fine-tuning switch), in this process (the 2 logical CPUs conftest splits) instead of a third `tfdp` process.
    train_in_process(*FAST, f"--model_dir={tmp_path}/mirrored", "--strategy=mirrored", "--cpu_replicas=2",
                     "--batch_size_per_replica=32", *deterministic(tiny_dir))
    ours = layer_weights(tmp_path / "mw" / "checkpoints" / "epoch-0004" / "model.weights.h5")
    reference = layer_weights(tmp_path / "mirrored" / "checkpoints" / "epoch-0004" / "model.weights.h5")
    assert ours.keys() == reference.keys() and len(ours) >= 8
    for name in ours:
        np.testing.assert_allclose(ours[name], reference[name], rtol=1e-4, atol=1e-5, err_msg=name)
