"""Architectures taken as they are from `keras.applications` (weights=None: nothing downloads).

Each keeps its upstream classifier head (with `classes=num_classes` and raw
logits), so parameter counts equal keras.applications' own. Their built-in
input rescaling is left out: tfdp normalises on the device already. MobileNetV3
and EfficientNetV2 have a switch for it (`include_preprocessing`); EfficientNet
(V1) has none, so tfdp keeps its graph from the stem on (`from_the_stem`).

Dropout before the classifier: MobileNetV3 takes it as `dropout_rate`; the
EfficientNets build a `top_dropout` layer (V2: rate 0.2; V1: 0.2 to 0.5 from
B0 to B7) without exposing its rate, which is set after construction (Dropout reads it at call
time); the others have none, and get one inserted before their final Dense
layer when a rate above 0 is configured. The registry's default is each
model's upstream one.
"""

from __future__ import annotations

import re

import keras
import numpy as np

from tfdp.config import ModelConfig, pretrained
from tfdp.errors import UserError
from tfdp.models.registry import register
from tfdp.models.weights import Weights, register_torch_layout, torch_module_values


def _app(constructor, dropout_arg: str | None = None, **extra):
    def build(input_shape, num_classes: int, dropout: float) -> keras.Model:
        kwargs = {**extra, dropout_arg: dropout} if dropout_arg else extra
        model = constructor(weights=None, include_top=True, input_shape=input_shape, classes=num_classes,
                            classifier_activation=None, **kwargs)
        return model if dropout_arg else _set_head_dropout(model, dropout)
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


NO_PREPROCESSING = {"include_preprocessing": False}
# EfficientNet-B0 ... B7's classifier dropout, as keras.applications (and the paper) set it
EFFICIENTNET_DROPOUT = {"b0": 0.2, "b1": 0.2, "b2": 0.3, "b3": 0.3, "b4": 0.4, "b5": 0.4, "b6": 0.5, "b7": 0.5}
# name → (constructor, its keyword for the classifier's dropout rate or None, other keywords, default dropout)
APPS = {
    "resnet50": (keras.applications.ResNet50, None, {}, 0.0),
    "resnet101": (keras.applications.ResNet101, None, {}, 0.0),
    "resnet152": (keras.applications.ResNet152, None, {}, 0.0),
    "inception_v3": (keras.applications.InceptionV3, None, {}, 0.0),
    "mobilenet_v2": (keras.applications.MobileNetV2, None, {}, 0.0),
    "mobilenet_v3_large": (keras.applications.MobileNetV3Large, "dropout_rate", NO_PREPROCESSING, 0.2),
    "mobilenet_v3_small": (keras.applications.MobileNetV3Small, "dropout_rate", NO_PREPROCESSING, 0.2),
    **{f"efficientnet_{v}": (from_the_stem(getattr(keras.applications, f"EfficientNet{v.upper()}")), None, {}, rate)
       for v, rate in EFFICIENTNET_DROPOUT.items()},
    "efficientnetv2_b0": (keras.applications.EfficientNetV2B0, None, NO_PREPROCESSING, 0.2),
    "efficientnetv2_b1": (keras.applications.EfficientNetV2B1, None, NO_PREPROCESSING, 0.2),
    "efficientnetv2_b2": (keras.applications.EfficientNetV2B2, None, NO_PREPROCESSING, 0.2),
    "efficientnetv2_b3": (keras.applications.EfficientNetV2B3, None, NO_PREPROCESSING, 0.2),
    "efficientnetv2_s": (keras.applications.EfficientNetV2S, None, NO_PREPROCESSING, 0.2),
    "efficientnetv2_m": (keras.applications.EfficientNetV2M, None, NO_PREPROCESSING, 0.2),
    "efficientnetv2_l": (keras.applications.EfficientNetV2L, None, NO_PREPROCESSING, 0.2),
}
MIN_SIZE = {"inception_v3": 75}
# The classifier: a Dense `predictions` layer, or MobileNetV3's 1x1 convolution `logits`.
HEAD = ("predictions", "logits")
# timm's ResNet grouping on keras.applications' names (conv1_*: the stem; convS_blockB_*: one group per block).
RESNET_GROUPS = {"stem": r"^conv1_", "blocks": r"^conv(\d+)_block(\d+)_"}
LAYER_GROUPS = {"resnet50": RESNET_GROUPS, "resnet101": RESNET_GROUPS, "resnet152": RESNET_GROUPS}

