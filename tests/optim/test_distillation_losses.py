"""The distillation losses against DeiT's `DistillationLoss` and timm's distillation term, on the same logits
(tests/fixtures/make_distillation_fixture.py: torch 2.13, timm 1.0.31)."""

import json
import pathlib

import numpy as np
import pytest

from tfdp.optim.distillation import SoftDistillation, combined, distillation_loss
from tfdp.optim.losses import SparseSmoothedCrossentropy

FIXTURE = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" / "distillation.json").read_text())
# Losses of a few units from float32 logits of a few units: log-softmax, a sum over 10 classes and a mean over 8
# images each round to a few ulps of float32 (1.2e-7 relative) in torch and in TensorFlow alike, whatever the host's
# order of summation; 1e-5 relative is some 80 ulps.
RTOL = 1e-5


def arrays(*names):
    return [np.asarray(FIXTURE[n], np.float32 if n != "labels" else np.int32) for n in names]


@pytest.mark.parametrize("kind", ["soft", "hard"])
@pytest.mark.parametrize("targets", ["labels", "mixup"])
def test_equals_deit_distillation_loss(kind, targets):
    """(1 - α) base(class head, labels) + α distill(dist head, teacher), DeiT's numel reduction for soft."""
    head, head_dist, teacher, labels, soft = arrays("head", "head_dist", "teacher", "labels", "soft_targets")
    base = float(SparseSmoothedCrossentropy()(labels if targets == "labels" else soft, head))
    distill = float(distillation_loss(kind, FIXTURE["tau"], "logits")(teacher, head_dist))
    assert combined(base, distill, FIXTURE["alpha"]) == pytest.approx(FIXTURE["deit"][f"{kind}_{targets}"], rel=RTOL)


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_equals_timm_distillation_term(kind):
    """timm's term: batchmean KL times τ², or cross-entropy on the teacher's argmax."""
    head_dist, teacher = arrays("head_dist", "teacher")
    got = float(distillation_loss(kind, FIXTURE["tau"], "batch")(teacher, head_dist))
    assert got == pytest.approx(FIXTURE["timm"][kind], rel=RTOL)


def test_reductions_differ_by_the_classes():
    """DeiT's numel divides by batch x classes, timm's batchmean by the batch: the same term, 10 times smaller."""
    head_dist, teacher = arrays("head_dist", "teacher")
    deit, timm = (float(SoftDistillation(FIXTURE["tau"], r)(teacher, head_dist)) for r in ("logits", "batch"))
    assert timm == pytest.approx(deit * teacher.shape[-1], rel=RTOL)


def test_zero_when_the_student_is_the_teacher():
    teacher, = arrays("teacher")
    assert float(SoftDistillation(2.0)(teacher, teacher)) == pytest.approx(0.0, abs=1e-6)


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        SoftDistillation(0.0)
