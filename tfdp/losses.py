"""The loss and accuracy metrics, for integer labels or the soft labels Mixup and CutMix make.

Keras' sparse loss has no label smoothing and its sparse metrics cannot
read soft labels, so both are here. A soft label is a float [batch, classes]
row summing to 1; smoothing it is the same as timm's (smoothing is affine, so
smoothing the mixed targets equals mixing the smoothed ones).
"""

from __future__ import annotations

import keras
from keras import ops


def is_soft(y_true) -> bool:
    """Soft labels: float rows of class probabilities (integer class ids otherwise)."""
    return "float" in str(y_true.dtype) and len(y_true.shape) == 2 and y_true.shape[-1] not in (None, 1)


@keras.saving.register_keras_serializable(package="tfdp")
class SparseSmoothedCrossentropy(keras.losses.Loss):
    """Cross-entropy from logits against integer or soft labels, smoothed by `label_smoothing`.

    Computed in float32 whatever the model's compute dtype, so mixed precision
    never loses the loss to underflow.
    """

    def __init__(self, label_smoothing: float = 0.0, name: str = "sparse_smoothed_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        logits = ops.cast(y_pred, "float32")
        if is_soft(y_true):
            return keras.losses.categorical_crossentropy(ops.cast(y_true, "float32"), logits, from_logits=True,
                                                         label_smoothing=self.label_smoothing)
        labels = ops.cast(ops.reshape(y_true, (-1,)), "int32")
        if not self.label_smoothing:
            return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        one_hot = ops.one_hot(labels, ops.shape(logits)[-1])
        return keras.losses.categorical_crossentropy(one_hot, logits, from_logits=True,
                                                     label_smoothing=self.label_smoothing)

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


class _HardTargets:
    """Scores a soft label by its largest class (for Mixup/CutMix, the image that contributed most)."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        if is_soft(y_true):
            y_true = ops.argmax(y_true, axis=-1)
        return super().update_state(y_true, y_pred, sample_weight=sample_weight)


@keras.saving.register_keras_serializable(package="tfdp")
class Top1(_HardTargets, keras.metrics.SparseCategoricalAccuracy):
    pass


@keras.saving.register_keras_serializable(package="tfdp")
class TopK(_HardTargets, keras.metrics.SparseTopKCategoricalAccuracy):
    pass
