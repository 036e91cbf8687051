"""ResNet-18/34/50 (v1.5) and ResNeXt-50 (32x4d) following torchvision, timm's ResNet-D, and ResNet-18 for small
images.

torchvision's layout: 7x7/2 stem and 3x3/2 max-pool, padded as PyTorch pads
them (symmetric, `kernel // 2`), convolutions without
bias, batch norm after every convolution, the stride on the 3x3 convolution of
a bottleneck (ResNet v1.5), a 1x1 projection shortcut where the shape changes.
Parameter counts equal torchvision's (ResNet-18 11,689,512; ResNet-34
21,797,672; ResNet-50 25,557,032; ResNeXt-50 32x4d 25,028,904 at 1,000
classes). `resnet50_v1_5` is the ResNet-50 of torchvision, timm and Model
Garden, the one the published recipes train; `resnet50` (keras.applications,
see keras_apps.py) is the original v1, with the stride on the first 1x1.

`drop_path` (stochastic depth, Huang et al. 2016) drops each block's residual
branch per sample during training, at a rate rising linearly from 0 at the
first block to `drop_path` at the last, as timm does.

ResNet-D (He et al. 2019, "Bag of Tricks"; timm's `resnet18d` ... `resnet152d`, whose `.ra2`/`.ra4` weights
are among timm's best ResNets): a deep stem of three 3x3 convolutions (32, 32, 64 wide; the first at stride 2) in
place of the 7x7, and projection shortcuts that average 2x2 windows at the block's stride before a stride-1 1x1
convolution (timm's `avg_down`: `AvgPool2d(2, ceil_mode=True, count_include_pad=False)`, which Keras' "same"
average pool equals: on an odd side both average the last window's one pixel alone).

`small_images=True` (CIFAR-style, `resnet18_small`): a 3x3 stride-1 stem and no
max-pool. At 28-32 px the ImageNet stem would shrink the image to 8 px before
the first block; this keeps full resolution in stage 1, as in He et al. 2016
(section 4.2) and the common CIFAR ports.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import keras
from keras import layers

from tfdp.config import ModelConfig
from tfdp.errors import UserError
from tfdp.models.registry import register
from tfdp.models.weights import (Weights, h5_groups, keras_hub_head, register_keras_hub_layout, register_torch_layout,
                                 renamed_modules, torch_modules)

BN = dict(momentum=0.9, epsilon=1e-5)
# timm's ResNet group_matcher (coarse=False) on tfdp's layer names: the stem, then one group per block.
LAYER_GROUPS = {"stem": r"^stem_", "blocks": r"^stage(\d+)_block(\d+)_"}


def conv_bn(x, filters: int, kernel: int, stride: int, name: str, relu: bool = True, groups: int = 1,
            pytorch_padding: bool = True):
    """Convolution, batch norm, [ReLU]. A strided convolution pads as PyTorch does (kernel // 2 on every side):
    "same" would pad one pixel less on the top and left of an even-sized input, shifting every window, and
    torchvision's weights would give other logits. `pytorch_padding=False` keeps Keras' "same" (resnet18_small,
    which has no torchvision counterpart, keeps the numerics its checkpoints and tests were made with)."""
    if stride > 1 and kernel > 1 and pytorch_padding:
        x = layers.ZeroPadding2D(kernel // 2, name=f"{name}_pad")(x)
    padded = stride > 1 and kernel > 1 and pytorch_padding
    x = layers.Conv2D(filters, kernel, strides=stride, padding="valid" if padded else "same", use_bias=False,
                      groups=groups, kernel_initializer="he_normal", name=f"{name}_conv")(x)
    x = layers.BatchNormalization(**BN, name=f"{name}_bn")(x)
    return layers.ReLU(name=f"{name}_relu")(x) if relu else x


def shortcut(x, filters: int, stride: int, name: str, avg_down: bool = False):
    """The block's input, or its projection where the shape changes: a strided 1x1 convolution, or (ResNet-D) a
    2x2 average at the stride and a 1x1 convolution."""
    if stride == 1 and x.shape[-1] == filters:
        return x
    if avg_down and stride > 1:
        x = layers.AveragePooling2D(2, strides=stride, padding="same", name=f"{name}_down_pool")(x)
        stride = 1
    return conv_bn(x, filters, 1, stride, f"{name}_down", relu=False)


@keras.saving.register_keras_serializable(package="tfdp")
class DropPath(layers.Layer):
    """Zeroes the whole input of a sample with probability `rate` in training, scaling the rest by 1/(1-rate)."""

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.rate = float(rate)
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, x, training=False):
        if not training or not self.rate:
            return x
        keep = 1.0 - self.rate
        shape = (keras.ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
        mask = keras.ops.floor(keep + keras.random.uniform(shape, seed=self.seed_generator, dtype=x.dtype))
        return drop_path(x, mask, self.rate)

    def get_config(self):
        return {**super().get_config(), "rate": self.rate}


def drop_path(x, mask, rate: float):
    """timm's drop_path for a given per-sample mask of 0s and 1s ([B, 1, ...]): x * (mask / keep), the mask
    scaled first as timm's `random_tensor.div_(keep_prob)` does, so the products round as timm's do."""
    return x * (mask / keras.ops.cast(1.0 - rate, x.dtype))


def residual(x, skip, name: str, drop_path: float):
    if drop_path:
        x = DropPath(drop_path, name=f"{name}_drop_path")(x)
    return layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([x, skip]))


def basic_block(x, filters: int, stride: int, name: str, drop_path: float = 0.0, pytorch_padding: bool = True,
                avg_down: bool = False):
    skip = shortcut(x, filters, stride, name, avg_down)
    x = conv_bn(x, filters, 3, stride, f"{name}_a", pytorch_padding=pytorch_padding)
    x = conv_bn(x, filters, 3, 1, f"{name}_b", relu=False)
    return residual(x, skip, name, drop_path)


def bottleneck(x, filters: int, stride: int, name: str, drop_path: float = 0.0, groups: int = 1,
               width_per_group: int = 64, avg_down: bool = False):
    width = int(filters * width_per_group / 64) * groups
    skip = shortcut(x, filters * 4, stride, name, avg_down)
    x = conv_bn(x, width, 1, 1, f"{name}_a")
    x = conv_bn(x, width, 3, stride, f"{name}_b", groups=groups)
    x = conv_bn(x, filters * 4, 1, 1, f"{name}_c", relu=False)
    return residual(x, skip, name, drop_path)


@dataclasses.dataclass(frozen=True)
class ResNetSpec:
    """What tells one ResNet from another: its block, the blocks per stage, its name, its stem, the block's
    own arguments (ResNeXt's groups and width, ResNet-D's average-pool shortcut), the stages' widths."""
    block: Callable
    depths: tuple[int, int, int, int]
    name: str
    small_images: bool = False
    block_kwargs: tuple[tuple[str, Any], ...] = ()
    deep_stem: int = 0   # ResNet-D: the deep stem's width (32: 3x3 convolutions 32, 32 and 64 wide); 0: the 7x7
    widths: tuple[int, int, int, int] = (64, 128, 256, 512)


def deep_stem(x, width: int):
    """ResNet-D's stem (timm's `stem_type='deep'`): 3x3 convolutions `width` (stride 2), `width` and 2 x `width` wide,
    each with batch norm and ReLU; the last is `stem_conv`/`stem_bn`, as the 7x7 stem's."""
    x = conv_bn(x, width, 3, 2, "stem_a")
    x = conv_bn(x, width, 3, 1, "stem_b")
    return conv_bn(x, 2 * width, 3, 1, "stem")


def resnet(input_shape, num_classes: int, dropout: float, spec: ResNetSpec, drop_path: float = 0.0) -> keras.Model:
    inputs = keras.Input(input_shape)
    if spec.small_images:
        x = conv_bn(inputs, 64, 3, 1, "stem")
    else:
        x = deep_stem(inputs, spec.deep_stem) if spec.deep_stem else conv_bn(inputs, 64, 7, 2, "stem")
        # PyTorch pads this max-pool by 1 on every side; zeros do as well as -inf after a ReLU.
        x = layers.ZeroPadding2D(1, name="stem_pool_pad")(x)
        x = layers.MaxPooling2D(3, strides=2, name="stem_pool")(x)
    blocks, index = sum(spec.depths), 0
    for stage, (filters, depth) in enumerate(zip(spec.widths, spec.depths), start=1):
        for i in range(depth):
            stride = 2 if stage > 1 and i == 0 else 1
            rate = drop_path * index / max(blocks - 1, 1)
            x = spec.block(x, filters, stride, f"stage{stage}_block{i + 1}", drop_path=rate,
                           **dict(spec.block_kwargs))
            index += 1
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    if dropout:
        x = layers.Dropout(dropout, name="dropout")(x)
    return keras.Model(inputs, layers.Dense(num_classes, name="logits")(x), name=spec.name)


@register("resnet18", drop_path=True, layer_groups=LAYER_GROUPS)
def resnet18(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
    return resnet(input_shape, num_classes, dropout, ResNetSpec(basic_block, (2, 2, 2, 2), "resnet18_backbone"),
                  drop_path)


@register("resnet34", drop_path=True, layer_groups=LAYER_GROUPS)
def resnet34(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
    return resnet(input_shape, num_classes, dropout, ResNetSpec(basic_block, (3, 4, 6, 3), "resnet34_backbone"),
                  drop_path)


@register("resnet50_v1_5", drop_path=True, layer_groups=LAYER_GROUPS)
def resnet50_v1_5(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
    return resnet(input_shape, num_classes, dropout,
                  ResNetSpec(bottleneck, (3, 4, 6, 3), "resnet50_v1_5_backbone"), drop_path)


@register("resnext50_32x4d", drop_path=True, layer_groups=LAYER_GROUPS)
def resnext50_32x4d(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
    spec = ResNetSpec(bottleneck, (3, 4, 6, 3), "resnext50_32x4d_backbone",
                      block_kwargs=(("groups", 32), ("width_per_group", 4)))
    return resnet(input_shape, num_classes, dropout, spec, drop_path)


# timm's ResNet-D: name → (block, blocks per stage)
RESNET_D = {"resnet18d": (basic_block, (2, 2, 2, 2)), "resnet34d": (basic_block, (3, 4, 6, 3)),
            "resnet50d": (bottleneck, (3, 4, 6, 3)), "resnet101d": (bottleneck, (3, 4, 23, 3)),
            "resnet152d": (bottleneck, (3, 8, 36, 3))}


def resnet_d(name: str) -> ResNetSpec:
    block, depths = RESNET_D[name]
    return ResNetSpec(block, depths, f"{name}_backbone", block_kwargs=(("avg_down", True),), deep_stem=32)


def _register_resnet_d(name: str) -> None:
    def build(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
        return resnet(input_shape, num_classes, dropout, resnet_d(name), drop_path)
    build.__name__ = name
    register(name, drop_path=True, layer_groups=LAYER_GROUPS)(build)


for _name in RESNET_D:
    _register_resnet_d(_name)


# ---------------------------------------------------------------- torchvision's and timm's state dicts


def torchvision_layer(key: str) -> str | None:
    """torchvision's (and timm's) ResNet module names → this file's layers."""
    fixed = {"conv1": "stem_conv", "bn1": "stem_bn", "fc": "logits"}
    if key in fixed:
        return fixed[key]
    m = re.fullmatch(r"layer(\d)\.(\d+)\.(conv|bn)(\d)", key)
    if m:
        return f"stage{m[1]}_block{int(m[2]) + 1}_{'abc'[int(m[4]) - 1]}_{m[3]}"
    m = re.fullmatch(r"layer(\d)\.(\d+)\.downsample\.([01])", key)
    if m:
        return f"stage{m[1]}_block{int(m[2]) + 1}_down_{('conv', 'bn')[int(m[3])]}"
    return None


def resnet_d_layer(key: str) -> str | None:
    """timm's ResNet-D module names → this file's layers: the deep stem `conv1.0`/`.1`, `.3`/`.4`, `.6` and
    `bn1`, the average-pool shortcut's `downsample.1` (convolution) and `.2` (batch norm); the rest as torchvision's."""
    fixed = {"conv1.0": "stem_a_conv", "conv1.1": "stem_a_bn", "conv1.3": "stem_b_conv", "conv1.4": "stem_b_bn",
             "conv1.6": "stem_conv"}
    if key in fixed:
        return fixed[key]
    m = re.fullmatch(r"layer(\d)\.(\d+)\.downsample\.([12])", key)
    if m:
        return f"stage{m[1]}_block{int(m[2]) + 1}_down_{('conv', 'bn')[int(m[3]) - 1]}"
    return None if key == "conv1" or re.fullmatch(r"layer\d\.\d+\.downsample\.0", key) else torchvision_layer(key)


@register_torch_layout("resnet18", "resnet34", "resnet50_v1_5", "resnext50_32x4d", origins=("torchvision", "timm"))
def torchvision_resnet(tensors, model_cfg: ModelConfig, what: str) -> Weights:
    """torchvision's (and timm's) ResNet state dict: its modules renamed to this file's layers."""
    return renamed_modules(torch_modules(tensors), torchvision_layer, model_cfg, what)


@register_torch_layout(*RESNET_D, origins=("timm",))
def timm_resnet_d(tensors, model_cfg: ModelConfig, what: str) -> Weights:
    """timm's ResNet-D state dict: torchvision's names but for the deep stem and the average-pool shortcut."""
    return renamed_modules(torch_modules(tensors), resnet_d_layer, model_cfg, what)


@register("resnet18_small", min_size=8, drop_path=True, layer_groups=LAYER_GROUPS)
def resnet18_small(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
    spec = ResNetSpec(basic_block, (2, 2, 2, 2), "resnet18_small_backbone", small_images=True,
                      block_kwargs=(("pytorch_padding", False),))
    return resnet(input_shape, num_classes, dropout, spec, drop_path)


@register("resnet10_small", min_size=8, drop_path=True, layer_groups=LAYER_GROUPS)
def resnet10_small(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
    spec = ResNetSpec(basic_block, (1, 1, 1, 1), "resnet10_small_backbone", small_images=True,
                      block_kwargs=(("pytorch_padding", False),))
    return resnet(input_shape, num_classes, dropout, spec, drop_path)


# ---------------------------------------------------------------- weights: keras-hub presets

# The models a keras-hub ResNetBackbone preset fits, by the two settings that tell keras-hub's ResNets apart (its
# presets are timm's ResNets, converted by keras_hub/src/utils/timm/convert_resnet.py: v1.5, torchvision's layout).
KERAS_HUB_RESNETS = {"resnet18": ("basic_block", [2, 2, 2, 2]), "resnet34": ("basic_block", [3, 4, 6, 3]),
                     "resnet50_v1_5": ("bottleneck_block", [3, 4, 6, 3])}
# ... and the ResNetBackbone settings all of them share (resnet_vd_* presets have a 3-convolution stem and
# bottleneck_block_vd, resnet_v2_* pre-activation).
KERAS_HUB_RESNET_FIXED = {"use_pre_activation": False, "input_conv_filters": [64], "input_conv_kernel_sizes": [7],
                          "stackwise_num_filters": [64, 128, 256, 512], "stackwise_num_strides": [1, 2, 2, 2]}


def keras_hub_resnet_settings(name: str) -> dict:
    block_type, blocks = KERAS_HUB_RESNETS[name]
    return {**KERAS_HUB_RESNET_FIXED, "block_type": block_type, "stackwise_num_blocks": blocks}


def check_keras_hub_resnet(config: dict, model_cfg: ModelConfig, what: str) -> None:
    """The preset's backbone is the registry model's architecture, or one line naming the setting that is not
    (and the model it is, where tfdp has it)."""
    if model_cfg.name not in KERAS_HUB_RESNETS:
        raise UserError(f"model.init_from: {what} is a keras-hub ResNet; it fits {', '.join(KERAS_HUB_RESNETS)} "
                        f"(torchvision's layout), not model '{model_cfg.name}'")
    for key, want in keras_hub_resnet_settings(model_cfg.name).items():
        if config.get(key) != want:
            fits = [name for name in KERAS_HUB_RESNETS if all(config.get(k) == v for k, v in
                                                              keras_hub_resnet_settings(name).items())]
            raise UserError(f"model.init_from: {what} does not fit model '{model_cfg.name}': its ResNetBackbone has "
                            f"{key}={config.get(key)}, tfdp's {model_cfg.name} {want}"
                            + (f" (set model.name: {fits[0]})" if fits else ""))


def keras_hub_resnet_layer(name: str) -> str | None:
    """keras-hub ResNetBackbone's layer → tfdp's: conv1_conv → stem_conv, stack0_block1_2_bn → stage1_block2_b_bn,
    stack1_block0_0_conv (the projection shortcut) → stage2_block1_down_conv."""
    if name in ("conv1_conv", "conv1_bn"):
        return "stem_" + name[len("conv1_"):]
    m = re.fullmatch(r"stack(\d)_block(\d+)_([0-3])_(conv|bn)", name)
    if m is None:
        return None
    part = "down" if m[3] == "0" else "abc"[int(m[3]) - 1]
    return f"stage{int(m[1]) + 1}_block{int(m[2]) + 1}_{part}_{m[4]}"


@register_keras_hub_layout("ResNetBackbone", models=KERAS_HUB_RESNETS)
def keras_hub_resnet(preset: str, backbone: dict, task: dict | None, model_cfg: ModelConfig, what: str) -> Weights:
    """A keras-hub ResNet preset (ResNetBackbone, with ResNetImageClassifier's head when it holds the task) as
    `Weights`: its values are in Keras' layouts already, so only the layer names change."""
    check_keras_hub_resnet(backbone.get("config", {}), model_cfg, what)
    if task is not None and (pooling := task.get("config", {}).get("pooling", "avg")) != "avg":
        raise UserError(f"model.init_from: {what} does not fit model '{model_cfg.name}': its classifier pools with "
                        f"pooling={pooling!r}; tfdp's ResNets average")
    values, names = {}, {}
    for group, (layer, arrays) in h5_groups(os.path.join(preset, "model.weights.h5")).items():
        if not arrays:   # layers without variables (padding, activations) and the model itself
            continue
        ours = keras_hub_resnet_layer(layer)
        if ours is None:
            raise UserError(f"model.init_from: {what} does not fit model '{model_cfg.name}': its layer {layer} "
                            f"has no place in it")
        values[ours], names[ours] = arrays, [f"{group}/vars/{i} ({layer})" for i in range(len(arrays))]
    if task is not None and (head := keras_hub_head(preset)):
        values["logits"], names["logits"] = head
    return Weights(f"{what} (keras-hub ResNet preset)", values, names)
