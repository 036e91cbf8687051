"""Architectures taken as they are from `keras.applications` (weights=None: nothing downloads).

Each keeps its upstream classifier head (with `classes=num_classes` and raw
logits), so parameter counts equal keras.applications' own. Their built-in
input rescaling is switched off: tfdp normalises on the device already.
"""

from __future__ import annotations

import keras

from tfdp.models.registry import register


def _app(constructor, **extra):
    def build(input_shape, num_classes: int, dropout: float = 0.0) -> keras.Model:
        return constructor(weights=None, include_top=True, input_shape=input_shape, classes=num_classes,
                           classifier_activation=None, **extra)
    return build


APPS = {
    "resnet50": (keras.applications.ResNet50, {}),
    "resnet101": (keras.applications.ResNet101, {}),
    "resnet152": (keras.applications.ResNet152, {}),
    "inception_v3": (keras.applications.InceptionV3, {}),
    "mobilenet_v2": (keras.applications.MobileNetV2, {}),
    "mobilenet_v3_large": (keras.applications.MobileNetV3Large, {"include_preprocessing": False}),
    "efficientnetv2_b0": (keras.applications.EfficientNetV2B0, {"include_preprocessing": False}),
    "efficientnetv2_b1": (keras.applications.EfficientNetV2B1, {"include_preprocessing": False}),
    "efficientnetv2_b2": (keras.applications.EfficientNetV2B2, {"include_preprocessing": False}),
    "efficientnetv2_b3": (keras.applications.EfficientNetV2B3, {"include_preprocessing": False}),
    "efficientnetv2_s": (keras.applications.EfficientNetV2S, {"include_preprocessing": False}),
    "efficientnetv2_m": (keras.applications.EfficientNetV2M, {"include_preprocessing": False}),
    "efficientnetv2_l": (keras.applications.EfficientNetV2L, {"include_preprocessing": False}),
}
MIN_SIZE = {"inception_v3": 75}

for _name, (_constructor, _extra) in APPS.items():
    register(_name, min_size=MIN_SIZE.get(_name, 32))(_app(_constructor, **_extra))
