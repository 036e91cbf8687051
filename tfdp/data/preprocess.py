"""Per-image preprocessing on the host: encoded bytes (or decoded pixels) → a cropped, resized uint8 image.

This is the pipeline's `preprocess_fn` (big_vision's term; Model Garden's
Parser): the decoding stage (`tfdp.data.decoding`) is handed one of these
functions and never looks inside. Training takes a random-resized crop,
evaluation the central crop; both decode only the pixels they keep.
Everything per-pixel beyond that (flip, normalisation, the recipes'
augmentations) runs on the device as the model's first layers, so the host
stays at JPEG-decode speed. With `data.decoder: dali` the transform only
checks the encoded bytes (`encoded_transform`) and DALI decodes after the
stream (`tfdp.data.dali`); `DECODERS` holds each decoder's transforms, and
`dali_stopped` the one line for a DALI pipeline that stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Callable

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
    training size), resized as `data.eval_interpolation` says (`EVAL_CROPS`)."""
    size, crop = eval_image_size(cfg), EVAL_CROPS[cfg.eval_interpolation]
    return lambda data, index: crop(data, size, cfg.eval_crop_fraction)


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


def resize_then_crop(data: tf.Tensor, image_size: int, crop_fraction: float, method: str) -> tf.Tensor:
    """timm's evaluation transform (`transforms_imagenet_eval`, crop_mode center): the shorter side resized to
    floor(image_size / crop_fraction), the longer one in proportion (torchvision's `Resize(int)`: truncated), with
    `method` antialiased as Pillow resizes, then torchvision's `CenterCrop` (offsets rounded half to even).

    TensorFlow's antialiased kernels are Pillow's (bilinear: the triangle, bicubic: Keys' cubic with a = -0.5,
    both widened by the scale when shrinking, on half-pixel centres), computed in float; Pillow rounds to uint8
    between its horizontal and vertical passes, so a pixel may differ by a unit or two (docs/pretrained-weights.md
    measures it). The whole image is decoded: the resize reads every pixel its kernel reaches."""
    image = tf.cast(_decode_whole(data), tf.float32)
    shape = tf.shape(image)
    height, width = tf.cast(shape[0], tf.float64), tf.cast(shape[1], tf.float64)
    short_side = float(math.floor(image_size / crop_fraction))
    shorter = tf.minimum(height, width)
    new_height = tf.cast(tf.floor(short_side * height / shorter), tf.int32)   # the short side: exactly short_side
    new_width = tf.cast(tf.floor(short_side * width / shorter), tf.int32)
    resized = tf.image.resize(image, tf.stack([new_height, new_width]), method=method, antialias=True)
    pixels = tf.cast(tf.clip_by_value(tf.round(resized), 0.0, 255.0), tf.uint8)   # bicubic overshoots: clipped
    top = tf.cast(tf.round(tf.cast(new_height - image_size, tf.float64) / 2), tf.int32)
    left = tf.cast(tf.round(tf.cast(new_width - image_size, tf.float64) / 2), tf.int32)
    out = tf.slice(pixels, tf.stack([top, left, 0]), [image_size, image_size, 3])
    out.set_shape([image_size, image_size, 3])
    return out


def _decode_whole(data: tf.Tensor) -> tf.Tensor:
    """Every pixel of an encoded image, RGB; a JPEG with the exact IDCT, as Pillow's libjpeg decodes it."""
    return tf.cond(tf.io.is_jpeg(data),
                   lambda: tf.io.decode_jpeg(data, channels=3, dct_method="INTEGER_ACCURATE"),
                   lambda: tf.io.decode_image(data, channels=3, expand_animations=False))


# data.eval_interpolation → the evaluation crop: (encoded, side, crop fraction) → uint8 image
EVAL_CROPS = {
    "fast": center_crop,
    "bilinear": functools.partial(resize_then_crop, method="bilinear"),
    "bicubic": functools.partial(resize_then_crop, method="bicubic"),
}


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


