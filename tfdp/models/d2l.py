"""d2l's ResNet-18 (Dive into Deep Learning, section 13.6, "Concise Implementation for Multiple GPUs").

Built as the book builds it (its PyTorch `resnet18(num_classes, in_channels=1)`
and `d2l.Residual`), so a run of `configs/fashion_mnist_d2l.yaml` trains the
network whose accuracy the book's table gives:

- the stem: a 3x3 stride-1 convolution (64, padding 1), batch norm, ReLU; no
  max-pool (the book's change from section 8.6 for 28 px images);
- four stages of two `Residual` blocks, 64, 128, 256, 512 wide; the first block
  of stages 2-4 halves the side with stride 2 and a 1x1 stride-2 convolution on
  its shortcut (no batch norm on it); every other shortcut is the identity;
- a block: 3x3 convolution, batch norm, ReLU, 3x3 convolution, batch norm, the
  shortcut added, ReLU. Every convolution has a bias (torch's `nn.Conv2d`
  default), padded 1 on every side as PyTorch pads (28 -> 14 -> 7 -> 4 px);
- global average pooling and one dense layer.

Convolution and dense kernels are drawn from N(0, 0.01^2), the book's
`init_weights` (MXNet's `init.Normal(sigma=0.01)`); biases start at zero.
Batch norm is torch's: epsilon 1e-5, momentum 0.1 (0.9 in Keras' sense).

The book's network reads one channel. tfdp's pipeline feeds three (a
greyscale IDX image is replicated into them, `tfdp.data.layouts.idx`), so the
model reads the first of them: its stem has the book's 3x3x1x64 kernel.
Trainable parameters: 11,175,818 at 10 classes, as the book's PyTorch network
(`tests/models/test_d2l.py`).
"""

from __future__ import annotations

import keras
from keras import layers

from tfdp.models.registry import register
from tfdp.models.resnet import LAYER_GROUPS

BN = dict(momentum=0.9, epsilon=1e-5)   # torch's BatchNorm2d defaults
INIT_STD = 0.01   # the book's init_weights: nn.init.normal_(weight, std=0.01) on Conv2d and Linear
WIDTHS = (64, 128, 256, 512)
BLOCKS_PER_STAGE = 2


def book_init() -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(mean=0.0, stddev=INIT_STD)


@keras.saving.register_keras_serializable(package="tfdp")
class FirstChannel(keras.layers.Layer):
    """[..., channels] -> [..., 1]: the first channel, all a greyscale image replicated to three holds."""

    def call(self, inputs):
        return inputs[..., :1]

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], 1)


def conv(x, filters: int, kernel: int, stride: int, name: str):
    """`nn.Conv2d(filters, kernel, stride, padding=kernel // 2)`: padded on every side as PyTorch pads."""
    if kernel > 1:
        x = layers.ZeroPadding2D(kernel // 2, name=f"{name}_pad")(x)
    return layers.Conv2D(filters, kernel, strides=stride, padding="valid", use_bias=True,
                         kernel_initializer=book_init(), bias_initializer="zeros", name=name)(x)


def residual(x, filters: int, stride: int, name: str):
    """d2l's `Residual(filters, use_1x1conv=stride > 1, strides=stride)`."""
    y = conv(x, filters, 3, stride, f"{name}_conv1")
    y = layers.ReLU(name=f"{name}_relu1")(layers.BatchNormalization(**BN, name=f"{name}_bn1")(y))
    y = conv(y, filters, 3, 1, f"{name}_conv2")
    y = layers.BatchNormalization(**BN, name=f"{name}_bn2")(y)
    if stride > 1:
        x = conv(x, filters, 1, stride, f"{name}_conv3")
    return layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([y, x]))


@register("resnet18_d2l", min_size=8, layer_groups=LAYER_GROUPS)
def resnet18_d2l(input_shape, num_classes: int, dropout: float) -> keras.Model:
    inputs = keras.Input(input_shape)
    x = FirstChannel(name="stem_grey")(inputs)
    x = conv(x, WIDTHS[0], 3, 1, "stem_conv")
    x = layers.ReLU(name="stem_relu")(layers.BatchNormalization(**BN, name="stem_bn")(x))
    for stage, filters in enumerate(WIDTHS, start=1):
        for block in range(1, BLOCKS_PER_STAGE + 1):
            stride = 2 if stage > 1 and block == 1 else 1
            x = residual(x, filters, stride, f"stage{stage}_block{block}")
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    if dropout:
        x = layers.Dropout(dropout, name="dropout")(x)
    logits = layers.Dense(num_classes, kernel_initializer=book_init(), bias_initializer="zeros", name="logits")(x)
    return keras.Model(inputs, logits, name="resnet18_d2l_backbone")
