"""The loss and metrics take the soft labels Mixup/CutMix make as well as integer labels."""

import numpy as np
import pytest

from tfdp.losses import SparseSmoothedCrossentropy, Top1, TopK


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
