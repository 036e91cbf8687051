"""The loss and metrics take the soft labels Mixup/CutMix make as well as integer labels."""

import numpy as np
import pytest

from tfdp.optim.losses import SparseSmoothedCrossentropy, Top1, TopK


def _ce(logits, target):
    logits = logits - logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -(target * log_p).sum(axis=1).mean()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_soft_labels_give_the_mixed_cross_entropy(smoothing):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 10)).astype("float32")
    a, b, lam = rng.integers(0, 10, 6), rng.integers(0, 10, 6), 0.7
    eye = np.eye(10, dtype="float32")
    soft = lam * eye[a] + (1 - lam) * eye[b]
    loss = SparseSmoothedCrossentropy(smoothing)
    smoothed = soft * (1 - smoothing) + smoothing / 10
    assert float(loss(soft, logits)) == pytest.approx(_ce(logits, smoothed), rel=1e-5)
    # One-hot soft labels and integer labels are the same loss.
    assert float(loss(eye[a], logits)) == pytest.approx(float(loss(a.astype("int32"), logits)), rel=1e-6)


def test_accuracy_scores_a_soft_label_by_its_largest_class():
    logits = np.array([[0.1, 2.0, 0.3], [3.0, 0.0, 0.2]], "float32")
    soft = np.array([[0.3, 0.7, 0.0], [0.4, 0.0, 0.6]], "float32")   # true classes 1 and 2
    top1 = Top1()
    top1.update_state(soft, logits)
    assert float(top1.result()) == 0.5
    top2 = TopK(k=2)
    top2.update_state(soft, logits)
    assert float(top2.result()) == 1.0   # class 2 is second for the second image
    hard = Top1()
    hard.update_state(np.array([1, 2]), logits)
    assert float(hard.result()) == 0.5


def _timm_bce(logits, target, num_classes, smoothing=0.0, threshold=None):
    """timm.loss.BinaryCrossEntropy.forward transcribed to numpy: integer targets become one-hot rows of
    on = 1 - smoothing + smoothing/C and off = smoothing/C; soft targets arrive smoothed the same way by timm's
    Mixup (mixup_target); then the threshold, then binary_cross_entropy_with_logits averaged over everything."""
    off = smoothing / num_classes
    on = 1.0 - smoothing + off
    if target.ndim == 1:
        dense = np.full((len(target), num_classes), off)
        dense[np.arange(len(target)), target] = on
    else:  # timm's mixup_target: lam * one_hot(a, on, off) + (1 - lam) * one_hot(b, on, off)
        dense = target * (on - off) + off
    if threshold is not None:
        dense = (dense > threshold).astype(np.float64)
    x = logits.astype(np.float64)
    return float(np.mean(np.maximum(x, 0) - x * dense + np.log1p(np.exp(-np.abs(x)))))


@pytest.mark.parametrize("smoothing, threshold", [(0.0, None), (0.1, None), (0.0, 0.2), (0.1, 0.2)])
def test_bce_matches_timm_on_integer_and_soft_labels(smoothing, threshold):
    from tfdp.optim.losses import BinaryCrossEntropy
    rng = np.random.default_rng(1)
    logits = (3 * rng.normal(size=(8, 10))).astype("float32")
    a, b = rng.integers(0, 10, 8), rng.integers(0, 10, 8)
    lam = rng.uniform(0.05, 0.95, (8, 1)).astype("float32")   # some pairs below 0.2, some above
    eye = np.eye(10, dtype="float32")
    soft = lam * eye[a] + (1 - lam) * eye[b]
    loss = BinaryCrossEntropy(smoothing, threshold)
    assert float(loss(a.astype("int32"), logits)) == pytest.approx(_timm_bce(logits, a, 10, smoothing, threshold), rel=1e-5)
    assert float(loss(soft, logits)) == pytest.approx(_timm_bce(logits, soft, 10, smoothing, threshold), rel=1e-5)


def test_bce_threshold_makes_both_mixed_classes_positive():
    """With RSB's threshold 0.2, a 0.7/0.3 mix trains both classes as present: the same loss as the 1/1 target."""
    from tfdp.optim.losses import BinaryCrossEntropy
    logits = np.array([[2.0, -1.0, 0.5, -3.0]], "float32")
    mixed = np.array([[0.7, 0.3, 0.0, 0.0]], "float32")
    both = np.array([[1.0, 1.0, 0.0, 0.0]], "float32")
    loss = BinaryCrossEntropy(target_threshold=0.2)
    assert float(loss(mixed, logits)) == pytest.approx(float(BinaryCrossEntropy()(both, logits)), rel=1e-6)
    assert float(loss(mixed, logits)) != pytest.approx(float(BinaryCrossEntropy()(mixed, logits)), rel=1e-3)


def test_bce_is_float32_under_bfloat16_logits_and_round_trips_its_config():
    import keras
    from tfdp.optim.losses import BinaryCrossEntropy
    loss = BinaryCrossEntropy(0.1, 0.2)
    value = loss(np.array([1, 0], "int32"), keras.ops.cast(np.array([[9.0, -9.0], [0.1, 0.2]], "float32"), "bfloat16"))
    assert "float32" in str(value.dtype)
    again = keras.losses.deserialize(keras.losses.serialize(loss))
    assert isinstance(again, BinaryCrossEntropy) and (again.label_smoothing, again.target_threshold) == (0.1, 0.2)


def test_the_configured_loss_is_the_one_compiled():
    from tfdp.config import validate
    from tfdp.optim.losses import BinaryCrossEntropy
    from tfdp.train.task import build_loss
    built = build_loss(validate({"train": {"loss": "bce", "label_smoothing": 0.1, "bce_target_threshold": 0.2}}).train)
    assert isinstance(built, BinaryCrossEntropy) and (built.label_smoothing, built.target_threshold) == (0.1, 0.2)
    assert isinstance(build_loss(validate({}).train), SparseSmoothedCrossentropy)


def test_unknown_loss_and_a_stray_threshold_are_one_line_config_errors():
    from tfdp.config import validate
    from tfdp.errors import UserError
    with pytest.raises(UserError) as err:
        validate({"train": {"loss": "focal"}})
    assert str(err.value) == "config field 'train.loss': input should be 'softmax' or 'bce' (got 'focal')"
    with pytest.raises(UserError, match="train.bce_target_threshold applies to train.loss: bce only"):
        validate({"train": {"bce_target_threshold": 0.2}})
