"""Shares and order: which files each input pipeline reads, and in what order each data epoch reads them.

The stage after the readers (`tfdp.data.readers`, which list where each
record is): a pipeline's share of the split (whole files when there are
enough, else every n-th record), and its record stream from any position,
each data epoch in an order of its own that is a pure function of (seed,
epoch). The stream is built from the readers' payloads alone, reading no
file, so the bounded cache (`tfdp.data.streaming`) can walk a second copy of
it to fetch the files ahead, and a resumed run skips to its position
without reading what it skips.
"""

from __future__ import annotations

import tensorflow as tf
from absl import logging

from tfdp.config import DataConfig
from tfdp.data import readers
from tfdp.data.layouts import Split

MAX_EPOCHS = 1 << 40


def pipeline_share(split: Split, ctx: tf.distribute.InputContext) -> tuple[Split, bool]:
    """This input pipeline's files, and whether records must still be split (data-level sharding).

    File-level sharding is set explicitly: TensorFlow's AUTO policy silently
    falls back to every worker reading every file when it cannot shard files.
    With fewer files than pipelines, every pipeline reads all files and keeps
    every n-th example, which is correct but reads n times the bytes.
    """
    n, i = ctx.num_input_pipelines, ctx.input_pipeline_id
    if n == 1:
        return split, False
    if _by_file(split, n):
        return split.subset(range(i, len(split.files), n)), False
    logging.warning("split '%s' has %d files for %d input pipelines: sharding by example "
                    "(each pipeline reads every file); write more shards to avoid this", split.name, len(split.files), n)
    return split, True


def _by_file(split: Split, n: int) -> bool:
    """The sharding rule `pipeline_share` and `share_sizes` agree on: whole files when there are enough."""
    return len(split.files) >= n


def share_sizes(split: Split, n: int) -> list[int]:
    """Examples each of the `n` input pipelines gets (as `pipeline_share` splits them)."""
    counts = split.file_counts()
    if _by_file(split, n):
        return [sum(counts[i::n]) for i in range(n)]
    total = sum(counts)
    return [len(range(i, total, n)) for i in range(n)]


def image_share(share: Split, ctx: tf.distribute.InputContext, data_shard: bool) -> Split:
    """The image files this pipeline reads: with data-level sharding (fewer files than pipelines) every
    n-th one, as `Dataset.shard` would keep of the (path, label) pairs."""
    if not data_shard:
        return share
    return share.subset(range(ctx.input_pipeline_id, len(share.files), ctx.num_input_pipelines))


def one_pass(share: Split, cfg: DataConfig, ctx: tf.distribute.InputContext, data_shard: bool,
             streamed: bool = False) -> tf.data.Dataset:
    """The share's payloads once, in the split's own order: what evaluation reads (kept in memory after the
    first pass with `data.cache`, which is never streamed). `streamed` as for `epoch_payloads`."""
    ds = readers.payloads(share, cfg, ctx, data_shard, streamed=streamed)
    return readers.cached(ds, share) if cfg.cache else ds


def epoch_payloads(share: Split, cfg: DataConfig, ctx: tf.distribute.InputContext, data_shard: bool,
                   seed: int | None, share_size: int, start: tuple[int, int] = (0, 0),
                   streamed: bool = False) -> tf.data.Dataset:
    """Data epochs `first_epoch`, `first_epoch + 1`, ... of the share's payloads, each in an order of its own,
    from record `offset` of the first (`start` = (first_epoch, offset)). `streamed`: the share's files come
    through the bounded cache (`tfdp.data.streaming`), so the readers name them where it will put them.

    Epoch `e` permutes the files (or shards) with a stateless permutation
    drawn from (`seed`, `e`), then shuffles records through a buffer with a
    fixed seed: a different input order gives a different output order, and
    the same (`seed`, `e`) always the same one, whichever epoch a run starts
    at. (tf.data's own reshuffling draws each epoch's seed from the last,
    which could only be replayed by iterating every earlier epoch.) With
    `data.cache` the cached payloads are reshuffled by tf.data per epoch and
    a resumed stream skips through them: in memory that is cheap. A `seed`
    of None draws every epoch's file order at random where the stream runs.

    Image files are one record each, so their epochs are ordered as file
    numbers (`epoch_numbers`) and a number becomes its (path, label) only
    after the skip: the paths sit in one tensor, made once and captured by
    that last map, never a constant of a per-epoch function. Such a constant
    is copied with every function library tf.data rewrites and instantiates,
    which made start-up grow with the dataset (docs/benchmarks.md, start-up
    on a large tree); numbers also make a resume's skip cheap. The order is
    the one permuting the paths themselves gives.
    """
    first_epoch, offset = start
    buffer = min(cfg.shuffle_buffer, max(share.num_examples, 1))
    repeats = repeated(cfg.repeated_augmentation, share_size)
    if cfg.cache:
        cached = readers.cached(readers.payloads(share, cfg, ctx, data_shard, streamed=streamed), share)
        stream = cached.shuffle(buffer, seed=seed, reshuffle_each_iteration=True).apply(repeats).repeat()
        return stream.skip(first_epoch * share_size + offset)
    if share.kind == "images":
        mine = image_share(share, ctx, data_shard)
        numbers = epoch_numbers(len(mine.files), buffer, cfg, seed, first_epoch, share_size).skip(offset)
        return readers.of_files(mine, cfg, numbers, streamed)

    @tf.autograph.experimental.do_not_convert  # plain Python branches on Python values
    def epoch(e):
        order = tf.stack([_seed_or_random(seed), e])
        return readers.payloads(share, cfg, ctx, data_shard, order, streamed).shuffle(
            buffer, seed=seed, reshuffle_each_iteration=False).apply(repeats)
    return tf.data.Dataset.range(first_epoch, MAX_EPOCHS).flat_map(epoch).skip(offset)


