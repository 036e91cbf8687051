"""Readers: one per kind of split, each listing where its records are (the first stage after the layouts).

`payloads` lists this input pipeline's share as a dataset of small elements
(a record's shard and byte offset, a tar sample's shard and table row
(Parquet rows too, once unpacked into tar shards), an image file's path and
label, a synthetic example's number), in the order a data epoch's seed
draws. Each element is turned into (image, label) later, by the decoding
stage (`tfdp.data.decoding`). The files are local copies (`storage.localize`),
or, when the bounded cache streams the share (`tfdp.data.streaming`, the
caller says so with `streamed`), the paths the stream will fetch them to,
with records named by number rather than byte offset, since the files are
not there yet. Nothing here branches on the kind after the registry, so
synthetic data runs through the same sharding, batching, corrupt-image
counting and resumable stream positions as real data.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.data.layouts import Split
from tfdp.data.storage import cache_paths, localize
from tfdp.data.layouts.tfrecord import INTERLEAVE_CYCLE, read_record, record_offsets
from tfdp.data.layouts.parquet import unpacked
from tfdp.data.layouts.webdataset import LABEL as SAMPLE_LABEL, make_tables, read_range, sample_table

AUTOTUNE = tf.data.AUTOTUNE


@dataclasses.dataclass(frozen=True)
class Reader:
    # (share, data config, input context, shard by example?, order seed or None, streamed?) → payload dataset
    payloads: Callable[..., tf.data.Dataset]
    # (split, data config, dataset of file numbers, streamed?) → payload dataset: the same payloads, file by
    # file in the order given (an image share's epochs, the tf.data service's distributed_epoch source)
    of_files: Callable[..., tf.data.Dataset] | None = None
    # whether `data.cache` can keep the payloads in memory (a synthetic stream has nothing to read)
    cacheable: bool = True
    # payload dataset → the same with each payload's bytes read in, what `data.cache` keeps (None: as it is)
    fetched: Callable[[tf.data.Dataset], tf.data.Dataset] | None = None


def payloads(share: Split, cfg: DataConfig, ctx: tf.distribute.InputContext, data_shard: bool,
             order_seed: tf.Tensor | None = None, streamed: bool = False) -> tf.data.Dataset:
    return READERS[share.kind].payloads(share, cfg, ctx, data_shard, order_seed, streamed)


def of_files(split: Split, cfg: DataConfig, numbers: tf.data.Dataset, streamed: bool = False) -> tf.data.Dataset:
    """The payloads of `split`'s files numbered `numbers`, file by file in that order."""
    return READERS[split.kind].of_files(split, cfg, numbers, streamed)


def local_paths(urls, cfg: DataConfig, streamed: bool) -> list[str]:
    """Readers' local paths for `urls`: where a streamed share's files will be (nothing is copied: the stream
    fetches them); otherwise `storage.localize`, the whole copy."""
    if streamed:
        return cache_paths(urls, cfg.cache_dir)
    return localize(urls, cfg.cache_dir)


def _places(table, path: str, count: int, streamed: bool) -> np.ndarray:
    """Where a shard's first `count` records are for the reader: `table(path)`'s rows (byte offsets, tar
    sample rows) in a local shard; record numbers in a streamed one, which is not there yet (the stream's
    gate finds their places once it is)."""
    if streamed:
        return np.arange(count, dtype=np.int64)
    return table(path)[0][:count]


def slot_payloads(split: Split, cfg: DataConfig, seed: int, first_slot: int, end_slot: int) -> tf.data.Dataset:
    """Payloads of the whole split for the tf.data service's `distributed_epoch` mode, from file slot
    `first_slot` (inclusive) to `end_slot` (exclusive).

    Slot `g` is place `g mod n` of data epoch `g div n` in that epoch's
    stateless file order, the order `payloads` draws locally for (`seed`,
    epoch). The source is a plain `Dataset.range` of slots, which the
    dispatcher can split: it hands slots (files) to whichever worker asks
    next, so each file is read once per data epoch by exactly one worker. (A
    range of epochs, as the local stream uses, would hand out whole epochs.)
    """
    n = len(split.files)

    def file_number(slot):
        epoch, place = slot // n, tf.math.floormod(slot, n)
        if n < 2:
            return place
        return tf.random.experimental.index_shuffle(place, tf.stack([tf.constant(seed, tf.int64), epoch]), n - 1)
    slots = tf.data.Dataset.range(first_slot, end_slot)
    return of_files(split, cfg, slots.map(file_number))


