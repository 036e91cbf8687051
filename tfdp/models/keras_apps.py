"""Architectures taken as they are from `keras.applications` (weights=None: nothing downloads).

Each keeps its upstream classifier head (with `classes=num_classes` and raw
logits), so parameter counts equal keras.applications' own. Their built-in
input rescaling is switched off: tfdp normalises on the device already.

Dropout before the classifier: MobileNetV3 takes it as `dropout_rate`; the
EfficientNetV2 variants build a `top_dropout` layer (rate 0.2) without
exposing its rate, which is set after construction (Dropout reads it at call
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


NO_PREPROCESSING = {"include_preprocessing": False}
# name → (constructor, its keyword for the classifier's dropout rate or None, other keywords, default dropout)
APPS = {
    "resnet50": (keras.applications.ResNet50, None, {}, 0.0),
    "resnet101": (keras.applications.ResNet101, None, {}, 0.0),
    "resnet152": (keras.applications.ResNet152, None, {}, 0.0),
    "inception_v3": (keras.applications.InceptionV3, None, {}, 0.0),
    "mobilenet_v2": (keras.applications.MobileNetV2, None, {}, 0.0),
    "mobilenet_v3_large": (keras.applications.MobileNetV3Large, "dropout_rate", NO_PREPROCESSING, 0.2),
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
