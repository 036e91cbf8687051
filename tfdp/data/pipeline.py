"""tf.data pipelines: files → decoded, augmented uint8 batches.

The host only decodes, crops and resizes; images leave the pipeline as uint8
and are normalised by the model's first layer on the device, which keeps
per-pixel float work off the CPU. Training decodes only the random crop
window (`decode_and_crop_jpeg`), evaluation only the central crop.

Each function taking an `input_context` is meant for
`strategy.distribute_datasets_from_function`: it builds one input pipeline's
share and batches by the per-replica batch size.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.data.sources import Split

AUTOTUNE = tf.data.AUTOTUNE
ASPECT_RATIO_RANGE = (3 / 4, 4 / 3)


def train_dataset(split: Split, cfg: DataConfig, global_batch: int, seed: int,
                  input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
    """Endless shuffled, augmented batches of this input pipeline's share of `split`."""
    ctx = input_context or tf.distribute.InputContext()
    batch = ctx.get_per_replica_batch_size(global_batch)
    ds = _encoded_examples(split, ctx, shuffle_seed=seed)
    if cfg.cache:
        ds = ds.cache()
    ds = ds.shuffle(min(cfg.shuffle_buffer, split.num_examples), seed=seed, reshuffle_each_iteration=True)
    ds = ds.repeat()
    crop = lambda data, label: (random_crop(data, cfg), label)  # noqa: E731
    ds = ds.map(crop, num_parallel_calls=AUTOTUNE, deterministic=cfg.deterministic)
    ds = ds.batch(batch, drop_remainder=True)
    return ds.prefetch(AUTOTUNE)


def eval_dataset(split: Split, cfg: DataConfig, global_batch: int,
                 input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
    """One pass over this pipeline's share of `split` as (image, label, weight), every example once.

    The share is padded with weight-0 images up to the same whole number of
    full steps on every input pipeline, so no replica ever gets a partial or
    empty batch (which TensorFlow's oneDNN kernels mishandle, and which would
    leave multi-worker collectives waiting on a worker with fewer steps), and
    metrics weighted by `weight` count each real image exactly once.
    """
    ctx = input_context or tf.distribute.InputContext()
    batch = ctx.get_per_replica_batch_size(global_batch)
    per_step = global_batch // ctx.num_input_pipelines
    largest_share = -(-split.num_examples // ctx.num_input_pipelines)
    padded = -(-largest_share // per_step) * per_step
    ds = _encoded_examples(split, ctx, shuffle_seed=None)
    if cfg.cache:
        ds = ds.cache()
    center = lambda data, label: (center_crop(data, cfg.image_size, cfg.eval_crop_fraction), label, 1.0)  # noqa: E731
    ds = ds.map(center, num_parallel_calls=AUTOTUNE, deterministic=True)
    blank = tf.zeros([cfg.image_size, cfg.image_size, 3], tf.uint8)
    ds = ds.concatenate(tf.data.Dataset.from_tensors((blank, 0, 0.0)).repeat()).take(padded)
    return ds.batch(batch, drop_remainder=True).prefetch(AUTOTUNE)


def synthetic_dataset(cfg: DataConfig, num_classes: int, global_batch: int,
                      input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
    """One random uint8 batch, repeated: training speed with (almost) no input cost."""
    ctx = input_context or tf.distribute.InputContext()
    batch = ctx.get_per_replica_batch_size(global_batch)
    images = tf.random.stateless_uniform([batch, cfg.image_size, cfg.image_size, 3], seed=[0, 1],
                                         maxval=256, dtype=tf.int32)
    labels = tf.random.stateless_uniform([batch], seed=[2, 3], maxval=num_classes, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((tf.cast(images, tf.uint8), labels)).repeat()


def _encoded_examples(split: Split, ctx: tf.distribute.InputContext, shuffle_seed: int | None) -> tf.data.Dataset:
    """(encoded bytes, label) for this pipeline's files: file-level sharding, so workers never overlap."""
    ds = tf.data.Dataset.from_tensor_slices((list(split.files), tf.constant(split.labels, tf.int32)))
    if ctx.num_input_pipelines > 1:
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    if shuffle_seed is not None:
        ds = ds.shuffle(split.num_examples, seed=shuffle_seed, reshuffle_each_iteration=True)
    return ds.map(lambda path, label: (tf.io.read_file(path), label), num_parallel_calls=AUTOTUNE)


def random_crop(data: tf.Tensor, cfg: DataConfig) -> tf.Tensor:
    """Random-resized crop (Inception-style window) plus optional flip, decoding only the window."""
    shape = _image_shape(data)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        min_object_covered=0.0,
        aspect_ratio_range=ASPECT_RATIO_RANGE,
        area_range=(cfg.min_crop_area, cfg.max_crop_area),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    image = _decode_window(data, window)
    image = _resize(image, cfg.image_size)
    if cfg.hflip:
        image = tf.image.random_flip_left_right(image)
    return image


def center_crop(data: tf.Tensor, image_size: int, crop_fraction: float) -> tf.Tensor:
    """Square central crop covering `crop_fraction` of the shorter side, resized."""
    shape = _image_shape(data)
    side = tf.cast(tf.cast(tf.minimum(shape[0], shape[1]), tf.float32) * crop_fraction, tf.int32)
    window = tf.stack([(shape[0] - side) // 2, (shape[1] - side) // 2, side, side])
    return _resize(_decode_window(data, window), image_size)


def _image_shape(data: tf.Tensor) -> tf.Tensor:
    """Height, width, channels read from the header (JPEG) or by decoding (other formats)."""
    return tf.cond(
        tf.io.is_jpeg(data),
        lambda: tf.io.extract_jpeg_shape(data),
        lambda: tf.shape(tf.io.decode_image(data, channels=3, expand_animations=False)),
    )


def _decode_window(data: tf.Tensor, window: tf.Tensor) -> tf.Tensor:
    def other():
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
        return tf.image.crop_to_bounding_box(image, window[0], window[1], window[2], window[3])
    return tf.cond(tf.io.is_jpeg(data), lambda: tf.io.decode_and_crop_jpeg(data, window, channels=3), other)


def _resize(image: tf.Tensor, image_size: int) -> tf.Tensor:
    resized = tf.image.resize(image, [image_size, image_size], method="bilinear", antialias=False)
    out = tf.saturate_cast(tf.round(resized), tf.uint8)
    out.set_shape([image_size, image_size, 3])
    return out
