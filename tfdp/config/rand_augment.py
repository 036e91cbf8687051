"""RandAugment's string syntax (timm's `rand-m9-n2-mstd0.5-inc1`) and op lists; no TensorFlow here, so
tfdp/config/__init__.py validates `augment.rand_augment` with the same parser the training step uses."""

from __future__ import annotations

import dataclasses
from typing import Any

# RandAugment ops by timm's names (timm/data/auto_augment.py); policies.py runs each.
RAND_AUGMENT_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color",
                    "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
# timm's "inc1" list: the same ops, those with a direction replaced by variants that grow with the magnitude.
RAND_AUGMENT_INCREASING_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing",
                               "SolarizeIncreasing", "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing",
                               "BrightnessIncreasing", "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel",
                               "TranslateYRel")
RAND_AUGMENT_OP_NAMES = tuple(dict.fromkeys(RAND_AUGMENT_OPS + RAND_AUGMENT_INCREASING_OPS))


@dataclasses.dataclass(frozen=True)
class RandAugmentSpec:
    """A parsed timm RandAugment string; the defaults are timm's for a section left out."""
    num_ops: int = 2              # n: ops applied one after another to each image
    magnitude: float = 10.0       # m: 0..10 (timm's _LEVEL_DENOM scale)
    magnitude_std: float = 0.0    # mstd: per-application gaussian noise on m; inf (mstd > 100): uniform in [0, m]
    magnitude_max: float = 10.0   # mmax: the noisy magnitude is clipped to [0, mmax]
    increasing: bool = False      # inc1: RAND_AUGMENT_INCREASING_OPS instead of RAND_AUGMENT_OPS
    prob: float = 0.5             # p: chance that each chosen op is applied (timm's AugmentOp prob)


def parse_rand_augment(text: str) -> RandAugmentSpec:
    """Reads timm's `rand-m9-n2-mstd0.5-mmax10-inc1-p0.5` syntax; raises ValueError naming the bad section.

    Stricter than timm, which silently skips a section without digits and asserts on unknown keys.
    """
    sections = text.split("-")
    if sections[0] != "rand":
        raise ValueError(f"must start with 'rand-' (timm's RandAugment syntax, e.g. rand-m9-mstd0.5-inc1), "
                         f"not {sections[0]!r}")
    values: dict[str, Any] = {}
    for section in sections[1:]:
        key, value = _split_section(section)
        values[key] = value
    return RandAugmentSpec(**values)


_RAND_AUGMENT_KEYS = {"m": ("magnitude", float), "n": ("num_ops", int), "mstd": ("magnitude_std", float),
                      "mmax": ("magnitude_max", float), "inc": ("increasing", int), "p": ("prob", float)}


def _split_section(section: str) -> tuple[str, Any]:
    """One `key<number>` section of a RandAugment string as (RandAugmentSpec field, value)."""
    key = section.rstrip("0123456789.")
    raw = section[len(key):]
    if key not in _RAND_AUGMENT_KEYS:
        known = ", ".join(f"{k}<number>" for k in _RAND_AUGMENT_KEYS)
        raise ValueError(f"unknown RandAugment section {section!r} (known: {known})")
    field, kind = _RAND_AUGMENT_KEYS[key]
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"RandAugment section {section!r} needs a{'n integer' if kind is int else ' number'} "
                         f"after {key!r}") from None
    if key == "mstd" and value > 100:
        value = float("inf")  # timm: uniform magnitude in [0, m]
    if key == "n" and value < 1:
        raise ValueError(f"RandAugment section {section!r}: n must be at least 1")
    if key == "inc" and value not in (0, 1):
        raise ValueError(f"RandAugment section {section!r}: inc must be 0 or 1")
    if key == "p" and not 0 <= value <= 1:
        raise ValueError(f"RandAugment section {section!r}: p must be in [0, 1]")
    return field, bool(value) if key == "inc" else value
