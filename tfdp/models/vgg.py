"""VGG-11/13/16/19, with and without batch norm, following torchvision.

torchvision ends the convolutional part with an adaptive average pool to 7x7,
so the classifier (4096-4096-classes, dropout 0.5 by default) has the same size whatever
the input; `AdaptiveAveragePool2D` reproduces it (same bins as PyTorch). Parameter counts equal
torchvision's (VGG-16 138,357,544; VGG-16-BN 138,365,992 at 1,000 classes).
"""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np
from keras import layers

from tfdp.config import ModelConfig
from tfdp.models.registry import register
from tfdp.models.weights import Weights, register_torch_layout, renamed_modules, torch_module_values, torch_modules


@keras.saving.register_keras_serializable(package="tfdp")
class AdaptiveAveragePool2D(layers.Layer):
    """PyTorch's AdaptiveAvgPool2d: output cell i averages rows floor(i*H/n) to ceil((i+1)*H/n)."""

    def __init__(self, size: int, **kwargs):
        super().__init__(**kwargs)
        self.size = int(size)

    def _pool(self, x, axis: int, length: int):
        cells = []
        for i in range(self.size):
            start, end = (i * length) // self.size, -(-((i + 1) * length) // self.size)
            part = x[:, start:end] if axis == 1 else x[:, :, start:end]
            cells.append(keras.ops.mean(part, axis=axis))
        return keras.ops.stack(cells, axis=axis)

    def call(self, x):
        x = self._pool(x, 1, x.shape[1])
        return self._pool(x, 2, x.shape[2])

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.size, self.size, input_shape[3])

    def get_config(self):
        return {**super().get_config(), "size": self.size}

# Channels per conv layer; "M" is a 2x2 max-pool.
PLANS = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"),
}


def vgg(input_shape, num_classes: int, dropout: float, plan, batch_norm: bool, name: str,
        hidden: int = 4096) -> keras.Model:
    """torchvision's VGG of `plan`; `hidden` the two fully connected layers' width (torchvision's 4096: smaller
    only for the tiny stand-ins the reference-run tests train)."""
    inputs = keras.Input(input_shape)
    x = inputs
    for i, item in enumerate(plan):
        if item == "M":
            x = layers.MaxPooling2D(2, name=f"pool{i}")(x)
            continue
        x = layers.Conv2D(item, 3, padding="same", name=f"conv{i}")(x)
        if batch_norm:
            x = layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=f"bn{i}")(x)
        x = layers.ReLU(name=f"relu{i}")(x)
    x = AdaptiveAveragePool2D(7, name="adaptive_pool")(x)
    x = layers.Flatten(name="flatten")(x)
    for j in (1, 2):
        x = layers.Dense(hidden, activation="relu", name=f"fc{j}")(x)
        if dropout:
            x = layers.Dropout(dropout, name=f"dropout{j}")(x)
    return keras.Model(inputs, layers.Dense(num_classes, name="logits")(x), name=name)


# timm's VGG group_matcher on tfdp's layer names: the first convolution is the stem, every later one (with its
# batch norm) a block; fc1, fc2 and the classifier come last, as timm's pre_logits and head.
LAYER_GROUPS = {"stem": r"^(?:conv|bn)0$", "blocks": r"^(?:conv|bn)(\d+)$"}


def _add(name: str, batch_norm: bool) -> None:
    key = name + ("_bn" if batch_norm else "")

    def build(input_shape, num_classes: int, dropout: float) -> keras.Model:
        return vgg(input_shape, num_classes, dropout, PLANS[name], batch_norm, f"{key}_backbone")
    register(key, dropout=0.5, fixed_size=True, layer_groups=LAYER_GROUPS)(build)  # the adaptive pool reads the feature map's static size


for _name in PLANS:
    for _bn in (False, True):
        _add(_name, _bn)


# ---------------------------------------------------------------- torchvision's state dicts


def torchvision_layers(plan, batch_norm: bool) -> Callable[[str], str | None]:
    """torchvision's VGG `features.N` (conv, [bn], relu, ..., maxpool) and `classifier.{0,3,6}` → this file's layers."""
    names, index = {}, 0
    for i, item in enumerate(plan):
        if item == "M":
            index += 1
            continue
        names[f"features.{index}"] = f"conv{i}"
        if batch_norm:
            names[f"features.{index + 1}"] = f"bn{i}"
        index += 3 if batch_norm else 2
    names.update({"classifier.0": "fc1", "classifier.3": "fc2", "classifier.6": "logits"})
    return names.get


# the (height, width) of fc1's flattened input (the adaptive pool's 7x7), whose PyTorch order (C, H, W) is reordered
# to Keras' (H, W, C); the channels are the last convolution's (512 in every torchvision VGG)
FLATTENED_GRID = (7, 7)


def torchvision_values(params: dict[str, np.ndarray], layer: str) -> tuple[list[np.ndarray], list[str]]:
    """One torch module's tensors in Keras' layouts; the first fully connected layer's kernel also from PyTorch's
    channels-first flattening of the pooled 7x7 map to Keras' channels-last."""
    values, order = torch_module_values(params, layer)
    h, w = FLATTENED_GRID
    if layer == "fc1" and values[0].shape[0] % (h * w) == 0:
        c = values[0].shape[0] // (h * w)
        values[0] = params["weight"].reshape(-1, c, h, w).transpose(2, 3, 1, 0).reshape(h * w * c, -1)
    return values, order


def torchvision_reader(plan, batch_norm: bool) -> Callable[..., Weights]:
    rename = torchvision_layers(plan, batch_norm)

    def read(tensors, model_cfg: ModelConfig, what: str) -> Weights:
        """torchvision's VGG state dict: its modules renamed to this file's layers."""
        return renamed_modules(torch_modules(tensors), rename, model_cfg, what, convert=torchvision_values)
    return read


for _name in PLANS:
    register_torch_layout(_name, origins=("torchvision",))(torchvision_reader(PLANS[_name], False))
    register_torch_layout(f"{_name}_bn", origins=("torchvision",))(torchvision_reader(PLANS[_name], True))