def cached(ds: tf.data.Dataset, share: Split) -> tf.data.Dataset:
    """`data.cache`: payloads kept in memory after the first pass (image files and records read here, so
    the cache holds their bytes). The cached order is the unshuffled one; training shuffles it per epoch."""
    reader = READERS[share.kind]
    if not reader.cacheable:
        return ds
    return (reader.fetched(ds) if reader.fetched else ds).cache()


# --- TFRecord shards --------------------------------------------------------

def _record_payloads(share, cfg, ctx, data_shard, order_seed, streamed):
    """Where each record is, (shard path, byte offset), the shards in the permutation `order_seed` draws.

    The order is the one reading the shards themselves gives: round robin
    over INTERLEAVE_CYCLE shards, each front to back, then `Dataset.shard`
    for sharding by example. It is deterministic, which sharding by example
    needs: all pipelines see the same sequence. A payload is a location, not
    the record's ~110 KB, so the training shuffle buffer fills in
    microseconds at every data epoch (and holds kilobytes, not a gigabyte),
    a resumed stream skips records without reading them, and the record is
    read inside the parallel decoding map (`tfdp.data.decoding`), as an image
    file is (docs/benchmarks.md, input pipeline). Shards are local files by
    now (`localize`).

    Through the tf.data service (`data.service_address`) the payloads stay
    the serialized records, read in sequence: the trainer names the service
    workers' copies of the shards, which it need not hold, so it cannot read
    their framing.
    """
    return _interleaved(share, cfg, ctx, data_shard, order_seed, _shard_records, streamed)


def _interleaved(share, cfg, ctx, data_shard, order_seed, locations: Callable[..., Callable],
                 streamed: bool) -> tf.data.Dataset:
    """The shards in the permutation `order_seed` draws, INTERLEAVE_CYCLE at a time, each giving its
    `locations` front to back; split by example for sharding by example."""
    files = local_paths(share.files, cfg, streamed)
    ds = tf.data.Dataset.from_tensor_slices(_permuted(tf.range(len(files), dtype=tf.int64), order_seed)).interleave(
        locations(files, share.counts, cfg, streamed), cycle_length=min(len(files), INTERLEAVE_CYCLE))
    return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id) if data_shard else ds


def _record_files(split, cfg, numbers, streamed):
    return numbers.interleave(_shard_records(local_paths(split.files, cfg, streamed), split.counts, cfg, streamed),
                              cycle_length=min(len(split.files), INTERLEAVE_CYCLE))


def _shard_records(files: list[str], counts: tuple[int, ...], cfg: DataConfig,
                   streamed: bool) -> Callable[..., tf.data.Dataset]:
    """shard number → its records front to back: their (path, byte offset) pairs, the first `counts[i]`
    complete records of shard i (`Split.counts`, what the epoch's size counts); through the tf.data service,
    the serialized records themselves.

    The offset tables are made eagerly (`init_scope`), so a function that
    builds the stream (a data epoch's) captures them as inputs rather than
    holding a constant of a million offsets that tf.data would copy into
    every function library it rewrites.
    """
    if cfg.service_address:
        with tf.init_scope():
            paths = tf.constant(files)
        return lambda number: tf.data.TFRecordDataset(paths[number])
    return _table_locations(files, [_places(record_offsets, f, count, streamed) for f, count in zip(files, counts)])


def _table_locations(files: list[str], tables: list[np.ndarray]) -> Callable[..., tf.data.Dataset]:
    """shard number → (its path, each row of its table): a record's offset, a tar sample's row. The tables
    are made eagerly (see `_shard_records`)."""
    with tf.init_scope():
        paths = tf.constant(files)
        flat = tf.constant(np.concatenate(tables) if tables else np.zeros([0], np.int64))
        bounds = tf.constant(np.cumsum([0] + [len(t) for t in tables]), tf.int64)

    def locations(number):
        first, end = bounds[number], bounds[number + 1]
        return tf.data.Dataset.from_tensor_slices((tf.fill([end - first], paths[number]), flat[first:end]))
    return locations


def _fetched_records(ds: tf.data.Dataset) -> tf.data.Dataset:
    if not isinstance(ds.element_spec, tuple):   # the records themselves already (through the service)
        return ds
    return ds.map(read_record, num_parallel_calls=AUTOTUNE)


# --- WebDataset tar shards --------------------------------------------------

def _tar_payloads(share, cfg, ctx, data_shard, order_seed, streamed):
    """(shard path, sample table row), the shards drawn and interleaved as TFRecord shards are
    (`_record_payloads`): a row locates the image's bytes and holds its label (`layouts.webdataset`), so the
    image is read where it is decoded and a resumed stream skips samples without reading them."""
    return _interleaved(share, cfg, ctx, data_shard, order_seed, _shard_samples, streamed)


