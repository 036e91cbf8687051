"""Architectures taken as they are from `keras.applications` (weights=None: nothing downloads).

Each keeps its upstream classifier head (with `classes=num_classes` and raw
logits), so parameter counts equal keras.applications' own. Their built-in
input rescaling is left out: tfdp normalises on the device already. MobileNetV3
and EfficientNetV2 have a switch for it (`include_preprocessing`); EfficientNet
(V1) has none, so tfdp keeps its graph from the stem on (`from_the_stem`).

Dropout before the classifier: MobileNetV3 takes it as `dropout_rate`; the
EfficientNets build a `top_dropout` layer (V2: rate 0.2; V1: 0.2 to 0.5 from
B0 to B7), whose rate is set after construction (Dropout reads it at call
time); the others have none, and get one inserted before their final Dense
layer when a rate above 0 is configured. The registry's default is each
model's upstream one.

Stochastic depth: the EfficientNets take `model.drop_path` as Keras'
`drop_connect_rate` (`scaled`), 0 unless set, as for every other model of the
zoo; Keras' own wrappers fix it at 0.2.
"""

from __future__ import annotations

import re
from typing import Callable

import keras
import numpy as np
from keras.src.applications import efficientnet, efficientnet_v2

from tfdp.config import ModelConfig, pretrained
from tfdp.errors import UserError
from tfdp.models.registry import WITH_PREVIOUS, register
from tfdp.models import keras_imagenet  # noqa: F401  (registers `init_from: imagenet`: Keras' own files of these models)
from tfdp.models.weights import (Weights, add_origins, register_torch_layout, renamed_modules, torch_module_values,
                                 torch_modules)


def _app(constructor, dropout_arg: str | None = None, **extra):
    def build(input_shape, num_classes: int, dropout: float, **depth) -> keras.Model:
        kwargs = {**extra, dropout_arg: dropout} if dropout_arg else extra
        model = constructor(weights=None, include_top=True, input_shape=input_shape, classes=num_classes,
                            classifier_activation=None, **kwargs, **depth)
        return model if dropout_arg else _set_head_dropout(model, dropout)
    return build


def scaled(base, width: float, depth: float, size: int, name: str, **fixed):
    """keras.applications' EfficientNet or EfficientNetV2 builder (`base`) at one size of its family, taking
    tfdp's stochastic depth: `drop_path` is Keras' `drop_connect_rate` (block b of n drops at drop_path * b / n, as
    timm's `drop_path_rate` does), 0 unless given, where Keras' own wrappers (`EfficientNetB0`, ...) fix it at 0.2."""
    def build(drop_path: float = 0.0, **kwargs) -> keras.Model:
        return base(width, depth, size, drop_connect_rate=drop_path, name=name, **fixed, **kwargs)
    return build


def _set_head_dropout(model: keras.Model, rate: float) -> keras.Model:
    """Sets the rate of the Dropout layer feeding the final Dense layer, inserting one if there is none."""
    head, before = model.layers[-1], model.layers[-2]
    assert isinstance(head, keras.layers.Dense), head
    if isinstance(before, keras.layers.Dropout):
        before.rate = rate
        return model
    if not rate:
        return model
    x = keras.layers.Dropout(rate, name="top_dropout")(before.output)
    return keras.Model(model.inputs, head(x), name=model.name)


def from_the_stem(constructor):
    """keras.applications' EfficientNet (V1) without the `Rescaling(1/255)` and `Normalization` it always builds in
    front of its stem (`stem_conv_pad`): the same layers from there on, the input named as Keras names it."""
    def build(**kwargs) -> keras.Model:
        model = constructor(**kwargs)
        trimmed = keras.Model(model.get_layer("stem_conv_pad").input, model.output, name=model.name)
        trimmed.layers[0].name = "input_layer"   # Keras names the input of a graph cut out of another after a tensor
        return trimmed
    return build


