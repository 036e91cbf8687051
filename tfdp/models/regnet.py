"""RegNetX and RegNetY (Radosavovic et al. 2020, "Designing Network Design Spaces"), as timm builds them, under
timm's names and with timm's layer names, so its weights load by name (`regnety_040.ra3_in1k`,
`regnety_160.swag_ft_in1k`, `regnety_320.seer_ft_in1k`, ...).

A stem (a 3x3 stride-2 convolution 32 wide, batch norm, ReLU), four stages of bottleneck blocks whose first block
halves the resolution, global average pooling and the classifier. A block: 1x1 convolution, 3x3 grouped
convolution (the stride; groups of a fixed width per stage), for RegNetY a squeeze-excite reduced to a quarter of
the block's input width, 1x1 convolution without ReLU, then the residual (a strided 1x1 projection where the shape
changes) and ReLU; every convolution without bias and with batch norm (epsilon 1e-5), strided ones padded as
PyTorch pads (resnet.conv_bn). `model.drop_path` drops each block's residual branch, rising linearly over the
blocks, as timm's `drop_path_rate`.

The stage depths, widths and group widths are those timm derives from each model's (w0, wa, wm, depth, group
size) parameters (`generate_regnet`, then its adjustment of widths to the groups): read from timm 1.0.31 and
written out below. torchvision's RegNets are the same architecture in another layout (`torchvision_as_timm`); 11
of its sizes have timm's tables (`regnet_y_400mf` is `regnety_004`, ...: docs/pretrained-weights.md), its
`regnet_y_800mf`, `_y_8gf` and `_x_400mf` widths of their own, which the shapes refuse.
"""

from __future__ import annotations

import dataclasses
import re

import keras
from keras import layers

from tfdp.config import ModelConfig
from tfdp.models.registry import register
from tfdp.models.resnet import conv_bn, residual
from tfdp.models.weights import Weights, register_torch_layout, renamed_modules, torch_modules

HEAD = ("head_fc",)
# timm's RegNet.group_matcher(coarse=False): the stem, one group per block; the classifier (unmatched) last.
LAYER_GROUPS = {"stem": r"^stem_", "blocks": r"^s(\d+)_b(\d+)_"}
SE_RATIO = 0.25


@dataclasses.dataclass(frozen=True)
class RegNetSpec:
    """Blocks, output width and group width of each of the four stages; RegNetY's squeeze-excite."""
    depths: tuple[int, ...]
    widths: tuple[int, ...]
    group_widths: tuple[int, ...]
    se: bool
    stem_width: int = 32


def squeeze_excite(x, reduced: int, name: str):
    """timm's SEModule: the channels' means through a 1x1 convolution to `reduced`, ReLU, back, a sigmoid gate."""
    s = layers.GlobalAveragePooling2D(keepdims=True, name=f"{name}_pool")(x)
    s = layers.Conv2D(reduced, 1, activation="relu", name=f"{name}_fc1")(s)
    s = layers.Conv2D(x.shape[-1], 1, activation="sigmoid", name=f"{name}_fc2")(s)
    return layers.Multiply(name=f"{name}_gate")([x, s])


