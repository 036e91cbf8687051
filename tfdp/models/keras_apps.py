"""Architectures taken as they are from `keras.applications` (weights=None: nothing downloads)."""

from __future__ import annotations

import keras

from tfdp.models import register


@register("resnet50")
def resnet50(input_shape, num_classes: int, dropout: float = 0.0) -> keras.Model:
    base = keras.applications.ResNet50(weights=None, include_top=False, input_shape=input_shape, pooling="avg")
    x = base.output
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    logits = keras.layers.Dense(num_classes, name="predictions")(x)
    return keras.Model(base.input, logits, name="resnet50_backbone")
