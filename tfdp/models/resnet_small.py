"""ResNet-18 for small images (CIFAR-style): 3x3 stride-1 stem, no max-pool.

At 28-32 px the ImageNet stem (7x7 stride 2 + max-pool) would shrink the
image to 8 px before the first block; this variant keeps full resolution in
stage 1, as in He et al. 2016 (section 4.2) and the common CIFAR ports.
"""

from __future__ import annotations

import keras
from keras import layers

from tfdp.models import register

BN = dict(momentum=0.9, epsilon=1e-5)


def conv_bn(x, filters: int, kernel: int, stride: int, name: str, relu: bool = True):
    x = layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False,
                      kernel_initializer="he_normal", name=f"{name}_conv")(x)
    x = layers.BatchNormalization(**BN, name=f"{name}_bn")(x)
    return layers.ReLU(name=f"{name}_relu")(x) if relu else x


def basic_block(x, filters: int, stride: int, name: str):
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = conv_bn(x, filters, 1, stride, f"{name}_down", relu=False)
    x = conv_bn(x, filters, 3, stride, f"{name}_a")
    x = conv_bn(x, filters, 3, 1, f"{name}_b", relu=False)
    return layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([x, shortcut]))


@register("resnet18_small", min_size=8)
def resnet18_small(input_shape, num_classes: int, dropout: float = 0.0) -> keras.Model:
    inputs = keras.Input(input_shape)
    x = conv_bn(inputs, 64, 3, 1, "stem")
    for stage, (filters, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)], start=1):
        x = basic_block(x, filters, stride, f"stage{stage}_block1")
        x = basic_block(x, filters, 1, f"stage{stage}_block2")
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    if dropout:
        x = layers.Dropout(dropout, name="dropout")(x)
    logits = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, logits, name="resnet18_small_backbone")
