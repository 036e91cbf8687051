"""Optimizers by name: each one's maths, and each one inside tfdp's whole-step XLA update on 2 replicas."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.config import OptimizerConfig, validate
from tfdp.errors import UserError
from tfdp.keras_patches.train_step import compile_train_step
from tfdp.optim.optimizers import LARS, build_optimizer, track_buffers
from tfdp.distribute.strategy import make_runtime
from tfdp.config import DistributeConfig

STEPS, BATCH = 5, 16


def seeded(seed: int):
    import keras
    return keras.initializers.GlorotUniform(seed=seed)


def toy_fit(name: str, replicas: int, jit: bool, precision: str = "float32", rules: str = "keras", on_step=None,
            **opt):
    """A small conv net with batch norm trained STEPS steps on fixed data; returns (model, the classifier's kernel
    after each step). No bias before batch norm (as in ResNets): its gradient is rounding noise, which Adam's
    normalisation would amplify into the update. The initializers carry their own seeds: runs compared with each
    other must start from the same weights, and the global seed alone does not guarantee it in a test process,
    where a thread left by an earlier test (an fsspec event loop, say) may draw from Python's global random
    generator between the seed and the initializers. `rules` picks the update rules (Config.rules); `on_step(model)`
    runs after every step."""
    import keras
    strategy = make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=replicas)).strategy
    keras.utils.set_random_seed(0)
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(precision)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, use_bias=False, kernel_initializer=seeded(1)),
                                  keras.layers.BatchNormalization(), keras.layers.ReLU(),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(5, kernel_initializer=seeded(2))])
        model.compile(optimizer=build_optimizer(OptimizerConfig(name=name, **opt), 0.05, rules),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if jit:
            compile_train_step(model)
        model.optimizer.build(model.trainable_variables)
        track_buffers(model.optimizer, model)
    keras.mixed_precision.set_global_policy(previous)
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(BATCH * STEPS, 8, 8, 3)).astype("float32"), rng.integers(0, 5, BATCH * STEPS)
    ds = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        .batch(ctx.get_per_replica_batch_size(BATCH)))
    kernels = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            kernels.append(model.layers[-1].kernel.numpy().copy())
            if on_step is not None:
                on_step(model)

    model.fit(ds, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=[Record()])
    return model, kernels


@pytest.mark.parametrize("name, opt", [
    ("sgd", {"momentum": 0.9, "nesterov": True, "clip_norm": 0.5}),
    *[pytest.param(name, opt, marks=pytest.mark.full(reason="torch's forms: 20-50 s each on 2 cores"))
      for name, opt in (("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "rules": "torchvision"}),
                        ("adamw", {"weight_decay": 0.05, "clip_norm": 1.0, "rules": "timm", "ema_decay": 0.9}),
                        ("lamb", {"weight_decay": 0.02, "rules": "timm"}))],
    ("adamw", {"weight_decay": 0.05, "ema_decay": 0.9}),
    ("lamb", {"weight_decay": 0.01}),
    ("lars", {"weight_decay": 1e-4, "momentum": 0.9}),
    ("rmsprop", {"weight_decay": 1e-5, "epsilon": 1e-3, "ema_decay": 0.9}),
])
def test_every_optimizer_runs_in_the_compiled_update_like_keras_own_step(name, opt):
    """2 replicas: the whole-step XLA update (the gradients all-reduced between the two programs) gives the
    weights and optimizer state of Keras' own op-by-op step, for every optimizer, clipping and EMA included."""
    plain, _ = toy_fit(name, 2, jit=False, **opt)
    xla, _ = toy_fit(name, 2, jit=True, **opt)
    assert xla.tfdp_step_functions[2].experimental_get_tracing_count() > 0  # the compiled update ran
    for a, b in zip(plain.weights + plain.optimizer.variables, xla.weights + xla.optimizer.variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=2e-4, atol=2e-5, err_msg=a.path)


