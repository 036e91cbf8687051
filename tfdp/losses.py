"""Sparse-label cross-entropy with label smoothing (Keras' sparse loss has no smoothing)."""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfdp")
class SparseSmoothedCrossentropy(keras.losses.Loss):
    """Cross-entropy from logits against integer labels smoothed by `label_smoothing`.

    Computed in float32 whatever the model's compute dtype, so mixed precision
    never loses the loss to underflow.
    """

    def __init__(self, label_smoothing: float = 0.0, name: str = "sparse_smoothed_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        logits = ops.cast(y_pred, "float32")
        labels = ops.cast(ops.reshape(y_true, (-1,)), "int32")
        if not self.label_smoothing:
            return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        one_hot = ops.one_hot(labels, ops.shape(logits)[-1])
        return keras.losses.categorical_crossentropy(one_hot, logits, from_logits=True,
                                                     label_smoothing=self.label_smoothing)

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}
