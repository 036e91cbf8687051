"""Decoding: each payload the readers listed (its bytes, once streamed or cached) into (index, image, label).

The stage after the readers and the bounded cache: one example function per
kind of split turns a payload into (image, label), calling the transform it
is handed (`tfdp.data.preprocess`: a crop on the tf path, the check of the
encoded bytes with DALI) on the encoded bytes or, for IDX files, the pixels.
A payload that fails to decode is dropped (`ignore_errors`), leaving a gap in
the running index that the batching stage counts as a corrupt image
(`tfdp.data.batching.tallied`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.data.layouts import Split
from tfdp.data.layouts.tfrecord import parse_record, read_record
from tfdp.data.preprocess import host_cores
from tfdp.data.readers import read_sample

SYNTHETIC_BANK = 16   # distinct synthetic images, cycled: generating pixels per example would cost host CPU


def decode_calls() -> int:
    """Decodes in flight. The map keeps element order (corrupt images are counted from gaps in it), so
    one slow image holds back finished ones; with AUTOTUNE's limit of one call per core a core then
    idles. Three per core keeps both busy (the gain is in docs/benchmarks.md, input pipeline)."""
    return 3 * host_cores()


def decoded_examples(ds: tf.data.Dataset, share: Split, cfg: DataConfig, transform, num_classes: int,
                     first: int = 0, ending: tf.data.Dataset | None = None) -> tf.data.Dataset:
    """(record index, image, label) for every payload that decodes; corrupt ones are dropped, leaving a gap
    in the index that `tfdp.data.batching.tallied` counts. `first` is the stream position of the first payload.

    `ending`, from a stream that fetches the share through the bounded cache
    (`tfdp.data.streaming.Stream.ending`), is empty or raises why fetching
    failed: it follows `ignore_errors`, so its error reaches the user.
    """
    example = example_fn(share, cfg, num_classes)

    def decode(index, element):
        return (index, *example(element, index, transform))
    ds = ds.enumerate(start=first).map(decode, num_parallel_calls=decode_calls(), deterministic=True).ignore_errors()
    if ending is None:
        return ds

    def nothing(_):
        return tf.nest.map_structure(lambda spec: tf.zeros([d or 0 for d in spec.shape], spec.dtype), ds.element_spec)
    return ds.concatenate(ending.map(nothing))


def example_fn(share: Split, cfg: DataConfig, num_classes: int) -> Callable:
    """(element, record index, transform) → (image, label) for a payload of `share`'s kind."""
    return EXAMPLES[share.kind](share, cfg, num_classes)


def _record_example(share, cfg, num_classes):
    def example(element, index, transform):
        # a location (see `tfdp.data.readers`), or the record itself (through the service, or from `readers.cached`)
        serialized = read_record(*element) if isinstance(element, tuple) else element
        encoded, label = parse_record(serialized, share.records)
        return transform(encoded, index), label
    return example


def _tar_example(share, cfg, num_classes):
    def example(element, index, transform):
        where = element[1]
        if where.shape.rank == 1:   # a table row (`tfdp.data.readers`)
            encoded, label = read_sample(*element)
        else:   # the image's bytes and its label: streamed (`streaming`) or cached (`readers.cached`)
            encoded, label = element
        return transform(encoded, index), label
    return example


def _image_example(share, cfg, num_classes):
    def example(element, index, transform):
        payload, label = element
        if not cfg.cache:  # a path; with data.cache, the file's bytes (see `readers.cached`)
            payload = tf.io.read_file(payload)
        return transform(payload, index), label
    return example


def _idx_example(share, cfg, num_classes):
    """Image n of the split's IDX file: its greyscale pixels, replicated to the pipeline's three channels and
    handed to the transform as pixels (it crops and resizes them; nothing is decoded). The arrays are made
    eagerly, so the stream's functions capture them as inputs (as `tfdp.data.readers` makes its shard tables)."""
    from tfdp.data.layouts.idx import read_images, read_labels
    with tf.init_scope():
        images = tf.constant(read_images(share.idx.images, cfg.cache_dir))
        labels = tf.constant(read_labels(share.idx.labels).astype(np.int32))

    def example(element, index, transform):
        grey = tf.gather(images, element)[..., None]
        return transform(tf.tile(grey, [1, 1, 3]), index), tf.gather(labels, element)
    return example


def _synthetic_example(share, cfg, num_classes):
    """Example n: image n mod SYNTHETIC_BANK of a fixed random bank, a label hashed from n. No decoding and
    no preprocessing, so the stream costs the host almost nothing, as synthetic data should."""
    size = cfg.image_size
    bank = tf.cast(tf.random.stateless_uniform([SYNTHETIC_BANK, size, size, 3], seed=[0, 1], maxval=256,
                                               dtype=tf.int32), tf.uint8)
    classes = max(num_classes, 1)

    def example(element, index, transform):
        label = tf.cast(tf.math.floormod(element * 2654435761, classes), tf.int32)
        return tf.gather(bank, tf.math.floormod(element, SYNTHETIC_BANK)), label
    return example


# Split.kind → (share, data config, number of classes) → (element, record index, transform) → (image, label)
EXAMPLES: dict[str, Callable[..., Callable]] = {
    "records": _record_example,
    "tar": _tar_example,
    "parquet": _tar_example,
    "images": _image_example,
    "idx": _idx_example,
    "synthetic": _synthetic_example,
}
