"""Fine-tuning controls: train.freeze / freeze_epochs, optimizer.layer_decay (timm's), head_lr_multiplier."""

import os
import re
import signal
import subprocess
import sys
import time

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, assert_one_line_error, run_tfdp
from tfdp.config import validate
from tfdp.data import build_source
from tfdp.data.pipeline import eval_dataset
from tfdp.errors import UserError
from tfdp.optim.finetune import Freezing, frozen_layers, learning_rate_scales, scale_learning_rates, weight_layers
from tfdp.keras_patches.train_step import stateless_update
from tfdp.models import build_model
from tfdp.optim.optimizers import build_optimizer
from tfdp.distribute.replica_state import replica_copies
from tfdp.distribute.strategy import make_runtime
from tfdp.train.task import Plan, compile_model


# ---- layer-wise decay: timm's numbers ----

def torchvision_name(layer: str) -> str:
    """tfdp's ResNet layer name as torchvision/timm call the parameter's module (what timm's matcher reads)."""
    if layer in ("stem_conv", "stem_bn"):
        return {"stem_conv": "conv1", "stem_bn": "bn1"}[layer]
    if layer == "logits":
        return "fc"
    m = re.fullmatch(r"stage(\d)_block(\d)_(a|b|down)_(conv|bn)", layer)
    stage, block, part, kind = m.groups()
    if part == "down":
        return f"layer{stage}.{int(block) - 1}.downsample.{0 if kind == 'conv' else 1}"
    return f"layer{stage}.{int(block) - 1}.{kind}{1 if part == 'a' else 2}"


def timm_layer_scales(param_names, decay):
    """A copy of timm's param_groups_layer_decay for its ResNet: group_matcher(coarse=False) =
    {stem: ^conv1|bn1, blocks: ^layer(\\d+)\\.(\\d+)}, group_with_matcher (unmatched: inf), then
    layer_scales = decay ** (layer_max - layer_id)."""
    matchers = [(re.compile(r"^conv1|bn1"), 0), (re.compile(r"^layer(\d+)\.(\d+)"), 1)]

    def grouping(name):
        for regex, ordinal in matchers:
            m = regex.match(name)
            if m:
                return (float(ordinal), *map(float, m.groups()))
        return (float("inf"),)
    keys = sorted({grouping(n) for n in param_names})
    layer_id = {n: keys.index(grouping(n)) for n in param_names}
    layer_max = len(keys) - 1
    return {n: decay ** (layer_max - layer_id[n]) for n in param_names}, len(keys)


