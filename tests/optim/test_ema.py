"""timm's ModelEmaV3 and torchvision's ExponentialMovingAverage (`rules: timm | torchvision`) against real runs.

The fixture (tests/fixtures/make_optimizer_fixture.py) holds 20 states of a tiny torch model (Linear, BatchNorm1d,
Linear) and the EMA model each reference keeps over them, batch-norm running statistics included. tfdp's
optimizer, built from its config, sees the same states in a Keras model of the same layers (its weights set
before each step, a learning rate of 0 so the step itself changes nothing) and must hold the same averages.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.config import OptimizerConfig, validate
from tfdp.errors import UserError
from tfdp.optim.ema import EmaTiming
from tfdp.optim.optimizers import build_optimizer, track_buffers

FIXTURE = "tests/fixtures/optimizer_trajectories.npz"
# Keras variable -> (torch state-dict name, transposed)
NAMES = {"dense/kernel": ("0.weight", True), "dense/bias": ("0.bias", False), "bn/gamma": ("1.weight", False),
         "bn/beta": ("1.bias", False), "bn/moving_mean": ("1.running_mean", False),
         "bn/moving_variance": ("1.running_var", False), "head/kernel": ("2.weight", True),
         "head/bias": ("2.bias", False)}
# Each EMA step is one lerp of O(1) float32 values (ulp 1.2e-7 at 1, 2.4e-7 at 2): after 20 steps the averages
# can differ from torch's by 20 roundings of the last step's size, about 20 x 2.4e-7 = 5e-6, on any host.
ATOL = 5e-6
CASES = {
    "timm": ("timm", dict(ema_decay=0.9)),
    "timm_warmup": ("timm", dict(ema_decay=0.99, ema_warmup=True)),
    "torchvision": ("torchvision", dict(ema_decay=0.99, ema_every_steps=2)),
}
# The fixture's torchvision run: global batch 8, 5 steps an epoch, 4 epochs, 1 warmup epoch.
TIMING = EmaTiming(global_batch=8, steps_per_epoch=5, epochs=4, warmup_epochs=1)


def key(variable) -> str:
    """layer/variable, as NAMES writes it."""
    return "/".join(variable.path.split("/")[-2:])


def tiny_model():
    import keras
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="dense"),
                             keras.layers.BatchNormalization(epsilon=1e-5, momentum=0.9, name="bn"),
                             keras.layers.Dense(2, name="head")])


def averages_over_the_fixture(rules: str, **opt) -> list[dict[str, np.ndarray]]:
    """The optimizer's averages (weights and buffers, by Keras path) after each of the fixture's 20 states."""
    fx = np.load(FIXTURE)
    model = tiny_model()
    optimizer = build_optimizer(OptimizerConfig(name="sgd", momentum=0.0, **opt), 0.0, rules, TIMING)
    optimizer.build(model.trainable_variables)
    track_buffers(optimizer, model)
    variables = [*optimizer._trainable_variables, *getattr(optimizer, "tfdp_buffers", [])]
    averages = [*optimizer._model_variables_moving_average, *getattr(optimizer, "tfdp_buffer_averages", [])]
    out = []
    for t in range(20):
        for v in model.weights:
            name, transpose = NAMES[key(v)]
            value = fx[f"ema/model/{name}"][t]
            v.assign(value.T if transpose else value)
        optimizer.apply([tf.zeros_like(v) for v in model.trainable_variables], model.trainable_variables)
        out.append({key(v): a.numpy().copy() for v, a in zip(variables, averages)})
    return out


def expected(case: str, path: str, t: int) -> np.ndarray:
    name, transpose = NAMES[path]
    value = np.load(FIXTURE)[f"ema/{case}/{name}"][t]
    return value.T if transpose else value


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_ema_of_weights_and_batch_norm_statistics_is_the_references_after_every_step(case):
    rules, opt = CASES[case]
    got = averages_over_the_fixture(rules, **opt)
    assert set(got[0]) == set(NAMES)   # batch-norm moving mean and variance are averaged too
    for t, row in enumerate(got):
        for path, value in row.items():
            np.testing.assert_allclose(value, expected(case, path, t), rtol=0, atol=ATOL, err_msg=f"{path} step {t + 1}")


def test_keras_rules_ema_is_not_timms():
    """The difference exists: tfdp's Keras-rules EMA warms its decay up and leaves batch-norm statistics out."""
    got = averages_over_the_fixture("keras", ema_decay=0.9)
    assert "bn/moving_mean" not in got[-1]
    assert np.max(np.abs(got[-1]["dense/kernel"] - expected("timm", "dense/kernel", 19))) > 100 * ATOL


def test_torchvision_decay_is_adjusted_for_batch_steps_and_epochs():
    """alpha = min(1, (1 - 0.99) * 8 * 2 / 4) = 0.04: torchvision's adjustment, as its fixture run computed it."""
    optimizer = build_optimizer(OptimizerConfig(ema_decay=0.99, ema_every_steps=2), 0.1, "torchvision", TIMING)
    assert optimizer.adjusted_decay() == pytest.approx(float(np.load(FIXTURE)["ema/torchvision_decay"]), abs=1e-12)


