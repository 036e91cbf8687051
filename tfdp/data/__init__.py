"""Data: a registry of source layouts (name → builder) and the tf.data pipeline.

A builder turns `DataConfig` into a `Source` (class list and, per split, the
files to read); `tfdp.data.pipeline` turns a split into batches.
"""

from __future__ import annotations

from typing import Callable

from tfdp.config import DataConfig
from tfdp.data import storage
from tfdp.data.layouts import RecordFormat, Source, Split, image_folder
from tfdp.errors import UserError


def _digits(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    """The embedded demo: scikit-learn's digits, written as JPEGs on first use."""
    from tfdp.data.layouts.digits import ensure_digits
    return image_folder(ensure_digits(cfg.dir), splits)


def _image_folder(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    """`DIR/<split>/<class>/<image>`; with data.val_fraction, one tree `DIR/<class>/<image>` split by it."""
    if cfg.val_fraction:
        from tfdp.data.layouts.holdout import held_out
        return held_out(cfg.dir, splits, cfg.train_split, cfg.val_split, cfg.val_fraction, cfg.val_seed)
    return image_folder(cfg.dir, splits)


def _csv(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    """Images listed with their labels in `<split>.csv` files; classes from training's and validation's labels."""
    from tfdp.data.layouts.csv_labels import csv_source
    return csv_source(cfg.dir, splits, (cfg.train_split, cfg.val_split))


def _imagenet(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    from tfdp.data.layouts.imagenet import imagenet_tree
    return imagenet_tree(cfg.dir, splits)


def _tfrecord(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    from tfdp.data.layouts.records import tfrecord_source
    return tfrecord_source(cfg.dir, splits, cfg.cache_dir)


def _wds(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    """WebDataset tar shards (timm's `wds/` datasets): an image and its `.cls` (or `.json` field) per sample."""
    from tfdp.data.layouts.webdataset import wds_source
    return wds_source(cfg.dir, splits, cfg.cache_dir, cfg.label_key)


def _parquet(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    """Parquet files of images and labels (the Hugging Face Hub's datasets), unpacked into tar shards to read."""
    from tfdp.data.layouts.parquet import parquet_source
    return parquet_source(cfg.dir, splits, cfg.cache_dir, (cfg.train_split, cfg.val_split))


def _tfds(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    from tfdp.data.layouts.tfds import tfds_source
    return tfds_source(cfg.dir, cfg.tfds_name, splits, cfg.cache_dir, cfg.tfds_manual_dir)


def _idx(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    """MNIST-family IDX files (`<prefix>-images-idx3-ubyte[.gz]` and its labels), read as pixels, no decoding."""
    from tfdp.data.layouts.idx import idx_source
    return idx_source(cfg.dir, splits)


def _synthetic(cfg: DataConfig, splits: tuple[str, ...]) -> Source:
    """Random images made in the pipeline: measures compute without input cost. Classes: the model's."""
    sizes = {cfg.train_split: cfg.synthetic_examples, cfg.val_split: max(cfg.synthetic_examples // 25, 1)}
    return Source(class_names=(), splits={name: synthetic_split(name, sizes.get(name, 1)) for name in splits})


def synthetic_split(name: str, examples: int, parts: int = 1024) -> Split:
    """A split of `examples` synthetic examples in `parts` equal parts, so that every input pipeline gets
    whole parts, as it would get whole shards of real data (ImageNet has 1,024 training shards)."""
    parts = max(1, min(parts, examples))
    counts = tuple(len(range(i, examples, parts)) for i in range(parts))
    return Split(name, tuple(f"synthetic-{i:05d}-of-{parts:05d}" for i in range(parts)), counts=counts, synthetic=True)


SOURCES: dict[str, Callable[[DataConfig, tuple[str, ...]], Source]] = {
    "digits": _digits,
    "image_folder": _image_folder,
    "csv": _csv,
    "imagenet": _imagenet,
    "tfrecord": _tfrecord,
    "wds": _wds,
    "parquet": _parquet,
    "tfds": _tfds,
    "idx": _idx,
    "synthetic": _synthetic,
}


def build_source(cfg: DataConfig, splits: tuple[str, ...] | None = None) -> Source:
    """The dataset in `cfg`, listing only `splits` (default: the training and validation splits).

    A command lists only what it reads: evaluation the validation split, so
    it works when the training split is empty or in a bucket out of reach.
    """
    if cfg.format not in SOURCES:
        raise UserError(f"unknown data.format '{cfg.format}' (valid: {', '.join(sorted(SOURCES))})")
    storage.configure(cfg.remote_timeout)
    return SOURCES[cfg.format](cfg, splits or (cfg.train_split, cfg.val_split))


def check_reachable(cfg: DataConfig) -> None:
    """Fails fast, before TensorFlow starts, when data.dir is in a bucket nobody answers for."""
    if cfg.format in SOURCES and cfg.format != "synthetic":
        storage.configure(cfg.remote_timeout)
        storage.filesystem(cfg.dir)


__all__ = ["SOURCES", "RecordFormat", "Source", "Split", "build_source"]
