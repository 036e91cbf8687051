"""ResNet-18/34 and ResNeXt-50 (32x4d) following torchvision, and ResNet-18 for small images.

torchvision's layout: 7x7/2 stem and 3x3/2 max-pool, convolutions without
bias, batch norm after every convolution, the stride on the 3x3 convolution of
a bottleneck (ResNet v1.5), a 1x1 projection shortcut where the shape changes.
Parameter counts equal torchvision's (ResNet-18 11,689,512; ResNet-34
21,797,672; ResNeXt-50 32x4d 25,028,904 at 1,000 classes). ResNet-50/101/152
come from keras.applications (see keras_apps.py).

`small_images=True` (CIFAR-style, `resnet18_small`): a 3x3 stride-1 stem and no
max-pool. At 28-32 px the ImageNet stem would shrink the image to 8 px before
the first block; this keeps full resolution in stage 1, as in He et al. 2016
(section 4.2) and the common CIFAR ports.
"""

from __future__ import annotations

import keras
from keras import layers

from tfdp.models.registry import register

BN = dict(momentum=0.9, epsilon=1e-5)


def conv_bn(x, filters: int, kernel: int, stride: int, name: str, relu: bool = True, groups: int = 1):
    x = layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False, groups=groups,
                      kernel_initializer="he_normal", name=f"{name}_conv")(x)
    x = layers.BatchNormalization(**BN, name=f"{name}_bn")(x)
    return layers.ReLU(name=f"{name}_relu")(x) if relu else x


def shortcut(x, filters: int, stride: int, name: str):
    if stride == 1 and x.shape[-1] == filters:
        return x
    return conv_bn(x, filters, 1, stride, f"{name}_down", relu=False)


def basic_block(x, filters: int, stride: int, name: str):
    skip = shortcut(x, filters, stride, name)
    x = conv_bn(x, filters, 3, stride, f"{name}_a")
    x = conv_bn(x, filters, 3, 1, f"{name}_b", relu=False)
    return layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([x, skip]))


def bottleneck(x, filters: int, stride: int, name: str, groups: int = 1, width_per_group: int = 64):
    width = int(filters * width_per_group / 64) * groups
    skip = shortcut(x, filters * 4, stride, name)
    x = conv_bn(x, width, 1, 1, f"{name}_a")
    x = conv_bn(x, width, 3, stride, f"{name}_b", groups=groups)
    x = conv_bn(x, filters * 4, 1, 1, f"{name}_c", relu=False)
    return layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([x, skip]))


def resnet(input_shape, num_classes: int, dropout: float, block, depths, name: str, small_images: bool = False,
           **block_kwargs) -> keras.Model:
    inputs = keras.Input(input_shape)
    if small_images:
        x = conv_bn(inputs, 64, 3, 1, "stem")
    else:
        x = conv_bn(inputs, 64, 7, 2, "stem")
        x = layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool")(x)
    for stage, (filters, depth) in enumerate(zip((64, 128, 256, 512), depths), start=1):
        for i in range(depth):
            stride = 2 if stage > 1 and i == 0 else 1
            x = block(x, filters, stride, f"stage{stage}_block{i + 1}", **block_kwargs)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    if dropout:
        x = layers.Dropout(dropout, name="dropout")(x)
    return keras.Model(inputs, layers.Dense(num_classes, name="logits")(x), name=name)


@register("resnet18")
def resnet18(input_shape, num_classes: int, dropout: float) -> keras.Model:
    return resnet(input_shape, num_classes, dropout, basic_block, (2, 2, 2, 2), "resnet18_backbone")


@register("resnet34")
def resnet34(input_shape, num_classes: int, dropout: float) -> keras.Model:
    return resnet(input_shape, num_classes, dropout, basic_block, (3, 4, 6, 3), "resnet34_backbone")


@register("resnext50_32x4d")
def resnext50_32x4d(input_shape, num_classes: int, dropout: float) -> keras.Model:
    return resnet(input_shape, num_classes, dropout, bottleneck, (3, 4, 6, 3), "resnext50_32x4d_backbone",
                  groups=32, width_per_group=4)


@register("resnet18_small", min_size=8)
def resnet18_small(input_shape, num_classes: int, dropout: float) -> keras.Model:
    return resnet(input_shape, num_classes, dropout, basic_block, (2, 2, 2, 2), "resnet18_small_backbone",
                  small_images=True)