def test_an_ema_field_of_one_rule_set_under_another_is_one_line():
    with pytest.raises(UserError, match=r"optimizer.ema_warmup is a rules: timm setting \(this config has rules: keras\)"):
        validate({"optimizer": {"ema_decay": 0.9, "ema_warmup": True}})
    with pytest.raises(UserError, match="optimizer.ema_every_steps is a rules: torchvision setting"):
        validate({"rules": "timm", "optimizer": {"ema_decay": 0.9, "ema_every_steps": 4}})
    with pytest.raises(UserError, match="rules"):
        validate({"rules": "pytorch"})
    assert validate({"rules": "timm", "optimizer": {"ema_decay": 0.9, "ema_warmup": True}}).optimizer.ema_warmup


@pytest.mark.parametrize("replicas, jit", [(1, True), *[pytest.param(r, j, marks=pytest.mark.full(reason="~20 s"))
                                                         for r, j in ((2, True), (2, False))]])
def test_in_the_compiled_step_the_buffers_average_is_of_this_steps_statistics(replicas, jit):
    """Inside tfdp's whole-step XLA update (and across 2 replicas; and in Keras' own step) the batch-norm
    averages follow timm's ModelEmaV3 over the statistics as each step's forward pass left them (the mean over
    replicas), not the step before's, and every replica holds the same average."""
    import sys
    sys.path.insert(0, "tests/optim")
    from test_optimizers import toy_fit
    from tfdp.distribute.replica_state import replica_copies
    decay = 0.5
    stats = []

    def record(model):
        bn = model.layers[1]
        stats.append([np.mean(replica_copies(v), axis=0) for v in (bn.moving_mean, bn.moving_variance)])
    model, _ = toy_fit("sgd", replicas, jit=jit, rules="timm", ema_decay=decay, on_step=record)
    def ema(rows):
        out = rows[0]
        for row in rows[1:]:
            out = out + (1 - decay) * (row - out)
        return out
    initial = [np.zeros(4, "float32"), np.ones(4, "float32")]   # Keras' initial moving mean and variance
    for i, average in enumerate(model.optimizer.tfdp_buffer_averages):
        want = ema([row[i] for row in stats])
        lagged = ema([initial[i]] + [row[i] for row in stats[:-1]])   # the statistics the step began with
        for copy in replica_copies(average):
            np.testing.assert_allclose(copy, want, rtol=1e-5, atol=1e-7)
        assert np.max(np.abs(want - lagged)) > 1e-4 * np.max(np.abs(want))   # which the check tells apart


@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.full(reason="2 replicas: ~30 s"))])
def test_the_ema_evaluation_uses_the_averaged_statistics_and_a_checkpoint_holds_them(replicas, tmp_path):
    """`ema_weights` (the val_ema_* evaluation and the best checkpoint by it) swaps in the batch-norm averages
    with the weights' on every replica and puts the trained ones back; the weights file (optimizer state
    included) holds the averages, so a run resumed from it continues the same average."""
    import sys
    sys.path.insert(0, "tests/optim")
    from test_optimizers import toy_fit
    from tfdp.distribute.replica_state import replica_copies
    from tfdp.train.callbacks import ema_weights
    model, _ = toy_fit("sgd", replicas, jit=True, rules="timm", ema_decay=0.5)
    optimizer, bn = model.optimizer, model.layers[1]
    averages = [a.numpy().copy() for a in optimizer.tfdp_buffer_averages]
    trained = [v.numpy().copy() for v in (bn.moving_mean, bn.moving_variance)]
    assert not np.allclose(averages[0], trained[0], rtol=1e-3, atol=0)
    with ema_weights(model):
        for variable, average in zip((bn.moving_mean, bn.moving_variance), averages):
            for copy in replica_copies(variable):
                np.testing.assert_array_equal(copy, average)
    for variable, value in zip((bn.moving_mean, bn.moving_variance), trained):
        np.testing.assert_array_equal(variable.numpy(), value)
    path = str(tmp_path / "run.weights.h5")
    model.save_weights(path)
    other, _ = toy_fit("sgd", replicas, jit=True, rules="timm", ema_decay=0.9)   # another average
    other.load_weights(path)
    for mine, loaded in zip(averages, other.optimizer.tfdp_buffer_averages):
        np.testing.assert_array_equal(loaded.numpy(), mine)


@pytest.mark.parametrize("rules, opt, timing, weight", [
    ("timm", dict(ema_decay=0.99996), TIMING, 1 - 0.99996),
    ("torchvision", dict(ema_decay=0.99998, ema_every_steps=1),
     EmaTiming(global_batch=2, steps_per_epoch=5, epochs=1, warmup_epochs=0), 2 * (1 - 0.99998))])
def test_a_decay_near_one_moves_the_average_by_its_double_precision_complement(rules, opt, timing, weight):
    """The references compute 1 - decay in Python (double) before torch rounds it to float32: DeiT's EMA at 0.99996
    moves by 4e-5 of the gap, where 1 - float32(0.99996) would move it by 3.9995e-5 (1.3e-4 off)."""
    import keras
    w = keras.Variable(np.zeros(3, "float32"), name="kernel")
    optimizer = build_optimizer(OptimizerConfig(name="sgd", momentum=0.0, **opt), 0.0, rules, timing)
    optimizer.build([w])
    for value in (0.0, 1.0):   # the first update copies 0; the second moves the average towards 1
        w.assign(np.full(3, value, "float32"))
        optimizer.apply([tf.zeros(3)], [w])
    np.testing.assert_allclose(optimizer._model_variables_moving_average[0].numpy(), weight, rtol=1e-6)