@pytest.mark.parametrize("replicas", [1, 2])
def test_ema_after_k_steps_is_the_closed_form_with_warmup(replicas):
    """EMA_1 = w_1, then EMA_t = d * EMA_(t-1) + (1 - d) * w_t with d = min(decay, (1 + t') / (10 + t')), t' = t - 1."""
    decay = 0.5
    model, kernels = toy_fit("sgd", replicas, jit=True, ema_decay=decay)
    expected = kernels[0]
    for t, w in enumerate(kernels[1:], start=1):
        d = min(decay, (1 + t) / (10 + t))
        expected = d * expected + (1 - d) * w
    index = next(i for i, v in enumerate(model.trainable_variables) if v is model.layers[-1].kernel)
    average = model.optimizer._model_variables_moving_average[index]
    np.testing.assert_allclose(average.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(expected, kernels[-1], atol=1e-4)  # the average really lags the weights


def test_with_an_ema_a_run_split_into_two_fits_trains_as_one_fit():
    """tfdp runs one `fit` per segment (progressive sizes, freeze phases, a resumed remainder). Keras swaps the
    EMA into the weights at the end of `fit`; the second fit would then train on from the average, parting
    from one uninterrupted fit and from a run resumed from a checkpoint. Nothing is swapped: the model holds
    the trained weights after `fit`, and two fits end where one does."""
    import keras

    def build():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=build_optimizer(OptimizerConfig(name="sgd", momentum=0.9, ema_decay=0.9), 0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def fit(model, splits):
        rng = np.random.default_rng(1)
        x, y = rng.normal(size=(BATCH * STEPS, 8)).astype("float32"), rng.integers(0, 3, BATCH * STEPS)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
        raw = []

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                raw[:] = [w.numpy().copy() for w in model.weights]
        for first, last in splits:
            model.fit(ds, initial_epoch=first, epochs=last, steps_per_epoch=STEPS, verbose=0, callbacks=[Record()])
            for w, r in zip(model.weights, raw):
                np.testing.assert_array_equal(w.numpy(), r, err_msg=w.path)  # the trained weights, not the EMA

    one, two = build(), build()
    two.set_weights(one.get_weights())  # one start, whatever else drew from the seeded generators
    fit(one, [(0, 4)])
    fit(two, [(0, 2), (2, 4)])
    averages = one.optimizer._model_variables_moving_average
    assert any(not np.allclose(a.numpy(), w.numpy()) for a, w in zip(averages, one.trainable_variables))
    for a, b in zip(one.weights + one.optimizer.variables, two.weights + two.optimizer.variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path)


def test_lars_step_is_the_trust_ratio_closed_form():
    w0, g = np.array([3.0, 4.0], "float32"), np.array([0.6, 0.8], "float32")   # ||w|| = 5, ||g|| = 1
    import keras
    for name, exclude in (("kernel", ()), ("bias", ("bias",))):
        var = keras.Variable(w0, name=name)
        opt = LARS(learning_rate=0.1, momentum=0.9, weight_decay_rate=0.0, trust_coefficient=0.01, exclude=exclude)
        opt.build([var])
        opt.apply([tf.constant(g)], [var])
        ratio = 0.01 * 5.0 / 1.0 if not exclude else 1.0
        np.testing.assert_allclose(var.numpy(), w0 - 0.1 * ratio * g, rtol=1e-6)


def test_unknown_optimizer_and_bad_values_are_one_line_naming_the_field():
    with pytest.raises(UserError, match="optimizer.name"):
        validate({"optimizer": {"name": "adam_but_better"}})
    with pytest.raises(UserError, match="optimizer.ema_decay"):
        validate({"optimizer": {"ema_decay": 1.5}})
    with pytest.raises(UserError, match="optimizer.clip_norm"):
        validate({"optimizer": {"clip_norm": -1.0}})


def test_ema_weights_are_evaluated_each_epoch_and_can_pick_the_best_checkpoint(tmp_path, small_dir):
    """`tfdp train` with an EMA: every epoch reports val_ema_* beside val_*, the best checkpoint is chosen by
    val_ema_top1, and the run's own weights are put back after the EMA's evaluation (the raw validation of
    the next epoch is not the EMA's)."""
    import json
    from conftest import read_jsonl, run_tfdp
    from support.inprocess import train_in_process
    # In this process (the run's files are the point, not its process); the bad setting below is a `tfdp` process.
    train_in_process("--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=16",
                     f"--data_dir={small_dir}", "--data_format=image_folder", f"--model_dir={tmp_path}", "--epochs=2",
                     "--set=optimizer.ema_decay=0.9", "--set=train.best_metric=val_ema_top1",
                     "--set=schedule.warmup_epochs=0")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all({"val_ema_top1", "val_ema_loss", "val_top1"} <= set(r) for r in rows)
    assert any(r["val_ema_loss"] != r["val_loss"] for r in rows)
    best = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    assert best["metric"] == "val_ema_top1" and best["value"] == max(r["val_ema_top1"] for r in rows)
    # The best checkpoint holds the moving average, not the trained weights of its epoch.
    import h5py
    def kernel(path):
        with h5py.File(path) as f:
            found = []
            f.visititems(lambda name, obj: found.append(obj[()]) if "vars" in name and hasattr(obj, "shape")
                         and len(obj.shape) == 4 else None)
            return found[0]
    epoch_dir = tmp_path / "checkpoints" / f"epoch-{best['epoch']:04d}"   # both epochs' checkpoints are kept
    assert not np.allclose(kernel(tmp_path / "checkpoints" / "best.weights.h5"), kernel(epoch_dir / "model.weights.h5"))
    bad = run_tfdp("train", "--config=configs/digits.yaml", f"--model_dir={tmp_path}/x",
                   "--set=train.best_metric=val_ema_top1", timeout=60)
    assert bad.returncode == 2 and "needs optimizer.ema_decay" in bad.stderr.strip().splitlines()[-1]


def test_sgd_weight_decay_is_l2_through_the_momentum_as_in_torch():
    """Two steps with momentum 0.9, lr 0.1, weight decay 0.01 and a zero gradient: torch.optim.SGD's maths
    (v = 0.9 v + (g + wd w); w -= lr v), and none for an excluded variable."""
    import keras
    w0 = np.array([1.0, -2.0], "float32")
    kernel, bias = keras.Variable(w0, name="kernel"), keras.Variable(w0, name="bias")
    opt = build_optimizer(OptimizerConfig(name="sgd", momentum=0.9, weight_decay=0.01, decay_norm_and_bias=False), 0.1)
    opt.build([kernel, bias])
    w, v = w0.copy(), np.zeros(2, "float32")
    for _ in range(2):
        opt.apply([tf.zeros(2), tf.zeros(2)], [kernel, bias])
        v = 0.9 * v + 0.01 * w
        w = w - 0.1 * v
    np.testing.assert_allclose(kernel.numpy(), w, rtol=1e-6)
    np.testing.assert_array_equal(bias.numpy(), w0)


def test_decay_bias_spares_norm_layers_only_as_torchvisions_norm_weight_decay():
    """torchvision's --norm-weight-decay 0.0 alone: batch norm's gamma/beta undecayed, a bias decayed with the
    kernels (optimizer.decay_bias: true); without it NO_DECAY spares the bias too."""
    import keras
    w0 = np.array([1.0, -2.0], "float32")

    def after_two_steps(**opt):
        variables = [keras.Variable(w0, name=n) for n in ("kernel", "bias", "gamma")]
        cfg = OptimizerConfig(name="sgd", momentum=0.9, weight_decay=0.01, decay_norm_and_bias=False, **opt)
        optimizer = build_optimizer(cfg, 0.1, "torchvision")
        optimizer.build(variables)
        for _ in range(2):
            optimizer.apply([tf.zeros(2)] * 3, variables)
        return [not np.array_equal(v.numpy(), w0) for v in variables]

    assert after_two_steps(decay_bias=True) == [True, True, False]
    assert after_two_steps() == [True, False, False]


def test_decay_bias_without_sparing_norms_is_one_line():
    with pytest.raises(UserError, match="optimizer.decay_bias applies with optimizer.decay_norm_and_bias: false"):
        validate({"optimizer": {"decay_bias": True}})


def test_rmsprop_is_tensorflow_1s_rmsprop_with_l2():
    """Three steps of tf.compat.v1.train.RMSPropOptimizer's maths (mean square starting at 1, eps inside the
    root, momentum on the scaled step) with L2 1e-2 through the gradient, none for an excluded variable."""
    import keras
    w0, g = np.array([1.0, -2.0], "float32"), np.array([0.5, 0.05], "float32")
    kernel, bias = keras.Variable(w0, name="kernel"), keras.Variable(w0, name="bias")
    opt = build_optimizer(OptimizerConfig(name="rmsprop", rho=0.9, momentum=0.9, epsilon=1e-3, weight_decay=0.01,
                                          decay_norm_and_bias=False), 0.1)
    opt.build([kernel, bias])

    def reference(w, l2):
        ms, mom = np.ones(2), np.zeros(2)
        for _ in range(3):
            grad = g + l2 * w
            ms = 0.9 * ms + 0.1 * grad ** 2
            mom = 0.9 * mom + 0.1 * grad / np.sqrt(ms + 1e-3)
            w = w - mom
        return w

    for _ in range(3):
        opt.apply([tf.constant(g), tf.constant(g)], [kernel, bias])
    np.testing.assert_allclose(kernel.numpy(), reference(w0.astype(np.float64), 0.01), rtol=1e-5)
    np.testing.assert_allclose(bias.numpy(), reference(w0.astype(np.float64), 0.0), rtol=1e-5)


def test_mixed_float16_keeps_keras_update_inside_the_compiled_step():
    """mixed_float16 wraps the optimizer in Keras' loss-scale optimizer, whose skip-on-overflow decision is
    taken across replicas: the compiled step keeps forward/backward in XLA and Keras' own update, and trains
    like the uncompiled step on 2 replicas."""
    plain, _ = toy_fit("sgd", 2, jit=False, precision="mixed_float16")
    xla, _ = toy_fit("sgd", 2, jit=True, precision="mixed_float16")
    forward_backward, whole_step, update = xla.tfdp_step_functions
    assert forward_backward.experimental_get_tracing_count() > 0 and update.experimental_get_tracing_count() == 0
    assert int(xla.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == STEPS
    for a, b in zip(plain.trainable_weights, xla.trainable_weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=2e-2, atol=2e-3, err_msg=a.path)


@pytest.mark.parametrize("name, lr", [("muon", 0.01), ("lion", 0.01), ("schedule_free_adamw", 0.1), ("adafactor", 0.01)])
def test_keras_newer_optimizers_by_name_train_and_spare_the_no_decay_set(name, lr):
    """Muon, Lion, ScheduleFreeAdamW and Adafactor (Keras' own) from a config: with zero gradients the decoupled
    weight decay shrinks a kernel and leaves a bias (NO_DECAY) as it was; a small classifier's loss falls in 20
    steps."""
    import keras
    cfg = validate({"optimizer": {"name": name, "weight_decay": 0.1, "decay_norm_and_bias": False}}).optimizer
    kernel = keras.Variable(np.ones((4, 3), "float32"), name="kernel")
    bias = keras.Variable(np.ones(3, "float32"), name="bias")
    optimizer = build_optimizer(cfg, 0.01)
    optimizer.build([kernel, bias])
    for _ in range(3):   # ScheduleFreeAdamW's first step (averaging weight 1) returns to its momentum point
        optimizer.apply([tf.zeros((4, 3)), tf.zeros(3)], [kernel, bias])
    assert np.all(kernel.numpy() < 1 - 1e-4)
    np.testing.assert_allclose(bias.numpy(), 1.0, rtol=1e-6)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(4, 3)), axis=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=build_optimizer(cfg, lr), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=16, epochs=5, verbose=0)
    assert model.evaluate(x, y, verbose=0) < 0.9 * before


@pytest.mark.parametrize("name, rules", [("muon", "keras"), ("lion", "keras"), ("schedule_free_adamw", "keras"),
                                         ("adafactor", "keras"), ("sgd", "timm"), ("adamw", "timm"),
                                         ("lamb", "timm")])
def test_layer_decay_scales_every_optimizers_step_and_decay(name, rules):
    """optimizer.layer_decay's per-variable scale (tfdp/optim/finetune.py) reaches the new optimizers and the torch
    forms: at scale 0.5 a first step (decay included) is half the step at scale 1, for a decayed kernel and an
    undecayed bias."""
    import keras
    from tfdp.optim.finetune import ScaledLearningRates
    g = np.array([[0.3, -0.2], [0.1, 0.5], [-0.4, 0.2]], "float32")
    moved = []
    for scale in (1.0, 0.5):
        kernel = keras.Variable(np.ones((3, 2), "float32"), name="kernel")
        bias = keras.Variable(np.ones(2, "float32"), name="bias")
        optimizer = build_optimizer(OptimizerConfig(name=name, weight_decay=0.1, decay_norm_and_bias=False), 0.01, rules)
        optimizer.build([kernel, bias])
        optimizer.__class__ = type("Scaled", (ScaledLearningRates, type(optimizer)), {})   # as scale_learning_rates does
        optimizer.tfdp_lr_scales = [scale, scale]
        optimizer.apply([tf.constant(g), tf.constant(g[0])], [kernel, bias])
        moved.append(np.concatenate([1 - kernel.numpy().ravel(), 1 - bias.numpy()]))
    # Steps of 1e-4 to 1e-2 read off weights near 1 carry float32's ulp at 1 (1.2e-7) each; Adafactor scales
    # its step by the weights' RMS after the (scaled) decay, 5e-4 apart at these rates. A missed scale is 100%.
    np.testing.assert_allclose(moved[1], 0.5 * moved[0], rtol=1e-3, atol=2.4e-7)
