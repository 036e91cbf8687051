"""Colour and tone ops: torchvision's ColorJitter, and the pixel ops RandAugment and TrivialAugment apply
(PIL's maths, checked against PIL in the tests)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from tfdp.augment.draws import split_seed, uniform


def truncate_levels(x) -> tf.Tensor:
    """Back to 0..255 integer levels by truncation, as PIL's 8-bit ops and torchvision's uint8 casts do
    (the 1e-3 absorbs float error, so 99.99998 stays 100); matches PIL exactly in the tests."""
    return tf.clip_by_value(tf.floor(x + 1e-3), 0.0, 255.0)

def color_jitter(images, seed, brightness: float, contrast: float, saturation: float, hue: float,
                 random_order: bool = True) -> tf.Tensor:
    """torchvision's ColorJitter with per-image factors and (optionally) a per-image order of the four ops."""
    seeds = split_seed(seed, 5)
    batch = tf.shape(images)[0]
    ranges = ((adjust_brightness, brightness, max(0.0, 1.0 - brightness), 1.0 + brightness),
              (adjust_contrast, contrast, max(0.0, 1.0 - contrast), 1.0 + contrast),
              (adjust_saturation, saturation, max(0.0, 1.0 - saturation), 1.0 + saturation),
              (adjust_hue, hue, -hue, hue))
    ops = [(fn, uniform(seeds[i], [batch], low, high)) for i, (fn, amount, low, high) in enumerate(ranges)
           if amount > 0]
    order = per_image_order(seeds[4], batch, len(ops), random_order)
    x = images
    for position in range(len(ops)):
        x = select_per_image(order[:, position], [lambda x=x, fn=fn, f=f: truncate_levels(fn(x, f)) for fn, f in ops],
                             x)
    return x


def per_image_order(seed, batch, n: int, random_order: bool) -> tf.Tensor:
    """[B, n]: the order in which each image gets the n ops (a random permutation each, or 0..n-1)."""
    if not random_order:
        return tf.broadcast_to(tf.range(n)[None], tf.stack([batch, n]))
    return tf.cast(tf.argsort(uniform(seed, tf.stack([batch, n])), axis=1), tf.int32)


def select_per_image(choice, candidates: list[Callable[[], tf.Tensor]], default) -> tf.Tensor:
    """Image i of candidates[choice[i]]() (default where choice matches none): a per-image switch, vectorized."""
    out = default
    for k, make in enumerate(candidates):
        out = tf.where(tf.equal(choice, k)[:, None, None, None], make(), out)
    return out


def grayscale(x) -> tf.Tensor:
    """ITU-R 601-2 luma, as PIL's convert('L') and torchvision's rgb_to_grayscale: [B, H, W, 1]."""
    return tf.reduce_sum(x * tf.constant([0.299, 0.587, 0.114]), axis=-1, keepdims=True)


def _per_image(v) -> tf.Tensor:
    return tf.reshape(v, [-1, 1, 1, 1])


def blend_with(degenerate, x, factor) -> tf.Tensor:
    """PIL's ImageEnhance / torchvision's _blend: degenerate + factor * (x - degenerate), clipped to 0..255."""
    return tf.clip_by_value(degenerate + _per_image(factor) * (x - degenerate), 0.0, 255.0)


def adjust_brightness(x, factor) -> tf.Tensor:
    return blend_with(tf.zeros_like(x), x, factor)


def adjust_contrast(x, factor) -> tf.Tensor:
    """Blend with the image's mean grey level (PIL rounds it to an integer)."""
    mean = tf.floor(tf.reduce_mean(tf.round(grayscale(x)), axis=[1, 2, 3], keepdims=True) + 0.5)
    return blend_with(mean, x, factor)


def adjust_saturation(x, factor) -> tf.Tensor:
    return blend_with(tf.round(grayscale(x)), x, factor)


def adjust_hue(x, delta) -> tf.Tensor:
    """Rotate the hue by `delta` turns (torchvision adjust_hue), per image."""
    hsv = tf.image.rgb_to_hsv(x / 255.0)
    hue = tf.math.floormod(hsv[..., :1] + _per_image(delta), 1.0)
    return tf.image.hsv_to_rgb(tf.concat([hue, hsv[..., 1:]], -1)) * 255.0