def _shard_samples(files: list[str], counts: tuple[int, ...], cfg: DataConfig,
                   streamed: bool) -> Callable[..., tf.data.Dataset]:
    """shard number → its first `counts[i]` samples' rows (sample numbers in a streamed shard). Tables not yet
    made (shards copied from a bucket now) are made together first (`webdataset.make_tables`)."""
    make_tables(files)
    return _table_locations(files, [_places(sample_table, f, count, streamed) for f, count in zip(files, counts)])


def _parquet_payloads(share, cfg, ctx, data_shard, order_seed, streamed):
    """A Parquet split's files, once local, unpacked into tar shards (`layouts.parquet.unpack`), then read as tar
    shards are (`_tar_payloads`)."""
    def locations(files, counts, cfg, streamed):
        return _shard_samples(unpacked(files, share.parquet, cfg.cache_dir), counts, cfg, streamed)
    return _interleaved(share, cfg, ctx, data_shard, order_seed, locations, streamed)


def read_sample(path: tf.Tensor, row: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """A tar sample's (image bytes, label) from its shard and table row."""
    return read_range(path, row), tf.cast(row[SAMPLE_LABEL], tf.int32)


def _fetched_samples(ds: tf.data.Dataset) -> tf.data.Dataset:
    return ds.map(read_sample, num_parallel_calls=AUTOTUNE)


# --- one image per file -----------------------------------------------------

def _image_payloads(share, cfg, ctx, data_shard, order_seed, streamed):
    """(image file path, label) pairs; the file is read inside the decoding map, not a map of its own,
    which saves one function call per image (docs/benchmarks.md, input pipeline)."""
    files, labels = local_paths(share.files, cfg, streamed), share.labels
    if data_shard:  # as Dataset.shard on the pairs
        files = files[ctx.input_pipeline_id::ctx.num_input_pipelines]
        labels = labels[ctx.input_pipeline_id::ctx.num_input_pipelines]
    return tf.data.Dataset.from_tensor_slices(
        (_permuted(tf.constant(files), order_seed), _permuted(tf.constant(labels, tf.int32), order_seed)))


def _image_files(split, cfg, numbers, streamed):
    files, labels = tf.constant(local_paths(split.files, cfg, streamed)), tf.constant(split.labels, tf.int32)
    return numbers.map(lambda i: (tf.gather(files, i), tf.gather(labels, i)))


# --- IDX files (MNIST's family): pixels in memory --------------------------

def _idx_payloads(share, cfg, ctx, data_shard, order_seed, streamed):
    """Image numbers, in the stateless order `order_seed` draws: the pixels are in memory (`tfdp.data.decoding`), so
    a payload is only a number, what a resumed stream skips and the shuffle buffer holds."""
    numbers = _permuted(tf.range(sum(share.counts), dtype=tf.int64), order_seed)
    ds = tf.data.Dataset.from_tensor_slices(numbers)
    return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id) if data_shard else ds


# --- synthetic --------------------------------------------------------------

def _synthetic_payloads(share, cfg, ctx, data_shard, order_seed, streamed):
    """Example numbers: a synthetic split's "files" are only its sizes (see `tfdp.data.synthetic_split`)."""
    ds = tf.data.Dataset.range(sum(share.counts))
    return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id) if data_shard else ds


def _synthetic_files(split, cfg, numbers, streamed):
    """Part i's examples, numbered as `_synthetic_payloads` numbers the whole split's."""
    counts = tf.constant(split.counts, tf.int64)
    starts = tf.cumsum(counts, exclusive=True)
    return numbers.flat_map(lambda i: tf.data.Dataset.range(starts[i], starts[i] + counts[i]))


def _permuted(values: tf.Tensor, seed: tf.Tensor | None) -> tf.Tensor:
    """`values` in the stateless random order `seed` draws (unchanged without a seed)."""
    n = int(values.shape[0])
    if seed is None or n < 2:
        return values
    return tf.gather(values, tf.random.experimental.index_shuffle(tf.range(n, dtype=tf.int64), seed, n - 1))


READERS: dict[str, Reader] = {
    "records": Reader(_record_payloads, _record_files, fetched=_fetched_records),
    "tar": Reader(_tar_payloads, fetched=_fetched_samples),
    "parquet": Reader(_parquet_payloads, fetched=_fetched_samples),
    "images": Reader(_image_payloads, _image_files, fetched=lambda ds: ds.map(
        lambda path, label: (tf.io.read_file(path), label), num_parallel_calls=AUTOTUNE)),
    "idx": Reader(_idx_payloads, _synthetic_files, cacheable=False),
    "synthetic": Reader(_synthetic_payloads, _synthetic_files, cacheable=False),
}
