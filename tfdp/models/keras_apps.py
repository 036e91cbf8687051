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

import keras

from tfdp.models.registry import register


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