for _name, (_constructor, _dropout_arg, _extra, _dropout) in APPS.items():
    register(_name, min_size=MIN_SIZE.get(_name, 32), dropout=_dropout, head=HEAD,
             layer_groups=LAYER_GROUPS.get(_name))(_app(_constructor, _dropout_arg, **_extra))


# ---------------------------------------------------------------- timm's EfficientNets, TensorFlow-padded

# timm's module → keras.applications' EfficientNet layer. Block `blocks.S.B` is Keras' `block{S+1}{a+B}_`; the first
# stage's blocks are depthwise-separable (no expansion), the others inverted residuals.
EFFICIENTNET_TOP = {"conv_stem": "stem_conv", "bn1": "stem_bn", "conv_head": "top_conv", "bn2": "top_bn",
                    "classifier": "predictions"}
EFFICIENTNET_BLOCK = {
    "separable": {"conv_dw": "dwconv", "bn1": "bn", "se.conv_reduce": "se_reduce", "se.conv_expand": "se_expand",
                  "conv_pw": "project_conv", "bn2": "project_bn"},
    "inverted": {"conv_pw": "expand_conv", "bn1": "expand_bn", "conv_dw": "dwconv", "bn2": "bn",
                 "se.conv_reduce": "se_reduce", "se.conv_expand": "se_expand", "conv_pwl": "project_conv",
                 "bn3": "project_bn"},
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(\d+)\.(.+)")


def efficientnet_layer(module: str) -> str | None:
    """The Keras layer a timm EfficientNet module's tensors go to, or None."""
    found = _BLOCK.fullmatch(module)
    if not found:
        return EFFICIENTNET_TOP.get(module)
    stage, block, part = int(found[1]), int(found[2]), found[3]
    name = EFFICIENTNET_BLOCK["separable" if stage == 0 else "inverted"].get(part)
    return f"block{stage + 1}{chr(ord('a') + block)}_{name}" if name and block < 26 else None


@register_torch_layout(*(f"efficientnet_{v}" for v in EFFICIENTNET_DROPOUT))
def read_timm_efficientnet(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> Weights:
    """timm's `tf_efficientnet_b0` ... `b7` state dicts (the ports of the TensorFlow checkpoints: padding "same",
    batch-norm epsilon 1e-3, as keras.applications builds them), depthwise kernels (C, 1, H, W) → (H, W, C, 1).

    timm's own `efficientnet_b*` pad as PyTorch does and normalise with epsilon 1e-5: their names and shapes are the
    same, but in Keras' graph they would give other outputs than in timm's, so a file whose config names one is one
    line, not a quietly worse start."""
    architecture = pretrained.timm_architecture(what) or ""
    if re.fullmatch(r"efficientnet_b\d", architecture):
        raise UserError(f"model.init_from: {what} holds timm's {architecture}, which pads its convolutions as PyTorch "
                        f"does; tfdp's {model_cfg.name} is keras.applications' EfficientNet, padded as TensorFlow pads "
                        f"(timm's tf_{architecture}): use tf_{architecture} weights")
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        module, _, param = key.rpartition(".")
        if param != "num_batches_tracked":  # PyTorch's batch-norm step counter: nothing in Keras holds it
            modules.setdefault(module, {})[param] = value
    values, names = {}, {}
    for module, params in modules.items():
        layer = efficientnet_layer(module)
        if layer is None:
            first = sorted(params)[0]
            raise UserError(f"model.init_from: {what} does not fit model '{model_cfg.name}': tensor "
                            f"{module}.{first} {tuple(params[first].shape)} has no place in it (another architecture?)")
        if layer.endswith("_dwconv"):
            arrays, order = [params["weight"].transpose(2, 3, 0, 1)], ["weight"]
        else:
            arrays, order = torch_module_values(params, layer)
        values[layer], names[layer] = arrays, [f"{module}.{p}" for p in order]
    return Weights(what, values, names)