def torch_padded(constructor):
    """timm's own (and torchvision's) EfficientNet, EfficientNetV2 and MobileNetV3 graphs (PyTorch-padded) from
    keras.applications': Keras pads a strided convolution "same" (on an even side one row and column fewer above
    and left than below and right), PyTorch's `padding=k // 2` pads k // 2 on every side, and torch's batch norm
    divides by sqrt(var + 1e-5) where Keras' adds 1e-3. All are layer settings, so the graph is Keras' rebuilt from
    its config with every `ZeroPadding2D` made symmetric (the larger of each pair on both sides), every strided
    "same" convolution given a symmetric `ZeroPadding2D` of its own (`{name}_pad`) and made "valid" (MobileNetV3's
    stem, EfficientNetV2's strided convolutions), and every batch norm torch's (`TORCH_BATCH_NORM`): the same
    layers, names and weights, whose outputs differ at every border and in every normalisation. (torch's momentum
    too, which timm trained these at: what `model.bn_momentum: auto` keeps when fine-tuning from its weights.)"""
    def build(**kwargs) -> keras.Model:
        config = constructor(**kwargs).get_config()
        layers = []
        for layer in config["layers"]:
            settings = layer["config"]
            if layer["class_name"] == "ZeroPadding2D":
                settings["padding"] = [[max(side)] * 2 for side in settings["padding"]]
            elif layer["class_name"] == "BatchNormalization":
                settings.update(TORCH_BATCH_NORM)
            elif settings.get("padding") == "same" and max(settings.get("strides", [1])) > 1:
                layers.append(symmetric_padding(layer))
            layers.append(layer)
        config["layers"] = layers
        return keras.Model.from_config(config)
    return build


