"""SqueezeNet 1.1 (Iandola et al. 2016), following torchvision: 1,235,496 parameters at 1,000 classes.

Fire modules (1x1 squeeze, then 1x1 and 3x3 expand, concatenated); the
classifier (after dropout, 0.5 by default) is a 1x1 convolution to the classes,
ReLU and global average pool. Max-pools round their output size up as
torchvision's (`ceil_mode=True`), so its weights give the same logits.
"""

from __future__ import annotations

import re

import keras
from keras import layers

from tfdp.config import ModelConfig
from tfdp.models.registry import register
from tfdp.models.weights import Weights, register_torch_layout, renamed_modules, torch_modules


def ceil_max_pool(x, name: str):
    """torchvision's MaxPool2d(3, 2, ceil_mode=True): a last, partial window at the bottom and right edges.
    One pixel of zeros there gives it (the input follows a ReLU, so a zero never beats the window's maximum)."""
    x = layers.ZeroPadding2D(((0, 1), (0, 1)), name=f"{name}_pad")(x)
    return layers.MaxPooling2D(3, strides=2, name=name)(x)


def fire(x, squeeze: int, expand: int, name: str):
    s = layers.Conv2D(squeeze, 1, activation="relu", name=f"{name}_squeeze")(x)
    e1 = layers.Conv2D(expand, 1, activation="relu", name=f"{name}_expand1x1")(s)
    e3 = layers.Conv2D(expand, 3, padding="same", activation="relu", name=f"{name}_expand3x3")(s)
    return layers.Concatenate(name=f"{name}_concat")([e1, e3])


@register("squeezenet1_1", dropout=0.5, head=("classifier",))
def squeezenet1_1(input_shape, num_classes: int, dropout: float) -> keras.Model:
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(64, 3, strides=2, activation="relu", name="conv1")(inputs)
    x = ceil_max_pool(x, "pool1")
    x = fire(x, 16, 64, "fire2")
    x = fire(x, 16, 64, "fire3")
    x = ceil_max_pool(x, "pool3")
    x = fire(x, 32, 128, "fire4")
    x = fire(x, 32, 128, "fire5")
    x = ceil_max_pool(x, "pool5")
    for i, (s, e) in enumerate(((48, 192), (48, 192), (64, 256), (64, 256)), start=6):
        x = fire(x, s, e, f"fire{i}")
    if dropout:
        x = layers.Dropout(dropout, name="dropout")(x)
    x = layers.Conv2D(num_classes, 1, activation="relu", name="classifier")(x)
    logits = layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, logits, name="squeezenet1_1_backbone")


# ---------------------------------------------------------------- torchvision's state dict


def torchvision_layer(key: str) -> str | None:
    """torchvision's SqueezeNet 1.1 `features.N` / `classifier.1` → this file's layers."""
    fires = {3: 2, 4: 3, 6: 4, 7: 5, 9: 6, 10: 7, 11: 8, 12: 9}  # features index → fire module number
    if key == "features.0":
        return "conv1"
    if key == "classifier.1":
        return "classifier"
    m = re.fullmatch(r"features\.(\d+)\.(squeeze|expand1x1|expand3x3)", key)
    if m and int(m[1]) in fires:
        return f"fire{fires[int(m[1])]}_{m[2]}"
    return None


@register_torch_layout("squeezenet1_1", origins=("torchvision",))
def torchvision_squeezenet(tensors, model_cfg: ModelConfig, what: str) -> Weights:
    """torchvision's SqueezeNet 1.1 state dict: its modules renamed to this file's layers."""
    return renamed_modules(torch_modules(tensors), torchvision_layer, model_cfg, what)