def small_cfg(**sections):
    raw = {"data": {"format": "synthetic", "image_size": 8, "hflip": False}, "model": {"name": "resnet18_small"}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return validate(raw)


def test_layer_decay_multipliers_equal_timm_for_a_resnet():
    cfg = small_cfg(optimizer={"layer_decay": 0.65, "head_lr_multiplier": 4.0})
    model = build_model(cfg.model, cfg.data)
    scales = learning_rate_scales(cfg, model)
    names = {id(v): layer.name for layer in weight_layers(model) for v in layer.trainable_weights}
    expected, num_layers = timm_layer_scales({torchvision_name(n) for n in names.values()}, 0.65)
    assert num_layers == 10  # stem, 8 basic blocks, head: as timm numbers ResNet-18
    seen = set()
    for vid, layer in names.items():
        want = expected[torchvision_name(layer)] * (4.0 if layer == "logits" else 1.0)
        assert scales.get(vid, 1.0) == pytest.approx(want, rel=1e-12), layer
        seen.add(round(want, 12))
    assert len(seen) == 10


def tiny_model():
    """Four dense layers named as a ResNet's stem, two blocks and head: layer ids 0, 1, 2, 3 under its grouping."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    x = inputs
    for name in ("stem_dense", "stage1_block1_dense", "stage1_block2_dense"):
        x = keras.layers.Dense(3, name=name)(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="logits")(x))


def run_updates(cfg, grads_per_step, xla):
    """Applies fixed gradients with tfdp's optimizer (scales installed), in Keras' own step or the XLA one."""
    model = tiny_model()
    optimizer = build_optimizer(cfg.optimizer, cfg.optimizer.lr)
    optimizer.build(model.trainable_variables)
    scale_learning_rates(cfg, model, optimizer)
    variables = optimizer._trainable_variables
    initial = [v.numpy() for v in variables]

    @tf.function(jit_compile=True)
    def xla_update(values, optimizer_values, grads):
        return stateless_update(optimizer, optimizer_values, grads, values)

    for grads in grads_per_step:
        grads = [tf.constant(g) for g in grads]
        if xla:
            new, new_opt = xla_update([v.value for v in variables], [v.value for v in optimizer.variables], grads)
            for var, value in zip([*variables, *optimizer.variables], [*new, *new_opt]):
                if value is not None:
                    var.assign(value)
        else:
            optimizer.apply(grads, variables)
    return initial, [v.numpy() for v in variables], [v.name for v in variables]


@pytest.mark.parametrize("xla", [False, True], ids=["keras_step", "xla_step"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_an_update_with_layer_decay_equals_the_hand_computed_one(name, xla):
    decay, head, lr, wd = 0.5, 3.0, 0.1, 0.01
    cfg = small_cfg(optimizer={"name": name, "lr": lr, "weight_decay": wd, "layer_decay": decay,
                               "head_lr_multiplier": head, "momentum": 0.9, "nesterov": False})
    rng = np.random.default_rng(0)
    shapes = [w.shape for w in tiny_model().trainable_weights]
    steps = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(3)]
    initial, final, _ = run_updates(cfg, steps, xla)
    model = tiny_model()
    scales = [{"stem_dense": decay ** 3, "stage1_block1_dense": decay ** 2, "stage1_block2_dense": decay,
               "logits": head}[layer.name] for layer in model.layers[1:] for _ in layer.trainable_weights]
    for i, (w0, w1, s) in enumerate(zip(initial, final, scales)):
        w, m, v = w0.astype(np.float64), 0.0, 0.0
        for t, grads in enumerate(steps, start=1):
            g = grads[i].astype(np.float64)
            if name == "sgd":   # torch.optim.SGD: L2 through the gradient, lr * scale on the whole of it
                g = g + wd * w
                m = 0.9 * m - lr * s * g
                w = w + m
            else:               # AdamW as torch with timm's lr_scale: the decoupled decay at the scaled lr too
                w = w - w * wd * lr * s
                m = m + (g - m) * 0.1
                v = v + (g * g - v) * 0.001
                alpha = lr * s * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
                w = w - alpha * m / (np.sqrt(v) + 1e-8)
        np.testing.assert_allclose(w1, w, rtol=2e-5, atol=1e-6, err_msg=f"variable {i}")


def test_head_lr_multiplier_scales_only_the_head_update():
    rng = np.random.default_rng(1)
    shapes = [w.shape for w in tiny_model().trainable_weights]
    steps = [[rng.normal(size=s).astype(np.float32) for s in shapes]]
    plain = small_cfg(optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.0})
    scaled = small_cfg(optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.0, "head_lr_multiplier": 5.0})
    w0, base, names = run_updates(plain, steps, xla=False)
    w0b, head, _ = run_updates(scaled, steps, xla=False)
    for name, a0, a, b0, b in zip(names, w0, base, w0b, head):
        np.testing.assert_array_equal(a0, b0)
        if name in ("kernel", "bias") and a.shape[-1] == 2:  # the logits layer (2 classes)
            np.testing.assert_allclose(b - b0, 5.0 * (a - a0), rtol=1e-5)
        else:
            np.testing.assert_array_equal(a, b)


# ---- freezing, in-process on 2 replicas, Keras' step and the XLA step ----

STEPS, GLOBAL_BATCH = 3, 16


MODEL = "resnet10_small"  # a ResNet with batch norm and the demo's stem, stages and head, cheaper than the demo's


def two_phase_run(digits_dir, jit, start=None):
    """MODEL (a ResNet with batch norm) on 2 replicas: STEPS steps with the backbone frozen, then STEPS with
    everything training; returns (model, weights before, after phase 1, after phase 2)."""
    cfg = validate({
        "data": {"format": "image_folder", "dir": digits_dir, "image_size": 8, "eval_crop_fraction": 1.0,
                 "hflip": False},
        "model": {"name": MODEL},
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.05, "layer_decay": 0.7,
                      "head_lr_multiplier": 2.0, "ema_decay": 0.9},
        "train": {"batch_size_per_replica": GLOBAL_BATCH // 2, "epochs": 2, "seed": 3, "jit_compile": jit,
                  "freeze": ["backbone"], "freeze_epochs": 1},
        "distribute": {"strategy": "mirrored", "cpu_replicas": 2},
    })
    runtime = make_runtime(cfg.distribute)
    assert runtime.num_replicas == 2
    split = build_source(cfg.data).split("train")
    plan = Plan(GLOBAL_BATCH, STEPS, split.num_examples, 0, 10)
    tf.keras.utils.set_random_seed(3)
    with runtime.strategy.scope():
        model = compile_model(cfg, plan)
    if start is not None:
        model.set_weights(start)
    freezing = Freezing.plan(cfg.train, cfg.model.name, model)
    ds = runtime.strategy.distribute_datasets_from_function(
        lambda ctx: eval_dataset(split, cfg.data, GLOBAL_BATCH, ctx).repeat())
    snapshots = [[np.stack(replica_copies(w)) for w in model.weights]]
    for epoch in (0, 1):
        assert freezing.enter(model, epoch, 2)
        model.fit(ds, steps_per_epoch=STEPS, epochs=epoch + 1, initial_epoch=epoch, verbose=0, shuffle=False)
        snapshots.append([np.stack(replica_copies(w)) for w in model.weights])
    return model, freezing, snapshots


@pytest.mark.full(reason="80 CPU-s: freezing's parts are "
                         "test_freeze_patterns_name_stages_layers_and_the_backbone and "
                         "test_split_puts_the_switch_between_two_fits, a frozen phase in a run "
                         "test_fine_tuning_from_a_checkpoint_freezes_then_trains_everything")
@pytest.mark.slow
def test_frozen_backbone_and_its_batch_norm_stay_bit_identical_then_train_on_two_replicas(digits_dir):
    plain, freezing, (before, frozen, after) = two_phase_run(digits_dir, jit=False)
    xla, _, (_, xla_frozen, xla_after) = two_phase_run(digits_dir, jit=True, start=[b[0] for b in before])
    head = {id(w) for layer in weight_layers(plain) if layer.name == "logits" for w in layer.weights}
    frozen_ids = {id(w) for layer in freezing.layers for w in layer.weights}
    moving = [i for i, w in enumerate(plain.weights) if "moving_" in w.path]
    batch_norms = [l for l in weight_layers(plain) if isinstance(l, keras.layers.BatchNormalization)]
    assert len(batch_norms) >= 10 and len(moving) == 2 * len(batch_norms)  # mean and variance of each
    assert all(id(plain.weights[i]) in frozen_ids for i in moving)
    for i, w in enumerate(plain.weights):
        if id(w) in frozen_ids:  # weights and batch-norm statistics, on every replica, both steps
            np.testing.assert_array_equal(frozen[i], before[i], err_msg=w.path)
            np.testing.assert_array_equal(xla_frozen[i], before[i], err_msg=w.path)
        if id(w) in head:
            assert np.abs(frozen[i] - before[i]).max() > 0, w.path
    # After the switch the backbone trains, batch-norm statistics included.
    changed = [i for i in moving if np.abs(after[i] - frozen[i]).max() > 0]
    assert len(changed) == len(moving)
    assert all(np.abs(after[i] - frozen[i]).max() > 0 for i, w in enumerate(plain.weights)
               if id(w) in frozen_ids and "kernel" in w.path)
    # Keras' op-by-op step and the whole-step XLA update agree, phase by phase; the replicas stay identical.
    for i, w in enumerate(plain.weights):
        np.testing.assert_allclose(xla_frozen[i], frozen[i], rtol=1e-3, atol=1e-4, err_msg=w.path)
        np.testing.assert_allclose(xla_after[i], after[i], rtol=1e-2, atol=5e-3, err_msg=w.path)
        if w.trainable:
            np.testing.assert_array_equal(xla_after[i][0], xla_after[i][1], err_msg=w.path)
    for a, b in zip(plain.optimizer.variables, xla.optimizer.variables):  # one optimizer state, one shape
        assert a.shape == b.shape
        # Adam's moments of near-zero gradients carry XLA's different rounding more than the weights do.
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=5e-2, atol=1e-2, err_msg=a.path)


def test_freeze_patterns_name_stages_layers_and_the_backbone():
    cfg = small_cfg()
    model = build_model(cfg.model, cfg.data)
    names = lambda entries: [l.name for l in frozen_layers(model, "resnet18_small", entries)]  # noqa: E731
    assert set(names(("stem", "stage1"))) == {"stem_conv", "stem_bn"} | {
        f"stage1_block{b}_{p}_{k}" for b in (1, 2) for p in "ab" for k in ("conv", "bn")}
    assert names(("stage4_block2_*_bn",)) == ["stage4_block2_a_bn", "stage4_block2_b_bn"]
    backbone = names(("backbone",))
    assert "logits" not in backbone and len(backbone) == len(weight_layers(model)) - 1
    with pytest.raises(UserError, match="model 'headless' declares none"):
        frozen_layers(model, "headless", ("backbone",))


def test_split_puts_the_switch_between_two_fits():
    from tfdp.train.trainer import Segment, segments
    freezing = Freezing(layers=[object()], until_epoch=2)
    assert freezing.split(segments(0, 0, 5, 10)) == [Segment(0, 2, 10), Segment(2, 5, 10)]
    assert freezing.split(segments(1, 4, 5, 10)) == [Segment(1, 2, 6), Segment(2, 5, 10)]  # resumed mid-epoch
    assert freezing.split(segments(3, 0, 5, 10)) == [Segment(3, 5, 10)]
    assert Freezing(layers=[object()], until_epoch=None).split(segments(0, 0, 5, 10)) == [Segment(0, 5, 10)]


# ---- the command line ----

def common_args(data_dir, model_dir, epochs):
    return ["train", "--config=configs/digits.yaml", f"--data_dir={data_dir}", "--data_format=image_folder",
            f"--model_dir={model_dir}", f"--epochs={epochs}", "--set=data.image_size=8",
            "--set=schedule.warmup_epochs=0"]


def h5_weights(path):
    out = {}
    with h5py.File(path) as f:
        f["layers"].visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
    return out


@pytest.mark.slow
def test_fine_tuning_from_a_checkpoint_freezes_then_trains_everything(tmp_path, tiny_dir):
    """Pretrain 1 epoch; fine-tune 2 more with the backbone frozen for epoch 2: epoch 2 leaves the backbone
    and its batch-norm statistics bit-identical (the head moves); epoch 3 trains everything. Both runs in this
    process, with the flags `tfdp train` would get: the freeze switch is tested here, the process boundary
    (kill -9 and resume) below, two workers switching together in
    tests/distribute/test_multi_worker.py. On the 64 tiny digits: one step of 64 an epoch, which moves every
    weight and batch-norm statistic it trains as five would."""
    from support.inprocess import train_in_process
    run = tmp_path / "run"
    train_in_process(*common_args(tiny_dir, run, 1)[1:], f"--model={MODEL}")
    pretrained = h5_weights(run / "checkpoints" / "epoch-0001" / "model.weights.h5")  # pruned later
    keras.backend.clear_session()
    _, tuned = train_in_process(*common_args(tiny_dir, run, 3)[1:], f"--model={MODEL}",
                                "--set=train.freeze=[backbone]", "--set=train.freeze_epochs=2",
                                "--set=optimizer.layer_decay=0.8")
    model = build_model(small_cfg(model={"name": MODEL}).model, small_cfg().data)
    backbone = frozen_layers(model, MODEL, ("backbone",))
    assert len(backbone) == len(weight_layers(model)) - 1 >= 20  # every weight layer but the head
    assert (f"tfdp: fine-tuning: {len(backbone)} layers frozen (backbone) for epoch 2; their batch norm runs in "
            "inference mode") in tuned
    assert "tfdp: fine-tuning: every layer trains from epoch 3 on (train.freeze_epochs: 2" in tuned
    epochs = [pretrained, *(h5_weights(run / "checkpoints" / f"epoch-000{i}" / "model.weights.h5") for i in (2, 3))]
    head = [k for k in epochs[0] if "/dense/" in k]
    assert len(head) == 2 and len(epochs[0]) == len(model.weights) > 50
    for key in epochs[0]:
        if key in head:
            assert np.abs(epochs[1][key] - epochs[0][key]).max() > 0, key
        else:
            np.testing.assert_array_equal(epochs[1][key], epochs[0][key], err_msg=key)
    backbone_moved = [k for k in epochs[0] if k not in head and np.abs(epochs[2][k] - epochs[1][k]).max() > 0]
    assert len(backbone_moved) == len(epochs[0]) - 2  # every backbone weight and statistic trained in epoch 3


def checkpoint_dirs(model_dir):
    root = model_dir / "checkpoints"
    return {p for p in os.listdir(root) if not p.startswith(".")} if root.exists() else set()


def kill_after(args, model_dir, checkpoint):
    """Starts `tfdp` and kills it (-9) once `checkpoint` exists."""
    proc = subprocess.Popen([sys.executable, "-m", "tfdp", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 500
    while checkpoint not in checkpoint_dirs(model_dir) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    return proc.communicate()[0]


@pytest.mark.slow
@pytest.mark.full(reason="51 CPU-s of four runs: a resume into the frozen phase is the fine-tuning-from-a-checkpoint "
                  "run's, a resume mid-epoch test_split_puts_the_switch_between_two_fits', and kill -9 at random "
                  "steps test_resume.py's")
def test_killed_before_and_after_the_switch_resumes_bit_identical(tmp_path, small_dir):
    """Epoch 1 frozen (stem, stage1, stage2), epoch 2 trains everything, 5 steps an epoch, a step checkpoint every
    2: killed (-9) at step 2, in the frozen phase, then, resumed, at step 6, after the switch; the run resumed
    from there ends with the uninterrupted run's weights, bit for bit. The killed runs are `tfdp` processes; the
    uninterrupted run and the last resume (the process boundary is not their point) run in this process."""
    from support.inprocess import train_in_process
    args = lambda d: [*common_args(small_dir, d, 2), f"--model={MODEL}",  # noqa: E731
                      "--set=train.deterministic=true", "--set=train.checkpoint_every_steps=2",
                      "--set=train.freeze=[stem,stage1,stage2]", "--set=train.freeze_epochs=1",
                      "--set=optimizer.head_lr_multiplier=2.0"]
    _, clean = train_in_process(*args(tmp_path / "clean")[1:])
    killed = tmp_path / "killed"
    kill_after(args(killed), killed, "step-000000002")        # in the frozen phase (epoch 1 of 5 steps)
    out = kill_after(args(killed), killed, "step-000000006")  # after the switch (epoch 2, step 1)
    assert "resuming at epoch 1 of 2, step 3 of 5" in out
    assert "every layer trains from epoch 2 on" in out
    keras.backend.clear_session()
    _, final = train_in_process(*args(killed)[1:])
    assert "resuming at epoch 2 of 2" in final
    assert "layers frozen" not in final  # resumed past the switch: everything trains
    prints = lambda text: re.findall(r"weights fingerprint (\w+)", text)  # noqa: E731
    assert prints(final) == prints(clean) != []


@pytest.mark.parametrize("extra, fragments", [
    (["--set=train.freeze=[stage9]"], ["train.freeze: 'stage9' matches no layer", "resnet18_small", "stage4"]),
    (["--set=train.freeze_epochs=1"], ["train.freeze_epochs needs train.freeze"]),
    (["--set=train.freeze=[backbone]", "--set=train.freeze_epochs=2"],
     ["train.freeze_epochs (2) must be smaller than train.epochs (2)"]),
    (["--model=squeezenet1_1", "--set=data.image_size=32", "--set=optimizer.layer_decay=0.7"],
     ["optimizer.layer_decay: model 'squeezenet1_1' has no layer grouping", "resnet18"]),
])
def test_bad_fine_tuning_settings_are_one_line(tmp_path, small_dir, extra, fragments):
    result = run_tfdp(*common_args(small_dir, tmp_path / "bad", 2), *extra, timeout=300)
    assert_one_line_error(result, 2, *fragments)