def symmetric_padding(conv: dict) -> dict:
    """The config of a `ZeroPadding2D` padding k // 2 on every side in front of the strided "same" convolution `conv`
    (a functional model's layer config), which it rewires to read the padding's output and makes "valid"."""
    name = f"{conv['config']['name']}_pad"
    padding = keras.layers.ZeroPadding2D([[k // 2] * 2 for k in conv["config"]["kernel_size"]], name=name)
    pad = {"module": "keras.layers", "class_name": "ZeroPadding2D", "config": padding.get_config(),
           "registered_name": None, "name": name, "inbound_nodes": conv["inbound_nodes"]}
    source = conv["inbound_nodes"][0]["args"][0]["config"]
    batch, height, width, channels = source["shape"]
    grow = [2 * (k // 2) for k in conv["config"]["kernel_size"]]
    shape = [batch, height and height + grow[0], width and width + grow[1], channels]
    conv["inbound_nodes"] = [{"args": [{"class_name": "__keras_tensor__", "config": {
        "shape": shape, "dtype": source["dtype"], "keras_history": [name, 0, 0]}}], "kwargs": {}}]
    conv["config"]["padding"] = "valid"
    conv.pop("build_config", None)
    return pad


# torch's BatchNorm2d defaults in Keras' terms (its momentum 0.1 is the share of the new statistic)
TORCH_BATCH_NORM = {"epsilon": 1e-5, "momentum": 0.9}


def with_epsilon(values: list, epsilon: float) -> list:
    """A batch norm's Keras values (gamma, beta, moving mean, moving variance) trained with `epsilon`, for a graph of
    torch's (1e-5) that is to normalise as it did: (x - mean) / sqrt(var + epsilon) is the same with the difference
    added to the moving variance. Exact at the start; fine-tuning then normalises batches with 1e-5."""
    return [*values[:3], values[3] + (epsilon - TORCH_BATCH_NORM["epsilon"])]


# the batch-norm epsilon torchvision builds its MobileNetV3s, EfficientNet-B5, B6, B7 and EfficientNetV2s with
TORCHVISION_EPSILON = 1e-3
NO_PREPROCESSING = {"include_preprocessing": False}
# EfficientNet-B0 ... B7: width and depth coefficients, default size and classifier dropout, as keras.applications'
# wrappers (and the paper) set them
EFFICIENTNET = {"b0": (1.0, 1.0, 224, 0.2), "b1": (1.0, 1.1, 240, 0.2), "b2": (1.1, 1.2, 260, 0.3),
                "b3": (1.2, 1.4, 300, 0.3), "b4": (1.4, 1.8, 380, 0.4), "b5": (1.6, 2.2, 456, 0.4),
                "b6": (1.8, 2.6, 528, 0.5), "b7": (2.0, 3.1, 600, 0.5)}
# EfficientNetV2-B0 ... B3, S, M, L: width and depth coefficients and default size (classifier dropout 0.2)
EFFICIENTNET_V2 = {"b0": (1.0, 1.0, 224), "b1": (1.0, 1.1, 240), "b2": (1.1, 1.2, 260), "b3": (1.2, 1.4, 300),
                   "s": (1.0, 1.0, 384), "m": (1.0, 1.0, 480), "l": (1.0, 1.0, 480)}
# name → (constructor, its keyword for the classifier's dropout rate or None, other keywords, default dropout)
APPS = {
    "resnet50": (keras.applications.ResNet50, None, {}, 0.0),
    "resnet101": (keras.applications.ResNet101, None, {}, 0.0),
    "resnet152": (keras.applications.ResNet152, None, {}, 0.0),
    "inception_v3": (keras.applications.InceptionV3, None, {}, 0.0),
    "mobilenet_v2": (keras.applications.MobileNetV2, None, {}, 0.0),
    "mobilenet_v3_large": (keras.applications.MobileNetV3Large, "dropout_rate", NO_PREPROCESSING, 0.2),
    "mobilenet_v3_small": (keras.applications.MobileNetV3Small, "dropout_rate", NO_PREPROCESSING, 0.2),
    **{f"efficientnet_{v}": (from_the_stem(scaled(efficientnet.EfficientNet, width, depth, size, f"efficientnet{v}",
                                                  dropout_rate=rate)), None, {}, rate)
       for v, (width, depth, size, rate) in EFFICIENTNET.items()},
    **{f"efficientnetv2_{v}": (scaled(efficientnet_v2.EfficientNetV2, *spec, f"efficientnetv2-{v}"), None,
                               NO_PREPROCESSING, 0.2) for v, spec in EFFICIENTNET_V2.items()},
}
MIN_SIZE = {"inception_v3": 75}
# The classifier: a Dense `predictions` layer, or MobileNetV3's 1x1 convolution `logits`.
HEAD = ("predictions", "logits")
# timm's ResNet grouping on keras.applications' names (conv1_*: the stem; convS_blockB_*: one group per block).
RESNET_GROUPS = {"stem": r"^conv1_", "blocks": r"^conv(\d+)_block(\d+)_"}
# timm's EfficientNet grouping (`group_matcher(coarse=False)`: the stem, one group per block, the head's convolution
# with the last block) on Keras' names (stem_*, block{S}{letter}_*, top_*), V1 and V2 alike.
EFFICIENTNET_GROUPS = {"stem": r"^stem_", "blocks": r"^block(\d+)([a-z])_", WITH_PREVIOUS: r"^top_"}
# timm's MobileNetV3 grouping (the stem, one group per block, the last 1x1 convolution's stage, the head: `conv_head`
# and the classifier, unmatched) on Keras' names (conv, conv_bn; expanded_conv_*, then expanded_conv_{i}_*; conv_1*)
MOBILENETV3_GROUPS = {"stem": r"^conv(?:_bn)?$", "blocks": r"^expanded_conv_(?:(\d+)_)?", "last": r"^conv_1(?:_bn)?$"}
LAYER_GROUPS = {"resnet50": RESNET_GROUPS, "resnet101": RESNET_GROUPS, "resnet152": RESNET_GROUPS,
                **{name: EFFICIENTNET_GROUPS for name in APPS if name.startswith("efficientnet")},
                **{name: MOBILENETV3_GROUPS for name in APPS if name.startswith("mobilenet_v3")}}

# timm's own EfficientNets (`efficientnet_b0` ... `b7`, padded as PyTorch pads), its and torchvision's MobileNetV3s and
# torchvision's EfficientNetV2-S, M and L: Keras' graph of the same size with PyTorch's padding and epsilon
# (`torch_padded`). No Keras file fits them, so they stay out of APPS (the models of `init_from: imagenet`).
TORCHVISION_V2 = ("efficientnetv2_s", "efficientnetv2_m", "efficientnetv2_l")
TORCH_PADDED = {f"{name}_torch": (torch_padded(constructor), dropout_arg, extra, dropout)
                for name, (constructor, dropout_arg, extra, dropout) in APPS.items()
                if name.startswith(("efficientnet_b", "mobilenet_v3")) or name in TORCHVISION_V2}

for _name, (_constructor, _dropout_arg, _extra, _dropout) in {**APPS, **TORCH_PADDED}.items():
    register(_name, min_size=MIN_SIZE.get(_name, 32), dropout=_dropout, head=HEAD,
             drop_path=_name.startswith("efficientnet"),   # Keras' drop_connect_rate (`scaled`)
             layer_groups=LAYER_GROUPS.get(_name.removesuffix("_torch")),
             batch_norm="torch" if _name in TORCH_PADDED else "keras")(_app(_constructor, _dropout_arg, **_extra))


# ---------------------------------------------------------------- timm's and torchvision's EfficientNets

# timm's module → keras.applications' EfficientNet (V1 and V2) layer. Block `blocks.S.B` is Keras' `block{S+1}{a+B}_`,
# its kind told by its modules: depthwise-separable (V1's first stage: `conv_dw`, `conv_pw`), inverted residual
# (`conv_pw`, `conv_dw`, `conv_pwl`), and V2's fused blocks, without expansion (`conv`) or with it (`conv_exp`).
EFFICIENTNET_TOP = {"conv_stem": "stem_conv", "bn1": "stem_bn", "conv_head": "top_conv", "bn2": "top_bn",
                    "classifier": "predictions"}
EFFICIENTNET_BLOCKS = {
    "separable": {"conv_dw": "dwconv", "bn1": "bn", "se.conv_reduce": "se_reduce", "se.conv_expand": "se_expand",
                  "conv_pw": "project_conv", "bn2": "project_bn"},
    "inverted": {"conv_pw": "expand_conv", "bn1": "expand_bn", "conv_dw": "dwconv", "bn2": "bn",
                 "se.conv_reduce": "se_reduce", "se.conv_expand": "se_expand", "conv_pwl": "project_conv",
                 "bn3": "project_bn"},
    "fused": {"conv": "project_conv", "bn1": "project_bn"},
    "fused_expanding": {"conv_exp": "expand_conv", "bn1": "expand_bn", "conv_pwl": "project_conv", "bn2": "project_bn"},
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(\d+)\.(.+)")


def block_kind(parts: set[str]) -> str:
    """A timm EfficientNet block's kind (`EFFICIENTNET_BLOCKS`) from the modules it holds."""
    if "conv_exp" in parts:
        return "fused_expanding"
    if "conv" in parts:
        return "fused"
    return "inverted" if "conv_pwl" in parts else "separable"


def builder_layers(modules, top: dict[str, str], block_layer: Callable) -> dict[str, str | None]:
    """Each module of a model of timm's efficientnet builder (EfficientNets, MobileNetV3s) → its Keras layer (None: no
    place): `top[module]` outside the blocks; in block `blocks.S.B`, `block_layer((S, B), parts, part)`, `parts` the
    modules that block holds (which tell its kind), `part` the module's name in it."""
    parts: dict[tuple[int, int], set[str]] = {}
    for module in modules:
        if found := _BLOCK.fullmatch(module):
            parts.setdefault((int(found[1]), int(found[2])), set()).add(found[3])
    layers = {}
    for module in modules:
        found = _BLOCK.fullmatch(module)
        block = (int(found[1]), int(found[2])) if found else None
        layers[module] = block_layer(block, parts, found[3]) if found else top.get(module)
    return layers


def efficientnet_layers(modules, depthwise: str) -> dict[str, str | None]:
    """Each timm EfficientNet module → its Keras layer (None: no place), `depthwise` the name Keras gives the
    depthwise convolution (V1 `dwconv`, V2 `dwconv2`): block `blocks.S.B` is Keras' `block{S+1}{a+B}_`."""
    def block_layer(block: tuple[int, int], parts: dict, part: str) -> str | None:
        stage, number = block
        name = EFFICIENTNET_BLOCKS[block_kind(parts[block])].get(part)
        name = depthwise if name == "dwconv" else name
        return f"block{stage + 1}{chr(ord('a') + number)}_{name}" if name and number < 26 else None
    return builder_layers(modules, EFFICIENTNET_TOP, block_layer)


# torchvision's EfficientNet (V1 and V2) in timm's names: `features.0` is the stem, `features.S` stage S's blocks, the
# last `features` the head's convolution; a block's modules are numbered in order (`block.I.0`/`.1`: a convolution and
# its batch norm, `block.I.fc1`/`.fc2`: squeeze-excite): V2's fused blocks one (without expansion) or two (with it),
# squeeze-excite blocks three (V1's without expansion) or four (with it).
TORCHVISION_BLOCKS = {
    1: {"0.0": "conv", "0.1": "bn1"},
    2: {"0.0": "conv_exp", "0.1": "bn1", "1.0": "conv_pwl", "1.1": "bn2"},
    3: {"0.0": "conv_dw", "0.1": "bn1", "1.fc1": "se.conv_reduce", "1.fc2": "se.conv_expand", "2.0": "conv_pw",
        "2.1": "bn2"},
    4: {"0.0": "conv_pw", "0.1": "bn1", "1.0": "conv_dw", "1.1": "bn2", "2.fc1": "se.conv_reduce",
        "2.fc2": "se.conv_expand", "3.0": "conv_pwl", "3.1": "bn3"},
}
TORCHVISION_STEM = "features.0.0"
_TORCHVISION_BLOCK = re.compile(r"features\.(\d+)\.(\d+)\.block\.(\d+)\.(.+)")
_TORCHVISION_CONV = re.compile(r"features\.(\d+)\.([01])")


def torchvision_as_timm(modules) -> dict[str, str]:
    """Each module of torchvision's EfficientNet → timm's name for it (itself where it has none, which then finds
    no layer)."""
    sizes: dict[tuple[str, str], int] = {}
    for module in modules:
        if found := _TORCHVISION_BLOCK.fullmatch(module):
            sizes[found[1], found[2]] = max(sizes.get((found[1], found[2]), 0), int(found[3]) + 1)
    names = {}
    for module in modules:
        if found := _TORCHVISION_BLOCK.fullmatch(module):
            part = TORCHVISION_BLOCKS.get(sizes[found[1], found[2]], {}).get(f"{found[3]}.{found[4]}")
            names[module] = f"blocks.{int(found[1]) - 1}.{found[2]}.{part}" if part else module
        elif found := _TORCHVISION_CONV.fullmatch(module):
            names[module] = (("conv_stem", "bn1") if found[1] == "0" else ("conv_head", "bn2"))[int(found[2])]
        else:
            names[module] = "classifier" if module == "classifier.1" else module
    return names


def other_padding(what: str, source: str, file_tf_padded: bool, model: str, counterpart: str) -> str:
    """The line for a weights file (`source`: what it is, "holds timm's efficientnet_b0") padded the other way than
    `model`, naming `counterpart`, the zoo model padded as it is, where there is one."""
    pads = ("TensorFlow", "PyTorch") if file_tf_padded else ("PyTorch", "TensorFlow")
    fix = (f"set model.name: {counterpart}" if counterpart in APPS or counterpart in TORCH_PADDED
           else "no tfdp model of its size is padded as it is")
    return (f"model.init_from: {what} {source}, padded as {pads[0]} pads; model '{model}' is padded as {pads[1]} "
            f"pads: {fix}")


def torchvision_refusal(model: str, what: str) -> str | None:
    """The line for torchvision's EfficientNet in a model its weights do not fit, else None: torchvision pads as
    PyTorch does (`efficientnet_b*_torch`)."""
    if model.endswith("_torch"):
        return None
    return other_padding(what, "is in torchvision's layout", False, model, f"{model}_torch")


# torchvision builds its EfficientNet-B5, B6 and B7 and its V2s with epsilon 1e-3 (B0-B4 with torch's 1e-5): read into
# `efficientnet_b5_torch` ... `b7_torch` and `efficientnetv2_*_torch` (epsilon 1e-5) with the difference folded in
TORCHVISION_EPSILON_1E3 = {*(f"efficientnet_b{v}_torch" for v in (5, 6, 7)), *(f"{v}_torch" for v in TORCHVISION_V2)}


# timm's EfficientNet architectures: its TensorFlow ports (`tf_`, padded "same": Keras' graph, tfdp's `efficientnet_b*`
# and `efficientnetv2_*`) and its own (padded as PyTorch pads: tfdp's `efficientnet_b*_torch`)
TIMM_EFFICIENTNET = re.compile(r"(tf_)?(efficientnet(?:v2)?_(?:b\d|s|m|l|xl))")


def padding_refusal(architecture: str, model: str, what: str) -> str | None:
    """The line for a timm EfficientNet file whose padding is not the zoo model's, else None. The names and shapes
    of `efficientnet_b0` and `tf_efficientnet_b0` are the same, but in the other graph the weights give other
    outputs than in timm's: a quietly worse start, which a file whose config names its architecture does not get."""
    found = TIMM_EFFICIENTNET.fullmatch(architecture)
    if not found or bool(found[1]) != model.endswith("_torch"):
        return None
    counterpart = found[2] if found[1] else f"{architecture}_torch"
    return other_padding(what, f"holds timm's {architecture}", bool(found[1]), model, counterpart)


def timm_efficientnet(depthwise: str) -> Callable[[dict[str, np.ndarray], ModelConfig, str], Weights]:
    """A reader of timm's EfficientNets: its TensorFlow ports, `tf_efficientnet_b0` ... `b7` and `tf_efficientnetv2_b0`
    ... `l` (padding "same", batch-norm epsilon 1e-3: the graph keras.applications builds), into `efficientnet_b*` and
    `efficientnetv2_*`, and its own `efficientnet_b0` ... `b7` into `efficientnet_b*_torch`, as torchvision's
    `efficientnet_b0` ... `b7` and `efficientnet_v2_s`, `_m`, `_l` into `efficientnetv2_*_torch`
    (`torchvision_as_timm`; the epsilon 1e-3 of its B5-B7 and V2s folded into the moving variances:
    `with_epsilon`); depthwise kernels (C, 1, H, W) → (H, W, C, 1). A file of the
    other padding is one line (`padding_refusal`, `torchvision_refusal`); a timm file that does not name its
    architecture is taken at its shapes. (timm's own EfficientNetV2s, `*_rw_*`, are other architectures, which
    the shapes refuse.)"""
    def read(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> Weights:
        modules = torch_modules(tensors)
        torchvision = TORCHVISION_STEM in modules
        refusal = (torchvision_refusal(model_cfg.name, what) if torchvision
                   else padding_refusal(pretrained.timm_architecture(what) or "", model_cfg.name, what))
        if refusal:
            raise UserError(refusal)
        timm_names = torchvision_as_timm(modules) if torchvision else {module: module for module in modules}
        layers = efficientnet_layers(timm_names.values(), depthwise)
        epsilon = TORCHVISION_EPSILON if torchvision and model_cfg.name in TORCHVISION_EPSILON_1E3 else None

        def convert(params: dict[str, np.ndarray], layer: str) -> tuple[list, list[str]]:
            if layer.endswith(f"_{depthwise}"):
                return [params["weight"].transpose(2, 3, 0, 1)], ["weight"]
            values, order = torch_module_values(params, layer)
            return (with_epsilon(values, epsilon) if epsilon and "running_var" in params else values), order
        return renamed_modules(modules, lambda module: layers.get(timm_names[module]), model_cfg, what, convert)
    return read


register_torch_layout(*(f"efficientnet_{v}{torch}" for v in EFFICIENTNET for torch in ("", "_torch")))(
    timm_efficientnet("dwconv"))
register_torch_layout(*(name for name in {**APPS, **TORCH_PADDED} if name.startswith("efficientnetv2_")))(
    timm_efficientnet("dwconv2"))
# Whose files (`tfdp models`): timm's TensorFlow ports (tf_efficientnet*, tf_mobilenetv3*) into Keras' graphs; timm's
# own and torchvision's into the graphs padded as PyTorch pads (torchvision's alone for EfficientNetV2).
add_origins([name for name in APPS if name.startswith(("efficientnet", "mobilenet_v3"))], ("timm",))
add_origins([name for name in TORCH_PADDED if name.startswith(("efficientnet_b", "mobilenet_v3"))],
            ("timm", "torchvision"))
add_origins([name for name in TORCH_PADDED if name.startswith("efficientnetv2_")], ("torchvision",))


# ---------------------------------------------------------------- timm's and torchvision's MobileNetV3

# timm's MobileNetV3 blocks (`blocks.S.B`, numbered through all stages as Keras numbers its `expanded_conv_{i}_`
# blocks, the first without a number) by kind: depthwise-separable (the first block: `conv_dw`, `conv_pw`) or
# inverted residual (`conv_pw`, `conv_dw`, `conv_pwl`); the last stage is one 1x1 convolution (`conv`), Keras'
# `conv_1`. The head: global pooling, `conv_head` (Keras' 1x1 `conv_2`), the classifier (Keras' 1x1 `logits`).
MOBILENETV3_BLOCKS = {
    "separable": {"conv_dw": "depthwise", "bn1": "depthwise_bn", "se.conv_reduce": "squeeze_excite_conv",
                  "se.conv_expand": "squeeze_excite_conv_1", "conv_pw": "project", "bn2": "project_bn"},
    "inverted": {"conv_pw": "expand", "bn1": "expand_bn", "conv_dw": "depthwise", "bn2": "depthwise_bn",
                 "se.conv_reduce": "squeeze_excite_conv", "se.conv_expand": "squeeze_excite_conv_1",
                 "conv_pwl": "project", "bn3": "project_bn"},
    "last": {"conv": "conv_1", "bn1": "conv_1_bn"},
}
MOBILENETV3_TOP = {"conv_stem": "conv", "bn1": "conv_bn", "conv_head": "conv_2", "classifier": "logits"}


def mobilenetv3_layers(modules) -> dict[str, str | None]:
    """Each timm MobileNetV3 module → its keras.applications layer (None: no place)."""
    blocks = sorted({(int(found[1]), int(found[2])) for module in modules if (found := _BLOCK.fullmatch(module))})

    def block_layer(block: tuple[int, int], parts: dict, part: str) -> str | None:
        kind = "last" if "conv" in parts[block] else "inverted" if "conv_pwl" in parts[block] else "separable"
        name, number = MOBILENETV3_BLOCKS[kind].get(part), blocks.index(block)
        prefix = "" if kind == "last" else "expanded_conv_" if number == 0 else f"expanded_conv_{number}_"
        return f"{prefix}{name}" if name else None
    return builder_layers(modules, MOBILENETV3_TOP, block_layer)


_TORCHVISION_MOBILENET_BLOCK = re.compile(r"features\.(\d+)\.block\.(\d+)\.(0|1|fc1|fc2)")
# a torchvision MobileNetV3 block's convolutions (`block.J.0`, its batch norm `block.J.1`), by how many it has, in
# timm's names: without expansion (depthwise, projection), with it (expansion, depthwise, projection)
TORCHVISION_MOBILENET_CONVS = {2: (("conv_dw", "bn1"), ("conv_pw", "bn2")),
                               3: (("conv_pw", "bn1"), ("conv_dw", "bn2"), ("conv_pwl", "bn3"))}
TORCHVISION_MOBILENET_SE = {"fc1": "se.conv_reduce", "fc2": "se.conv_expand"}


def torchvision_mobilenetv3_as_timm(modules) -> dict[str, str]:
    """Each module of torchvision's MobileNetV3 → timm's name for it (itself where it has none, which then finds
    no layer): `features.0` the stem, `features.I` block I - 1 (`TORCHVISION_MOBILENET_CONVS`, squeeze-excite
    `fc1`, `fc2`), the last `features` the 1x1 convolution before pooling, `classifier.0` and `.3` timm's
    `conv_head` and classifier."""
    convs: dict[str, list[str]] = {}
    for module in modules:
        if (found := _TORCHVISION_MOBILENET_BLOCK.fullmatch(module)) and found[3] == "0":
            convs.setdefault(found[1], []).append(found[2])
    last = max((int(m.split(".")[1]) for m in modules if m.startswith("features.")), default=-1)
    names = {"features.0.0": "conv_stem", "features.0.1": "bn1", f"features.{last}.0": f"blocks.{last - 1}.0.conv",
             f"features.{last}.1": f"blocks.{last - 1}.0.bn1", "classifier.0": "conv_head",
             "classifier.3": "classifier"}
    for module in modules:
        found = _TORCHVISION_MOBILENET_BLOCK.fullmatch(module)
        if not found:
            names.setdefault(module, module)
            continue
        order = sorted(convs.get(found[1], []), key=int)
        pairs = TORCHVISION_MOBILENET_CONVS.get(len(order))
        if found[3] in TORCHVISION_MOBILENET_SE:
            part = TORCHVISION_MOBILENET_SE[found[3]]
        elif pairs and found[2] in order:
            part = pairs[order.index(found[2])][int(found[3])]   # `.0` the convolution, `.1` its batch norm
        else:
            names[module] = module
            continue
        names[module] = f"blocks.{int(found[1]) - 1}.0.{part}"
    return names


# timm's MobileNetV3 architectures: its TensorFlow ports (`tf_mobilenetv3_*_100`: padded "same", batch-norm epsilon
# 1e-3, Keras' graph: tfdp's `mobilenet_v3_*`) and its own (padded as PyTorch pads, epsilon 1e-5: `*_torch`)
TIMM_MOBILENETV3 = re.compile(r"(tf_)?mobilenetv3_(large|small)_100")


def mobilenetv3_refusal(architecture: str, torchvision: bool, model: str, what: str) -> str | None:
    """The line for a MobileNetV3 file whose padding is not the zoo model's, else None: timm's `tf_` ports and
    Keras' graph pad as TensorFlow pads, timm's own and torchvision's as PyTorch pads."""
    found = TIMM_MOBILENETV3.fullmatch(architecture)
    if torchvision:
        kind, tf_padded = re.fullmatch(r"mobilenet_v3_(large|small).*", model)[1], False
    elif found:
        kind, tf_padded = found[2], bool(found[1])
    else:
        return None
    if tf_padded != model.endswith("_torch"):
        return None
    source = "holds torchvision's layout" if torchvision else f"holds timm's {architecture}"
    return other_padding(what, source, tf_padded, model, f"mobilenet_v3_{kind}" + ("" if tf_padded else "_torch"))


@register_torch_layout(*(name for name in {**APPS, **TORCH_PADDED} if name.startswith("mobilenet_v3")))
def timm_mobilenetv3(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> Weights:
    """timm's MobileNetV3s (`mobilenetv3_large_100`, `mobilenetv3_small_100` into the `_torch` models; its
    TensorFlow ports `tf_mobilenetv3_*_100` into keras.applications' graph) and torchvision's `mobilenet_v3_large`
    and `_small` (into the `_torch` models, their epsilon folded into the moving variances); depthwise kernels
    (C, 1, H, W) → (H, W, C, 1), the head's linear layers → 1x1 kernels. A file of the other padding is one line
    (`mobilenetv3_refusal`); a timm file that does not name its architecture is taken at its shapes."""
    modules = torch_modules(tensors)
    torchvision = "features.0.0" in modules
    refusal = mobilenetv3_refusal(pretrained.timm_architecture(what) or "", torchvision, model_cfg.name, what)
    if refusal:
        raise UserError(refusal)
    timm_names = torchvision_mobilenetv3_as_timm(modules) if torchvision else {module: module for module in modules}
    layers = mobilenetv3_layers(timm_names.values())

    def convert(params: dict[str, np.ndarray], layer: str) -> tuple[list, list[str]]:
        if layer.endswith("_depthwise"):
            return [params["weight"].transpose(2, 3, 0, 1)], ["weight"]
        if params.get("weight") is not None and params["weight"].ndim == 2:   # a linear layer into a 1x1 conv
            biases = ["bias"] if "bias" in params else []
            return [params["weight"].T[None, None], *(params[b] for b in biases)], ["weight", *biases]
        values, order = torch_module_values(params, layer)
        return (with_epsilon(values, TORCHVISION_EPSILON) if torchvision and "running_var" in params else values), order
    return renamed_modules(modules, lambda module: layers.get(timm_names[module]), model_cfg, what, convert)
