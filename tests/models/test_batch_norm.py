"""tfdp's `BatchNormalization` under torch's rule is torch's BatchNorm2d: the same training outputs, running
statistics and evaluation outputs over three steps (tests/fixtures/make_batchnorm_fixture.py, torch 2.13 in float64);
under Keras' rule it is Keras' own layer.

Tolerances are float32's worst-case error bounds, not measurements: a sum of n float32 terms in any order is within
(n - 1)·u·Σ|terms| of the exact sum (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2; u = 2^-24, half
of numpy's float32 eps), so with `N_EPS` = n·eps = 2n·u (headroom for the divisions and square roots, a few u each)
a per-channel mean over n values is within N_EPS·max|x|, a two-pass variance within N_EPS relative, and a normalised
output within N_EPS·(|γ|·max|x| / σ + max|γ·x̂| + max|y|). They hold on any host and summation order.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.models.batch_norm import BatchNormalization, use_batch_norm_rule

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "batchnorm.npz")
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(FIXTURE))


def values_per_channel(x) -> int:
    return int(np.prod(x.shape[:-1]))


def output_tolerance(x, y, gamma, variance) -> float:
    """The float32 bound on a normalised output (module docstring), from the batch, its outputs and statistics."""
    n_eps = values_per_channel(x) * EPS32
    sigma = np.sqrt(variance)
    return n_eps * float(np.max(np.abs(gamma) * np.abs(x).max(axis=tuple(range(x.ndim - 1))) / sigma)
                         + 2 * np.abs(y).max())


def torch_layer(ref, cls=BatchNormalization, **kwargs) -> keras.layers.BatchNormalization:
    """torch's BatchNorm2d defaults (momentum 0.1 = Keras' 0.9, eps 1e-5) with the fixture's scale and shift."""
    layer = cls(momentum=0.9, epsilon=1e-5, **kwargs)
    layer.build((None, 5, 5, 3))
    layer.gamma.assign(ref["gamma"])
    layer.beta.assign(ref["beta"])
    return layer


def train_three_steps(layer, ref, step=None):
    """The fixture's three training batches through `layer` (through `step(x)` if given); its outputs and running
    statistics after each."""
    step = step or (lambda x: layer(x, training=True))
    out = []
    for x in ref["train_x"]:
        y = step(tf.constant(x))
        out.append((np.asarray(y, np.float64), layer.moving_mean.numpy(), layer.moving_variance.numpy()))
    return out


def check_against_torch(ref, trained, layer):
    n_eps = values_per_channel(ref["train_x"][0]) * EPS32
    for i, (y, mean, var) in enumerate(trained):
        x = ref["train_x"][i]
        batch_var = x.reshape(-1, 3).astype(np.float64).var(axis=0)
        np.testing.assert_allclose(y, ref["train_y"][i], rtol=0,
                                   atol=output_tolerance(x, ref["train_y"][i], ref["gamma"], batch_var))
        # The running statistics mix batch statistics over the steps: a few roundings more than one batch's.
        np.testing.assert_allclose(mean, ref["running_mean"][i], rtol=0, atol=2 * n_eps * np.abs(x).max())
        np.testing.assert_allclose(var, ref["running_var"][i], rtol=2 * n_eps)
    y = layer(tf.constant(ref["eval_x"]), training=False).numpy()
    np.testing.assert_allclose(y, ref["eval_y"], rtol=0,
                               atol=output_tolerance(ref["eval_x"], ref["eval_y"], ref["gamma"],
                                                     ref["running_var"][-1]))


def test_torch_rule_is_torch_batchnorm2d_in_training_and_evaluation(ref):
    layer = torch_layer(ref, running_variance="torch")
    check_against_torch(ref, train_three_steps(layer, ref), layer)


