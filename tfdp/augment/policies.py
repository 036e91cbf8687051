"""Per-image op policies: timm's RandAugment and torchvision's TrivialAugmentWide.

Their string syntax and op lists live in tfdp/config/rand_augment.py, which imports no TensorFlow, so the
config is validated with the same parser.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfdp.augment.color import PIXEL_OPS, truncate_levels
from tfdp.augment.draws import normal, random_index, random_sign, split_seed, uniform
from tfdp.augment.geometry import AFFINE_OPS, affine_rows, warp_affine
from tfdp.config.rand_augment import RAND_AUGMENT_OPS, RandAugmentSpec


def apply_ops_per_image(images, op_names: tuple[str, ...], choice, args, fill, interpolation: str) -> tf.Tensor:
    """Image i gets op_names[choice[i]] with args[i] (choice -1: unchanged); one warp serves all geometric ops."""
    shape = tf.shape(images)
    identity_coeffs = affine_rows(1.0, 0.0, 0.0, 0.0, 1.0, 0.0 * args)
    coeffs, geometric = identity_coeffs, tf.zeros_like(choice, tf.bool)
    for k, name in enumerate(op_names):
        if name in AFFINE_OPS:
            chosen = tf.equal(choice, k)
            coeffs = tf.where(chosen[:, None], AFFINE_OPS[name](args, shape[1], shape[2]), coeffs)
            geometric |= chosen
    out = images
    if any(name in AFFINE_OPS for name in op_names):
        out = tf.where(geometric[:, None, None, None],
                       truncate_levels(warp_affine(images, coeffs, fill, interpolation)), images)
    pixel_ops = [(k, PIXEL_OPS[name]) for k, name in enumerate(op_names) if name in PIXEL_OPS]
    for k, fn in pixel_ops:
        out = tf.where(tf.equal(choice, k)[:, None, None, None], truncate_levels(fn(images, args)), out)
    return out


# ----------------------------------------------------------------------------- RandAugment (timm)

def timm_runs(name: str) -> str:
    """The image op behind a timm RandAugment name (variants differ only in their magnitude mapping)."""
    return name.removesuffix("Increasing").removesuffix("Rel")


def timm_arg(name: str, magnitude, sign, height, width) -> tf.Tensor:
    """timm's LEVEL_TO_ARG: the op's argument [B] for a magnitude on the 0..10 scale."""
    level = magnitude / 10.0
    if name == "Rotate":
        return level * 30.0 * sign  # degrees
    if name in ("ShearX", "ShearY"):
        return level * 0.3 * sign
    if name in ("TranslateXRel", "TranslateYRel"):
        size = tf.cast(width if name == "TranslateXRel" else height, tf.float32)
        return level * 0.45 * sign * size  # pixels
    if name == "Posterize":
        return tf.floor(level * 4.0)  # bits kept
    if name == "PosterizeIncreasing":
        return 4.0 - tf.floor(level * 4.0)
    if name == "Solarize":
        return tf.minimum(256.0, tf.floor(level * 256.0))  # threshold (timm caps it: mmax above 10)
    if name == "SolarizeIncreasing":
        return 256.0 - tf.minimum(256.0, tf.floor(level * 256.0))
    if name == "SolarizeAdd":
        return tf.minimum(128.0, tf.floor(level * 110.0))
    if name.endswith("Increasing"):  # Color, Contrast, Brightness, Sharpness: factor, 1 = unchanged
        return tf.maximum(0.1, 1.0 + sign * level * 0.9)
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return level * 1.8 + 0.1
    return tf.zeros_like(magnitude)  # AutoContrast, Equalize, Invert take none


def rand_augment_plan(seed, batch, spec: RandAugmentSpec, num_ops_available: int) -> dict[str, tf.Tensor]:
    """Every random choice of timm's RandAugment, per image and layer ([B, N] each).

    op: index into the op list (uniform, with replacement across layers);
    applied: each chosen op runs with probability p (timm's AugmentOp prob 0.5);
    magnitude: m, with N(m, mstd) noise (uniform [0, m] for mstd inf), clipped to [0, mmax];
    sign: the random negation of signed ops.
    """
    op_seed, apply_seed, noise_seed, sign_seed = split_seed(seed, 4)
    shape = tf.stack([batch, spec.num_ops])
    magnitude = tf.fill(shape, float(spec.magnitude))
    if math.isinf(spec.magnitude_std):
        magnitude = uniform(noise_seed, shape, 0.0, float(spec.magnitude))
    elif spec.magnitude_std > 0:
        magnitude += spec.magnitude_std * normal(noise_seed, shape)
    return {
        "op": random_index(op_seed, shape, num_ops_available),
        "applied": uniform(apply_seed, shape) < spec.prob,
        "magnitude": tf.clip_by_value(magnitude, 0.0, float(spec.magnitude_max)),
        "sign": random_sign(sign_seed, shape),
    }


def rand_augment(images, seed, spec: RandAugmentSpec, op_names=RAND_AUGMENT_OPS, fill=(124.0, 116.0, 104.0),
                 plan: dict | None = None) -> tf.Tensor:
    """timm's RandAugment: N layers, in each every image its own op, magnitude, sign and apply-or-not."""
    shape = tf.shape(images)
    plan = plan or rand_augment_plan(seed, shape[0], spec, len(op_names))
    runnable = sorted({timm_runs(name) for name in op_names})
    for layer in range(spec.num_ops):
        op, applied = plan["op"][:, layer], plan["applied"][:, layer]
        magnitude, sign = plan["magnitude"][:, layer], plan["sign"][:, layer]
        choice = tf.fill([shape[0]], -1)
        args = tf.zeros([shape[0]])
        for k, name in enumerate(op_names):
            chosen = tf.equal(op, k) & applied
            choice = tf.where(chosen, runnable.index(timm_runs(name)), choice)
            args = tf.where(chosen, timm_arg(name, magnitude, sign, shape[1], shape[2]), args)
        images = apply_ops_per_image(images, tuple(runnable), choice, args, fill, "bilinear")
    return images


# ----------------------------------------------------------------------------- TrivialAugmentWide (torchvision)

TRIVIAL_AUGMENT_BINS = 31
# torchvision's _augmentation_space for TrivialAugmentWide: (op, magnitudes over the bins, signed).
_WIDE = np.linspace
TRIVIAL_AUGMENT_WIDE_SPACE = (
    ("Identity", np.zeros(1), False),
    ("ShearX", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("ShearY", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("TranslateX", _WIDE(0.0, 32.0, TRIVIAL_AUGMENT_BINS), True),
    ("TranslateY", _WIDE(0.0, 32.0, TRIVIAL_AUGMENT_BINS), True),
    ("Rotate", _WIDE(0.0, 135.0, TRIVIAL_AUGMENT_BINS), True),
    ("Brightness", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("Color", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("Contrast", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("Sharpness", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("Posterize", 8 - np.round(np.arange(TRIVIAL_AUGMENT_BINS) / ((TRIVIAL_AUGMENT_BINS - 1) / 6)), False),
    ("Solarize", _WIDE(255.0, 0.0, TRIVIAL_AUGMENT_BINS), False),
    ("AutoContrast", np.zeros(1), False),
    ("Equalize", np.zeros(1), False),
)


def trivial_augment_plan(seed, batch) -> dict[str, tf.Tensor]:
    """torchvision's draws, per image: op uniform over the 14, magnitude bin uniform over that op's bins, sign."""
    op_seed, bin_seed, sign_seed = split_seed(seed, 3)
    return {"op": random_index(op_seed, [batch], len(TRIVIAL_AUGMENT_WIDE_SPACE)),
            "bin": random_index(bin_seed, [batch], TRIVIAL_AUGMENT_BINS),
            "sign": random_sign(sign_seed, [batch])}


def trivial_augment_arg(name: str, magnitudes: np.ndarray, signed: bool, plan) -> tf.Tensor:
    """The op's argument from its bin: torchvision's _apply_op (enhance ops: 1 + m; translate: int pixels).

    torchvision's affine moves the content by +m pixels, so PIL's coefficient, which says where an output
    pixel samples, is -m: the same sign draw moves the image the same way as torchvision.
    """
    m = tf.gather(tf.constant(magnitudes, tf.float32), tf.minimum(plan["bin"], len(magnitudes) - 1))
    if signed:
        m *= plan["sign"]
    if name in ("Brightness", "Color", "Contrast", "Sharpness"):
        return 1.0 + m
    if name in ("TranslateX", "TranslateY"):
        return -tf.sign(m) * tf.floor(tf.abs(m))
    return m


def trivial_augment_wide(images, seed, plan: dict | None = None, interpolation: str = "bilinear") -> tf.Tensor:
    """torchvision's TrivialAugmentWide, one op per image, black fill; bilinear, as torchvision's reference
    train.py builds it (`--interpolation bilinear`; the class alone defaults to nearest)."""
    plan = plan or trivial_augment_plan(seed, tf.shape(images)[0])
    names = tuple(name for name, _, _ in TRIVIAL_AUGMENT_WIDE_SPACE)
    args = tf.zeros(tf.shape(plan["op"]), tf.float32)
    for k, (name, magnitudes, signed) in enumerate(TRIVIAL_AUGMENT_WIDE_SPACE):
        args = tf.where(tf.equal(plan["op"], k), trivial_augment_arg(name, magnitudes, signed, plan), args)
    return apply_ops_per_image(images, names, plan["op"], args, (0.0, 0.0, 0.0), interpolation)
