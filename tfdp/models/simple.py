"""A small convnet without batch norm.

Its forward pass has no per-replica statistics, so N replicas on global batch
B compute exactly what one replica does: the reference model for the
data-parallel equivalence tests, and a seconds-per-epoch model for smoke runs.
"""

from __future__ import annotations

import keras
from keras import layers

from tfdp.models.registry import register


@register("simple_cnn", min_size=8, fixed_size=True,
          layer_groups={"stem": r"^conv1$", "blocks": r"^conv(\d+)$"})  # fc goes with the head  # flattens its feature map
def simple_cnn(input_shape, num_classes: int, dropout: float) -> keras.Model:
    inputs = keras.Input(input_shape)
    x = inputs
    for i, filters in enumerate((32, 64)):
        x = layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"conv{i + 1}")(x)
        x = layers.MaxPooling2D(2, name=f"pool{i + 1}")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(128, activation="relu", name="fc")(x)
    if dropout:
        x = layers.Dropout(dropout, name="dropout")(x)
    logits = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, logits, name="simple_cnn_backbone")