def test_keras_rule_fails_torch_running_variance(ref):
    """Keras' own layer (and tfdp's under Keras' rule, which runs Keras' step): the same training outputs, a running
    variance short of torch's by 0.1 · var / (n - 1) after one step, and evaluation outputs apart."""
    for layer in (torch_layer(ref, cls=keras.layers.BatchNormalization), torch_layer(ref, running_variance="keras")):
        trained = train_three_steps(layer, ref)
        np.testing.assert_allclose(trained[0][0], ref["train_y"][0], rtol=0, atol=1e-4)
        with pytest.raises(AssertionError, match="running|Not equal"):
            check_against_torch(ref, trained, layer)
        # after one step torch's running variance exceeds Keras' by exactly 0.1 · var / (n - 1), 10-70 times the bound
        batch_var = ref["train_x"][0].reshape(-1, 3).astype(np.float64).var(axis=0)
        np.testing.assert_allclose(trained[0][2], 0.9 + 0.1 * batch_var, rtol=2 * 100 * EPS32)
        shortfall = ref["running_var"][0] - trained[0][2]
        np.testing.assert_allclose(shortfall, 0.1 * batch_var / 99, rtol=0.05)
        assert np.all(shortfall > 10 * 2 * 100 * EPS32 * ref["running_var"][0])


def test_torch_rule_under_xla_is_torch_batchnorm2d(ref):
    """The layer's statistics update inside one XLA-compiled function, as tfdp's compiled training step runs it."""
    layer = torch_layer(ref, running_variance="torch")
    step = tf.function(lambda x: layer(x, training=True), jit_compile=True)
    check_against_torch(ref, train_three_steps(layer, ref, step), layer)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_torch_rule_under_mixed_precision_keeps_float32_statistics(ref, policy):
    """Under a mixed policy the layer sees its input in float16 (bfloat16), keeps its variables in float32 and takes
    the statistics in float32: its running statistics are the float32 layer's on the same rounded inputs, to the
    float32 bound (the outputs round to 16 bits, so they are not compared)."""
    half = tf.float16 if policy == "mixed_float16" else tf.bfloat16
    mixed = torch_layer(ref, running_variance="torch", dtype=policy)
    full = torch_layer(ref, running_variance="torch")
    n_eps = values_per_channel(ref["train_x"][0]) * EPS32
    for x in ref["train_x"]:
        rounded = tf.cast(tf.cast(x, half), tf.float32)
        assert mixed(tf.cast(x, half), training=True).dtype == half
        full(rounded, training=True)
        assert mixed.moving_variance.dtype == "float32"
        np.testing.assert_allclose(mixed.moving_mean.numpy(), full.moving_mean.numpy(), rtol=0,
                                   atol=2 * n_eps * np.abs(x).max())
        np.testing.assert_allclose(mixed.moving_variance.numpy(), full.moving_variance.numpy(), rtol=2 * n_eps)


def test_rule_survives_saving_and_keeps_the_variable_names(ref, tmp_path):
    """A model saved with torch's rule reloads with it; the variables keep Keras' names and the layer Keras' class
    name (the key of a Keras weights file), so checkpoints written with Keras' layer load into tfdp's and back."""
    def model():
        inputs = keras.Input((5, 5, 3))
        return keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(inputs))
    plain, ruled = model(), model()
    plain.set_weights([np.full(3, v, np.float32) for v in (2.0, 3.0, 4.0, 5.0)])
    plain.save_weights(tmp_path / "plain.weights.h5")
    assert use_batch_norm_rule(ruled, "torch") == 1
    assert [v.path for v in ruled.weights] == ["bn/gamma", "bn/beta", "bn/moving_mean", "bn/moving_variance"]
    ruled.load_weights(tmp_path / "plain.weights.h5")
    assert [float(w[0]) for w in ruled.get_weights()] == [2.0, 3.0, 4.0, 5.0]
    ruled.save_weights(tmp_path / "ruled.weights.h5")
    fresh = model()
    fresh.load_weights(tmp_path / "ruled.weights.h5")
    assert [float(w[0]) for w in fresh.get_weights()] == [2.0, 3.0, 4.0, 5.0]
    ruled.save(tmp_path / "model.keras")
    restored = keras.saving.load_model(tmp_path / "model.keras")
    layer = restored.get_layer("bn")
    assert isinstance(layer, BatchNormalization) and layer.running_variance == "torch"
    with pytest.raises(ValueError, match="unknown batch-norm rule 'tf'"):
        use_batch_norm_rule(fresh, "tf")
