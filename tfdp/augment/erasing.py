"""timm's RandomErasing, per image on the batch."""

from __future__ import annotations

import math

import tensorflow as tf

from tfdp.augment.draws import normal, random_index, split_seed, uniform
from tfdp.augment.geometry import box_mask
from tfdp.config import IMAGENET_MEAN, IMAGENET_STD

_ERASING_ATTEMPTS = 10  # timm tries 10 boxes and erases nothing if none fits


def random_erasing(images, seed, prob: float, area=(0.02, 1 / 3), min_aspect: float = 0.3, mode: str = "pixel",
                   mean=IMAGENET_MEAN, std=IMAGENET_STD) -> tf.Tensor:
    """timm's RandomErasing (count=1), per image, on 0..255 pixels.

    timm erases after normalization with N(0, 1) noise; in pixel units that is
    mean + std * N(0, 1) per channel, clipped to 0..255 because the batch stays uint8.
    """
    shape = tf.shape(images)
    batch, height, width = shape[0], shape[1], shape[2]
    apply_seed, area_seed, aspect_seed, top_seed, left_seed, fill_seed = split_seed(seed, 6)
    fraction = uniform(area_seed, [batch, _ERASING_ATTEMPTS], area[0], area[1])
    log_aspect = uniform(aspect_seed, [batch, _ERASING_ATTEMPTS], math.log(min_aspect), -math.log(min_aspect))
    box_h, box_w, fits = erasing_box_size(fraction, log_aspect, height, width)
    erase = fits & (uniform(apply_seed, [batch]) < prob)
    top = random_index(top_seed, [batch], height - box_h + 1)
    left = random_index(left_seed, [batch], width - box_w + 1)
    return erase_box(images, top, left, box_h, box_w, erase, erasing_fill(fill_seed, shape, mode, mean, std))


def erasing_box_size(fraction, log_aspect, height, width) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """timm's attempts [B, tries]: area fraction and log aspect → the first box that fits (height, width [B])
    and whether any did [B]; sides rounded half to even, as Python's round."""
    target = fraction * tf.cast(height, tf.float32) * tf.cast(width, tf.float32)
    aspect = tf.exp(log_aspect)
    box_h = tf.cast(tf.round(tf.sqrt(target * aspect)), tf.int32)
    box_w = tf.cast(tf.round(tf.sqrt(target / aspect)), tf.int32)
    fits = (box_w < width) & (box_h < height)
    first = tf.argmax(tf.cast(fits, tf.int32), axis=1, output_type=tf.int32)
    return (tf.gather(box_h, first, batch_dims=1), tf.gather(box_w, first, batch_dims=1),
            tf.reduce_any(fits, axis=1))


def erase_box(images, top, left, box_h, box_w, erase, fill) -> tf.Tensor:
    """Rows [top, top + box_h) and columns [left, left + box_w) of the images where `erase` [B] is set take
    `fill` (broadcast to the images)."""
    shape = tf.shape(images)
    mask = box_mask(shape[1], shape[2], top, top + box_h, left, left + box_w) & erase[:, None, None, None]
    return tf.where(mask, fill, images)


def erasing_fill(seed, shape, mode: str, mean, std) -> tf.Tensor:
    """timm's 'pixel' (per-pixel normal), 'rand' (one normal colour per image) or 'const' (0 = the mean) fill."""
    if mode == "pixel":
        noise = normal(seed, shape)
    elif mode == "rand":
        noise = normal(seed, tf.stack([shape[0], 1, 1, shape[3]]))
    else:
        noise = tf.zeros([1, 1, 1, 3])
    return pixels_of_noise(noise, mean, std)


def pixels_of_noise(noise, mean, std) -> tf.Tensor:
    """timm's normalised N(0, 1) fill in 0..255 pixel units: mean + std * noise, rounded and clipped to uint8
    levels (the batch stays uint8 until the model normalises it)."""
    mean, std = tf.constant(mean, tf.float32), tf.constant(std, tf.float32)
    return tf.clip_by_value(tf.round(mean + std * noise), 0.0, 255.0)
