"""Geometric ops as PIL affine transforms, and one XLA-compatible warp that applies them to a batch."""

from __future__ import annotations

import math
from typing import Callable

import tensorflow as tf


def affine_rows(*rows) -> tf.Tensor:
    """[B, 6] PIL affine coefficients (a, b, c, d, e, f) from per-image columns or scalars."""
    batch = next(r for r in rows if not isinstance(r, (int, float)))
    return tf.stack([tf.broadcast_to(tf.cast(r, tf.float32), tf.shape(batch)) for r in rows], axis=1)


def shear_x(arg, height, width) -> tf.Tensor:
    return affine_rows(1.0, arg, 0.0, 0.0, 1.0, 0.0)


def shear_y(arg, height, width) -> tf.Tensor:
    return affine_rows(1.0, 0.0, 0.0, arg, 1.0, 0.0)


def translate_x(pixels, height, width) -> tf.Tensor:
    return affine_rows(1.0, 0.0, pixels, 0.0, 1.0, 0.0)


def translate_y(pixels, height, width) -> tf.Tensor:
    return affine_rows(1.0, 0.0, 0.0, 0.0, 1.0, pixels)


def rotate(degrees, height, width) -> tf.Tensor:
    """PIL's Image.rotate: counter-clockwise about the centre."""
    angle = -degrees * (math.pi / 180.0)
    cos, sin = tf.cos(angle), tf.sin(angle)
    cx, cy = tf.cast(width, tf.float32) / 2.0, tf.cast(height, tf.float32) / 2.0
    return affine_rows(cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy)


# Geometric ops: fn(arg [B], H, W) -> [B, 6] PIL affine coefficients; all of one layer share one warp.
AFFINE_OPS: dict[str, Callable] = {
    "ShearX": shear_x, "ShearY": shear_y, "TranslateX": translate_x, "TranslateY": translate_y, "Rotate": rotate,
}


def warp_affine(images, coeffs, fill, interpolation: str = "bilinear") -> tf.Tensor:
    """PIL's Image.transform(AFFINE): output pixel centre (x, y) samples the input at (ax+by+c, dx+ey+f).

    Samples whose position falls outside the input take `fill`, as PIL does;
    written with gathers so that it compiles with XLA (ImageProjectiveTransformV3 does not).
    """
    shape = tf.shape(images)
    batch, height, width = shape[0], shape[1], shape[2]
    h, w = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
    ys, xs = tf.meshgrid(tf.range(h) + 0.5, tf.range(w) + 0.5, indexing="ij")
    a, b, c, d, e, f = (coeffs[:, i, None, None] for i in range(6))
    u, v = a * xs + b * ys + c, d * xs + e * ys + f  # [B, H, W], input coordinates (pixel centres at +0.5)
    inside = ((u >= 0) & (u < w) & (v >= 0) & (v < h))[..., None]
    flat = tf.reshape(images, [-1, 3])
    base = (tf.range(batch) * height * width)[:, None, None, None]
    if interpolation == "nearest":
        x0, y0, dx, dy = tf.floor(u), tf.floor(v), [0], [0]
    else:
        x0, y0, dx, dy = tf.floor(u - 0.5), tf.floor(v - 0.5), [0, 1, 0, 1], [0, 0, 1, 1]
    ix = tf.clip_by_value(tf.cast(x0, tf.int32)[..., None] + dx, 0, width - 1)
    iy = tf.clip_by_value(tf.cast(y0, tf.int32)[..., None] + dy, 0, height - 1)
    corners = tf.gather(flat, base + iy * width + ix)  # [B, H, W, corners, 3]
    if interpolation == "nearest":
        sampled = corners[..., 0, :]
    else:
        wx, wy = u - 0.5 - x0, v - 0.5 - y0
        weights = tf.stack([(1 - wx) * (1 - wy), wx * (1 - wy), (1 - wx) * wy, wx * wy], axis=-1)
        sampled = tf.reduce_sum(corners * weights[..., None], axis=3)
    return tf.where(inside, sampled, tf.constant(fill, tf.float32))


def box_mask(height, width, top, bottom, left, right) -> tf.Tensor:
    """[B, H, W, 1] booleans, true inside rows [top, bottom) and columns [left, right) of each image."""
    rows = tf.range(height)[None, :, None, None]
    cols = tf.range(width)[None, None, :, None]
    t, b, l, r = (v[:, None, None, None] for v in (top, bottom, left, right))
    return (rows >= t) & (rows < b) & (cols >= l) & (cols < r)
