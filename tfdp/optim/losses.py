"""The losses and accuracy metrics, for integer labels or the soft labels Mixup and CutMix make.

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


@keras.saving.register_keras_serializable(package="tfdp")
class BinaryCrossEntropy(keras.losses.Loss):
    """One-vs-all binary cross-entropy from logits (a sigmoid per class), timm's `BinaryCrossEntropy`.

    ResNet strikes back (Wightman et al. 2021) trains with it: with Mixup/CutMix
    every class present in the image is a positive, instead of the classes
    competing for one softmax. The target is smoothed as timm smooths it
    (off = smoothing / classes, on = 1 - smoothing + off; for a soft label, the
    same affine map, which is what timm's Mixup hands its loss), then, with a
    `target_threshold`, made 1 where above it and 0 elsewhere. The mean runs over
    classes and images, as timm's `reduction='mean'`. Float32 whatever the
    compute dtype.
    """

    def __init__(self, label_smoothing: float = 0.0, target_threshold: float | None = None,
                 name: str = "binary_cross_entropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = float(label_smoothing)
        self.target_threshold = None if target_threshold is None else float(target_threshold)

    def call(self, y_true, y_pred):
        logits = ops.cast(y_pred, "float32")
        target = self._targets(y_true, ops.shape(logits)[-1])
        # max(x, 0) - x t + log(1 + exp(-|x|)): torch's binary_cross_entropy_with_logits, stable for any x.
        losses = ops.relu(logits) - logits * target + ops.log1p(ops.exp(-ops.abs(logits)))
        return ops.mean(losses, axis=-1)

    def _targets(self, y_true, num_classes):
        """Per-class targets in [0, 1]: smoothed, then thresholded."""
        if is_soft(y_true):
            target = ops.cast(y_true, "float32")
        else:
            target = ops.one_hot(ops.cast(ops.reshape(y_true, (-1,)), "int32"), num_classes)
        if self.label_smoothing:
            target = target * (1.0 - self.label_smoothing) + self.label_smoothing / ops.cast(num_classes, "float32")
        if self.target_threshold is not None:
            target = ops.cast(target > self.target_threshold, "float32")
        return target

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing,
                "target_threshold": self.target_threshold}


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