@dataclasses.dataclass(frozen=True)
class Decoder:
    """What the training stream's transform hands on, and how its checked batches become training batches."""
    # (data config, seed) → (encoded, record index) → what a batch carries: the crop, or the checked bytes
    transform: Callable
    # (data config at its evaluation size) → (the validation stream's transform, as `transform`; the image that
    # pads its last steps, weight 0)
    evaluation: Callable
    # whether the per-replica batches go through `tfdp.data.dali.distribute` or straight to the replicas
    dealt: bool


DECODERS: dict[str, Decoder] = {}   # filled below: "tf", "dali"


def encoded_transform(cfg: DataConfig, seed: int):
    """`(encoded, record index) → encoded`, the same bytes, for images DALI will decode; any other fails.

    DALI stops the whole pipeline at an image it cannot decode, so what the
    tf path would skip as corrupt is failed here, in the stream, where it is
    counted and named as on the tf path (`tfdp.data.naming.corrupt_namer`
    calls this transform again for the reason). A JPEG's header is parsed
    and it must end in its end-of-image marker (a truncated file does not;
    checking costs no decoding). Other formats (PNG, GIF, BMP: rare in
    image datasets) are decoded once here in full.
    """
    def transform(data, index):
        def jpeg():
            header = has_pixels(tf.io.extract_jpeg_shape(data))
            with tf.control_dependencies([header]):   # after the header: its error names a broken one
                whole = tf.debugging.Assert(tf.equal(tf.strings.substr(data, -2, 2), b"\xff\xd9"),
                                            ["a truncated JPEG: no end-of-image marker"])
            with tf.control_dependencies([whole]):
                return tf.identity(data)

        def other():
            decoded = has_pixels(tf.shape(tf.io.decode_image(data, channels=3, expand_animations=False)))
            with tf.control_dependencies([decoded]):
                return tf.identity(data)
        return tf.cond(tf.io.is_jpeg(data), jpeg, other)
    return transform


def has_pixels(shape: tf.Tensor) -> tf.Operation:
    """A check on an image's shape, which makes the parse or decode that gave the shape run: in a tf.data
    function a stateless op that only a control edge waits on is pruned (a broken header, or a broken PNG,
    then passed `encoded_transform` and stopped DALI)."""
    return tf.debugging.Assert(tf.reduce_all(shape > 0), ["an image of no pixels"])


def blank_jpeg() -> tf.Tensor:
    """A small black JPEG: the image that pads the validation stream's last steps for DALI, which decodes it."""
    return tf.io.encode_jpeg(tf.zeros([32, 32, 3], tf.uint8))


_TF = Decoder(train_transform, lambda cfg: (eval_transform(cfg), tf.zeros([cfg.image_size, cfg.image_size, 3],
                                                                          tf.uint8)), dealt=False)
# auto reaches the pipeline only where no run chose (`tfdp.data.dali.choose`): a benchmark's or a test's bare pipeline, the tf path.
DECODERS.update(tf=_TF, auto=_TF, dali=Decoder(encoded_transform, lambda cfg: (encoded_transform(cfg, 0), blank_jpeg()),
                                               dealt=True))


def dali_stopped(message: str) -> str:
    """The one line for a DALI pipeline that stopped (an image it could not decode that passed
    `encoded_transform`'s check, or DALI's own fault); '' for any other error. DALI does not say which image."""
    if "Critical error in pipeline" not in message and "DALI_ERROR" not in message:
        return ""
    operator = re.search(r"Error in (?:CPU|GPU|MIXED) operator `([^`]+)`", message)
    where = f" in {operator.group(1)}" if operator else ""
    return (f"DALI stopped the input{where}: {_dali_reason(message)} (data.decoder: dali; with "
            f"data.decoder: tf an image that cannot be decoded is skipped and named)")


def _dali_reason(message: str) -> str:
    """DALI's cause in one line (its messages nest: the operator, its Python traceback, then what it encountered)."""
    cause = re.search(r"encountered:\s*\n\s*([^\n]*?)\s*:?\s*\n", message)
    if cause and cause.group(1):
        return cause.group(1)[:300]
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return (lines[0] if lines else "unknown error")[:300]
