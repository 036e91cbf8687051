"""Per-image preprocessing on the host: encoded bytes (or decoded pixels) → a cropped, resized uint8 image.

This is the pipeline's `preprocess_fn` (big_vision's term; Model Garden's
Parser): `tfdp.data.pipeline` passes one of these functions in and never
looks inside. Training takes a random-resized crop, evaluation the central
crop; both decode only the pixels they keep. Everything per-pixel beyond
that (flip, normalisation, the recipes' augmentations) runs on the device as
the model's first layers, so the host stays at JPEG-decode speed.
"""

from __future__ import annotations

import functools
import os

import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.config.image_sizes import eval_image_size

ASPECT_RATIO_RANGE = (3 / 4, 4 / 3)


def host_cores() -> int:
    """The cores this process may run on (its affinity, as a container's CPU set or `taskset` limits it), which
    the per-image work is sized to: decodes in flight, DALI's threads."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def train_transform(cfg: DataConfig, seed: int):
    """`(encoded, record index) → image` for training: a random-resized crop.

    Under `data.deterministic` each window is drawn from (seed, the record's
    position in the stream), so a resumed run crops exactly as the
    uninterrupted one would have.
    """
    def transform(data, index):
        return random_crop(data, cfg, tf.stack([tf.constant(seed, tf.int64), index]) if cfg.deterministic else None)
    return transform


def eval_transform(cfg: DataConfig):
    """`(encoded, record index) → image` for evaluation: the central crop, at `data.eval_image_size` (0: the
    training size)."""
    size = eval_image_size(cfg)
    return lambda data, index: center_crop(data, size, cfg.eval_crop_fraction)


def random_crop(data: tf.Tensor, cfg: DataConfig, seed: tf.Tensor | None = None) -> tf.Tensor:
    """Random-resized crop (Inception-style window), decoding only the window.

    With a `seed` (shape [2]) the window is a pure function of it. The
    horizontal flip is not done here: it is per-pixel work, so it runs on the
    device as the model's first layer (see `tfdp.models.build_model`).
    """
    box_args = dict(bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]), min_object_covered=0.0,
                    aspect_ratio_range=ASPECT_RATIO_RANGE, area_range=(cfg.min_crop_area, cfg.max_crop_area),
                    max_attempts=10, use_image_if_no_bounding_boxes=True)

    sample = (tf.image.sample_distorted_bounding_box if seed is None else
              functools.partial(tf.image.stateless_sample_distorted_bounding_box, seed=seed))

    def window(shape):
        begin, size, _ = sample(shape, **box_args)
        return tf.stack([begin[0], begin[1], size[0], size[1]])
    return _resize(_decode_window(data, window), cfg.image_size)


def center_crop(data: tf.Tensor, image_size: int, crop_fraction: float) -> tf.Tensor:
    """Square central crop covering `crop_fraction` of the shorter side, resized."""
    def window(shape):
        side = tf.cast(tf.cast(tf.minimum(shape[0], shape[1]), tf.float32) * crop_fraction, tf.int32)
        return tf.stack([(shape[0] - side) // 2, (shape[1] - side) // 2, side, side])
    return _resize(_decode_window(data, window), image_size)


def _decode_window(data: tf.Tensor, window) -> tf.Tensor:
    """The pixels inside `window(shape)` (offset_y, offset_x, height, width) of an encoded image.

    A JPEG's shape comes from its header and only the window is decoded, with
    the exact IDCT (the inexact INTEGER_FAST gains next to nothing: docs/benchmarks.md);
    other formats (PNG, GIF, BMP) are decoded whole and sliced. Pixels already decoded (uint8 [h, w, 3], an
    IDX file's: `tfdp.data.layouts.idx`) are only sliced.
    """
    if data.dtype == tf.uint8:
        box = window(tf.shape(data))
        return tf.slice(data, [box[0], box[1], 0], [box[2], box[3], 3])

    def jpeg():
        return tf.io.decode_and_crop_jpeg(data, window(tf.io.extract_jpeg_shape(data)), channels=3,
                                          dct_method="INTEGER_ACCURATE")

    def other():
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
        box = window(tf.shape(image))
        return tf.slice(image, [box[0], box[1], 0], [box[2], box[3], 3])
    return tf.cond(tf.io.is_jpeg(data), jpeg, other)


def _resize(image: tf.Tensor, image_size: int) -> tf.Tensor:
    # TensorFlow's bilinear kernel is faster on float input than on uint8 (docs/benchmarks.md), and
    # bilinear weights keep values within 0..255: round half up and cast, no clipping pass.
    resized = tf.image.resize(tf.cast(image, tf.float32), [image_size, image_size], method="bilinear", antialias=False)
    out = tf.cast(resized + 0.5, tf.uint8)
    out.set_shape([image_size, image_size, 3])
    return out