def epoch_numbers(files: int, buffer: int, cfg: DataConfig, seed: int | None, first_epoch: int,
                  epoch_size: int) -> tf.data.Dataset:
    """The file numbers of an image share's record stream from data epoch `first_epoch` on: epoch `e` is
    0..files-1 in the stateless permutation (`seed`, `e`) draws, through a seeded shuffle buffer of `buffer`
    and repeated augmentation (`epoch_payloads`). Integers only: what a resume skips and what `StreamNames`
    replays are these, not paths."""
    repeats = repeated(cfg.repeated_augmentation, epoch_size)

    @tf.autograph.experimental.do_not_convert  # plain Python branches on Python values
    def epoch(e):
        numbers = tf.range(files, dtype=tf.int64)
        if files > 1:
            numbers = tf.random.experimental.index_shuffle(numbers, tf.stack([_seed_or_random(seed), e]), files - 1)
        return tf.data.Dataset.from_tensor_slices(numbers).shuffle(
            buffer, seed=seed, reshuffle_each_iteration=False).apply(repeats)
    return tf.data.Dataset.range(first_epoch, MAX_EPOCHS).flat_map(epoch)


def repeated(k: int, epoch_size: int):
    """Repeated augmentation of one data epoch: its payloads each k times in a row, cut to the epoch's
    size (so the first ceil(size / k) of them). Epochs keep their length and stream positions their
    meaning: a copy is a record of the stream, its crop drawn from its own position. Which images an
    epoch keeps follows its shuffled order, a different subset every epoch. k = 1: the epoch as it is."""
    def apply(ds: tf.data.Dataset) -> tf.data.Dataset:
        if k == 1:
            return ds

        def copies(*element):
            return tf.data.Dataset.from_tensors(element[0] if len(element) == 1 else element).repeat(k)
        return ds.flat_map(copies).take(epoch_size)
    return apply


def _seed_or_random(seed: int | None) -> tf.Tensor:
    """`seed`, or (None) a fresh random one each time the op runs, wherever it runs.

    The raw op with both seeds 0 draws from the OS: the public random ops
    take their seeds from the global seed the trainer sets, so every tf.data
    service worker would draw the same "random" order (see `tfdp.data.service.client`).
    """
    if seed is not None:
        return tf.constant(seed, tf.int64)
    return tf.raw_ops.RandomUniformInt(shape=tf.constant([], tf.int32), minval=tf.constant(0, tf.int64),
                                       maxval=tf.constant(1 << 62, tf.int64), seed=0, seed2=0)


def replayed_epochs(share: Split, cfg: DataConfig, ctx: tf.distribute.InputContext, data_shard: bool,
                    seed: int | None, share_size: int):
    """An image share's training stream replayed as file numbers, nothing read or decoded: (its files, data
    epoch → the numbers of the files that epoch reads, in `epoch_payloads`' order), for naming a corrupt image
    by its position (`tfdp.data.naming.StreamNames`). Beside `epoch_payloads`, whose order it repeats. None
    where there is nothing to replay: records, synthetic, or an order drawn at random (`seed` None)."""
    if share.kind != "images" or seed is None:
        return None
    buffer = min(cfg.shuffle_buffer, max(share.num_examples, 1))  # as `epoch_payloads` sizes it
    files = image_share(share, ctx, data_shard).files   # as `epoch_payloads` lists them

    def order(epoch: int) -> tf.data.Dataset:
        if cfg.cache:  # the cached payloads in listing order, reshuffled by tf.data every epoch
            stream = tf.data.Dataset.range(len(files)).shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
            stream = stream.apply(repeated(cfg.repeated_augmentation, share_size)).repeat()
            return stream.skip(epoch * share_size).take(share_size)
        return epoch_numbers(len(files), buffer, cfg, seed, epoch, share_size).take(share_size)
    return files, order