# ----------------------------------------------------------------------------- image ops (PIL's maths)

def adjust_sharpness(x, factor) -> tf.Tensor:
    """PIL's ImageFilter.SMOOTH (3x3, centre 5, total 13) as the degenerate image; the 1-pixel border is kept."""
    kernel = np.tile(np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32)[:, :, None, None] / 13.0, [1, 1, 3, 1])
    smooth = tf.round(tf.nn.depthwise_conv2d(x, kernel, [1, 1, 1, 1], "VALID"))
    degenerate = x + tf.pad(smooth - x[:, 1:-1, 1:-1, :], [[0, 0], [1, 1], [1, 1], [0, 0]])
    return blend_with(degenerate, x, factor)


def auto_contrast(x, _arg=None) -> tf.Tensor:
    """Stretch each channel to 0..255 (PIL's ImageOps.autocontrast, cutoff 0)."""
    low = tf.reduce_min(x, axis=[1, 2], keepdims=True)
    high = tf.reduce_max(x, axis=[1, 2], keepdims=True)
    scale = 255.0 / tf.maximum(high - low, 1.0)
    return tf.where(high > low, tf.clip_by_value(tf.floor((x - low) * scale + 1e-3), 0.0, 255.0), x)


def equalize(x, _arg=None) -> tf.Tensor:
    """PIL's ImageOps.equalize per channel: lut[i] = (step // 2 + pixels below i) // step.

    step = (pixels - count of the brightest present level) // 255 (torchvision's
    tensor equalize too); a channel with step 0 (one level, or nearly) is left alone.
    """
    shape = tf.shape(x)
    batch, pixels = shape[0], shape[1] * shape[2]
    levels = tf.transpose(tf.reshape(tf.cast(x, tf.int32), [batch, pixels, 3]), [0, 2, 1])  # [B, 3, HW]
    channel = tf.range(batch * 3)[:, None]
    ids = tf.reshape(channel * 256 + tf.reshape(levels, [batch * 3, pixels]), [-1])
    hist = tf.reshape(tf.math.unsorted_segment_sum(tf.ones_like(ids), ids, batch * 3 * 256), [batch, 3, 256])
    brightest = tf.gather(hist, tf.reduce_max(levels, axis=2), batch_dims=2)
    step = (pixels - brightest) // 255
    cum = tf.cumsum(hist, axis=2, exclusive=True)
    lut = tf.minimum((step[..., None] // 2 + cum) // tf.maximum(step[..., None], 1), 255)
    mapped = tf.gather(lut, levels, batch_dims=2)
    out = tf.where(step[..., None] > 0, mapped, levels)
    return tf.cast(tf.reshape(tf.transpose(out, [0, 2, 1]), shape), tf.float32)


def invert(x, _arg=None) -> tf.Tensor:
    return 255.0 - x


def posterize(x, bits) -> tf.Tensor:
    """Keep the `bits` most significant bits (8 or more: unchanged, as timm)."""
    step = _per_image(tf.pow(2.0, 8.0 - tf.minimum(tf.cast(bits, tf.float32), 8.0)))
    return tf.floor(x / step) * step


def solarize(x, threshold) -> tf.Tensor:
    """Invert the levels at or above `threshold`."""
    return tf.where(x >= _per_image(threshold), 255.0 - x, x)


def solarize_add(x, add) -> tf.Tensor:
    """timm's solarize_add: levels below 128 get `add`, capped at 255."""
    return tf.where(x < 128.0, tf.minimum(x + _per_image(add), 255.0), x)


def identity(x, _arg=None) -> tf.Tensor:
    return x


# Pixel ops: fn(images float [B,H,W,3], arg [B]) -> images. The arg is the op's own parameter (factor, bits...).
PIXEL_OPS: dict[str, Callable] = {
    "Identity": identity, "AutoContrast": auto_contrast, "Equalize": equalize, "Invert": invert,
    "Posterize": posterize, "Solarize": solarize, "SolarizeAdd": solarize_add, "Color": adjust_saturation,
    "Contrast": adjust_contrast, "Brightness": adjust_brightness, "Sharpness": adjust_sharpness,
}