def block(x, width: int, stride: int, group_width: int, se: bool, name: str, drop_path: float):
    """timm's RegNet Bottleneck (bottleneck ratio 1)."""
    skip = x if stride == 1 and x.shape[-1] == width else conv_bn(x, width, 1, stride, f"{name}_downsample",
                                                                  relu=False)
    h = conv_bn(x, width, 1, 1, f"{name}_conv1")
    h = conv_bn(h, width, 3, stride, f"{name}_conv2", groups=width // group_width)
    if se:
        h = squeeze_excite(h, int(round(x.shape[-1] * SE_RATIO)), f"{name}_se")
    h = conv_bn(h, width, 1, 1, f"{name}_conv3", relu=False)
    return residual(h, skip, name, drop_path)


def regnet(input_shape, num_classes: int, dropout: float, spec: RegNetSpec, name: str,
           drop_path: float = 0.0) -> keras.Model:
    inputs = keras.Input(input_shape)
    x = conv_bn(inputs, spec.stem_width, 3, 2, "stem")
    blocks, index = sum(spec.depths), 0
    for stage, (depth, width, group_width) in enumerate(zip(spec.depths, spec.widths, spec.group_widths), start=1):
        for i in range(depth):
            x = block(x, width, 2 if i == 0 else 1, group_width, spec.se, f"s{stage}_b{i + 1}",
                      drop_path * index / max(blocks - 1, 1))
            index += 1
    x = layers.GlobalAveragePooling2D(name="head_pool")(x)
    if dropout:
        x = layers.Dropout(dropout, name="head_drop")(x)
    return keras.Model(inputs, layers.Dense(num_classes, name="head_fc")(x), name=f"{name}_backbone")


# timm's model name → (blocks, width, group width) of each stage
STAGES = {
    "regnetx_002": ((1, 1, 4, 7), (24, 56, 152, 368), (8, 8, 8, 8)),
    "regnetx_004": ((1, 2, 7, 12), (32, 64, 160, 384), (16, 16, 16, 16)),
    "regnetx_006": ((1, 3, 5, 7), (48, 96, 240, 528), (24, 24, 24, 24)),
    "regnetx_008": ((1, 3, 7, 5), (64, 128, 288, 672), (16, 16, 16, 16)),
    "regnetx_016": ((2, 4, 10, 2), (72, 168, 408, 912), (24, 24, 24, 24)),
    "regnetx_032": ((2, 6, 15, 2), (96, 192, 432, 1008), (48, 48, 48, 48)),
    "regnetx_040": ((2, 5, 14, 2), (80, 240, 560, 1360), (40, 40, 40, 40)),
    "regnetx_064": ((2, 4, 10, 1), (168, 392, 784, 1624), (56, 56, 56, 56)),
    "regnetx_080": ((2, 5, 15, 1), (80, 240, 720, 1920), (80, 120, 120, 120)),
    "regnetx_120": ((2, 5, 11, 1), (224, 448, 896, 2240), (112, 112, 112, 112)),
    "regnetx_160": ((2, 6, 13, 1), (256, 512, 896, 2048), (128, 128, 128, 128)),
    "regnetx_320": ((2, 7, 13, 1), (336, 672, 1344, 2520), (168, 168, 168, 168)),
    "regnety_002": ((1, 1, 4, 7), (24, 56, 152, 368), (8, 8, 8, 8)),
    "regnety_004": ((1, 3, 6, 6), (48, 104, 208, 440), (8, 8, 8, 8)),
    "regnety_006": ((1, 3, 7, 4), (48, 112, 256, 608), (16, 16, 16, 16)),
    "regnety_008": ((1, 3, 8, 2), (64, 128, 320, 768), (16, 16, 16, 16)),
    "regnety_016": ((2, 6, 17, 2), (48, 120, 336, 888), (24, 24, 24, 24)),
    "regnety_032": ((2, 5, 13, 1), (72, 216, 576, 1512), (24, 24, 24, 24)),
    "regnety_040": ((2, 6, 12, 2), (128, 192, 512, 1088), (64, 64, 64, 64)),
    "regnety_064": ((2, 7, 14, 2), (144, 288, 576, 1296), (72, 72, 72, 72)),
    "regnety_080": ((2, 4, 10, 1), (168, 448, 896, 2016), (56, 56, 56, 56)),
    "regnety_120": ((2, 5, 11, 1), (224, 448, 896, 2240), (112, 112, 112, 112)),
    "regnety_160": ((2, 4, 11, 1), (224, 448, 1232, 3024), (112, 112, 112, 112)),
    "regnety_320": ((2, 5, 12, 1), (232, 696, 1392, 3712), (232, 232, 232, 232)),
}
SPECS = {name: RegNetSpec(*stages, se=name.startswith("regnety")) for name, stages in STAGES.items()}


def _register(name: str, spec: RegNetSpec) -> None:
    def build(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
        return regnet(input_shape, num_classes, dropout, spec, name, drop_path)
    build.__name__ = name
    register(name, drop_path=True, head=HEAD, layer_groups=LAYER_GROUPS)(build)


for _name, _spec in SPECS.items():
    _register(_name, _spec)


@register_torch_layout(*SPECS, origins=("timm", "torchvision"))
def timm_regnet(tensors, model_cfg: ModelConfig, what: str) -> Weights:
    """timm's RegNet state dict: each module is the layer of its name with `_` for `.` (`s2.b1.conv2.conv` →
    `s2_b1_conv2_conv`, `head.fc` → `head_fc`); torchvision's in timm's names first (`torchvision_as_timm`)."""
    modules = torch_modules(tensors)
    torchvision = "stem.0" in modules

    def layer(module: str) -> str | None:
        timm_name = torchvision_as_timm(module) if torchvision else module
        return timm_name.replace(".", "_") if timm_name else None
    return renamed_modules(modules, layer, model_cfg, what)


# torchvision's RegNet: `stem.0`/`.1` the stem's convolution and batch norm, `trunk_output.blockS.blockS-B` stage S's
# block B (from 0), its `proj` the strided shortcut, `f.a`, `f.b`, `f.c` the three convolutions (`.0`, their batch
# norms `.1`), `f.se.fc1`/`fc2` the squeeze-excite; `fc` the classifier
TORCHVISION_TOP = {"stem.0": "stem.conv", "stem.1": "stem.bn", "fc": "head.fc"}
TORCHVISION_BLOCK = {"proj.0": "downsample.conv", "proj.1": "downsample.bn", "f.a.0": "conv1.conv", "f.a.1": "conv1.bn",
                     "f.b.0": "conv2.conv", "f.b.1": "conv2.bn", "f.se.fc1": "se.fc1", "f.se.fc2": "se.fc2",
                     "f.c.0": "conv3.conv", "f.c.1": "conv3.bn"}
_TORCHVISION_BLOCK = re.compile(r"trunk_output\.block(\d)\.block\d-(\d+)\.(.+)")


def torchvision_as_timm(module: str) -> str | None:
    """A torchvision RegNet module's timm name (`trunk_output.block2.block2-0.f.b.0` → `s2.b1.conv2.conv`); None
    where it has none."""
    if found := _TORCHVISION_BLOCK.fullmatch(module):
        part = TORCHVISION_BLOCK.get(found[3])
        return f"s{found[1]}.b{int(found[2]) + 1}.{part}" if part else None
    return TORCHVISION_TOP.get(module)
