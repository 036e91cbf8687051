"""Knowledge distillation's losses, as DeiT (facebookresearch/deit, `losses.py`) and timm (`timm/task/`) define them.

A teacher's logits teach the student's logits (for a distilled DeiT, its
distillation head's):

- soft: the KL divergence between the teacher's and the student's softmax at
  temperature τ, times τ² (Hinton et al. 2015: the gradients keep their size
  whatever τ). timm divides the sum over the batch by the batch (`batchmean`);
  DeiT divides it by the number of logits, batch x classes (`reduction='sum'
  / outputs_kd.numel()`, as its losses.py comments: PyTorch's legacy reduction), so
  DeiT's term is the classes' count smaller.
- hard: cross-entropy against the teacher's top class (DeiT's and timm's
  `hard`; DeiT's ⚗ models were trained with it).

Both are Keras losses over a batch, reduced as every tfdp loss is (mean over
the images, scaled for the replicas), in float32 whatever the compute dtype.
`combined` weighs them against the labels' loss: (1 - α) base + α distill,
DeiT's `DistillationLoss`.
"""

from __future__ import annotations

import keras
from keras import ops

from tfdp.optim.losses import SparseSmoothedCrossentropy

# train.teacher.soft_reduction -> what the summed KL divergence of a batch is divided by, as a count per image.
SOFT_REDUCTIONS = {"batch": lambda classes: 1.0, "logits": lambda classes: float(classes)}


@keras.saving.register_keras_serializable(package="tfdp")
class SoftDistillation(keras.losses.Loss):
    """KL(teacher ‖ student) at temperature `tau`, times τ²; `y_true` is the teacher's logits.

    Per image: τ² Σ_c p_t (log p_t - log p_s), divided by the classes' count
    where `reduction_of_sum` is `logits` (DeiT's numel), by 1 where `batch`
    (timm's batchmean); the batch mean then completes either.
    """

    def __init__(self, tau: float = 1.0, reduction_of_sum: str = "batch", name: str = "soft_distillation", **kwargs):
        super().__init__(name=name, **kwargs)
        if tau <= 0:
            raise ValueError(f"the distillation temperature must be above 0, got {tau}")
        self.tau, self.reduction_of_sum = float(tau), reduction_of_sum

    def call(self, y_true, y_pred):
        log_teacher = ops.log_softmax(ops.cast(y_true, "float32") / self.tau, axis=-1)
        log_student = ops.log_softmax(ops.cast(y_pred, "float32") / self.tau, axis=-1)
        kl = ops.sum(ops.exp(log_teacher) * (log_teacher - log_student), axis=-1)
        per = SOFT_REDUCTIONS[self.reduction_of_sum](ops.shape(y_pred)[-1])
        return kl * (self.tau * self.tau / per)

    def get_config(self):
        return {**super().get_config(), "tau": self.tau, "reduction_of_sum": self.reduction_of_sum}


@keras.saving.register_keras_serializable(package="tfdp")
class HardDistillation(keras.losses.Loss):
    """Cross-entropy against the teacher's top class; `y_true` is the teacher's logits."""

    def __init__(self, name: str = "hard_distillation", **kwargs):
        super().__init__(name=name, **kwargs)
        self._cross_entropy = SparseSmoothedCrossentropy(reduction=None)

    def call(self, y_true, y_pred):
        return self._cross_entropy(ops.argmax(y_true, axis=-1), y_pred)


def _soft(tau: float, reduction_of_sum: str) -> keras.losses.Loss:
    return SoftDistillation(tau, reduction_of_sum)


def _hard(tau: float, reduction_of_sum: str) -> keras.losses.Loss:
    return HardDistillation()


# train.teacher.distillation -> its loss, from (τ, soft_reduction).
DISTILLATION_LOSSES = {"soft": _soft, "hard": _hard}


def distillation_loss(kind: str, tau: float = 1.0, reduction_of_sum: str = "batch") -> keras.losses.Loss:
    """The loss `train.teacher.distillation` names (soft or hard)."""
    return DISTILLATION_LOSSES[kind](tau, reduction_of_sum)


def combined(base, distill, alpha: float):
    """DeiT's `DistillationLoss`: the labels' loss and the teacher's, weighed (1 - α) and α."""
    return base * (1.0 - alpha) + distill * alpha
