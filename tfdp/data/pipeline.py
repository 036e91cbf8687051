"""tf.data pipelines: files → decoded, cropped uint8 batches, counted and resumable.

The pipeline is assembled from small parts: a reader per kind of split
(`tfdp.data.readers`: records, tar samples, image files, synthetic) yields payloads and
turns each into an example with the preprocessing function it is handed
(`tfdp.data.preprocess`: random-resized crop for training, central crop for
evaluation). This module only shards, orders, batches and counts. Images
leave as uint8 and are flipped, augmented and normalised by the model's
first layers on the device, which keeps per-pixel work off the CPU.

Each function taking an `input_context` is meant for
`strategy.distribute_datasets_from_function`: it builds one input pipeline's
share and batches by the per-replica batch size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import sys

import numpy as np
import tensorflow as tf
from absl import logging

from tfdp.config import DataConfig
from tfdp.data import readers, streaming
from tfdp.data.corrupt import LOG as CORRUPT_LOG, decode_error
from tfdp.data.dali import DECODERS, dali_stopped
from tfdp.data.preprocess import host_cores
from tfdp.data.layouts import Split
from tfdp.errors import StorageLost, UserError
from tfdp.config.image_sizes import eval_image_size

AUTOTUNE = tf.data.AUTOTUNE


def decode_calls() -> int:
    """Decodes in flight. The map keeps element order (corrupt images are counted from gaps in it), so
    one slow image holds back finished ones; with AUTOTUNE's limit of one call per core a core then
    idles. Three per core keeps both busy (the gain is in docs/benchmarks.md, input pipeline)."""
    return 3 * host_cores()


class CorruptCounter:
    """Images that failed to decode, counted by the input pipeline and read by the trainer.

    Create it outside any strategy scope: it is one plain host variable per
    process, not a mirrored one.
    """

    def __init__(self):
        with tf.init_scope():
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False, name="corrupt_images")

    def value(self) -> int:
        return int(self.count.numpy())


class StreamPosition:
    """Where each training batch ended in this input pipeline's record stream.

    The pipeline runs ahead of training (prefetching), so the position after
    the last *trained* batch cannot be read off the pipeline at checkpoint
    time. Instead every batch writes (its number, the stream position after
    it, corrupt images so far) into a ring of `RING` slots, and the trainer
    looks up the batch it has just trained. Positions count records, corrupt
    ones included, so a resumed stream skips exactly what was consumed.
    """

    RING = 4096  # far more batches than any prefetch buffer holds

    def __init__(self):
        with tf.init_scope():
            self.slots = tf.Variable(tf.fill([self.RING, 3], tf.constant(-1, tf.int64)), trainable=False,
                                     name="stream_position")

    def record(self, batch_number: tf.Tensor, position: tf.Tensor, bad: tf.Tensor):
        slot = tf.math.floormod(batch_number, self.RING)
        return self.slots.scatter_nd_update([[slot]], [tf.stack([batch_number, position, bad])])

    def after(self, batches: int) -> tuple[int, int]:
        """(records consumed, corrupt images) after the first `batches` batches of this stream."""
        if batches == 0:
            return 0, 0
        number, position, bad = (int(v) for v in self.slots[(batches - 1) % self.RING].numpy())
        if number != batches - 1:
            raise RuntimeError(f"stream position of batch {batches - 1} is no longer known (slot holds {number})")
        return position, bad


@dataclasses.dataclass(frozen=True)
class Bookkeeping:
    """The trainer's side of one training stream: where it starts and what it keeps count of.

    `start` is (records consumed, corrupt images so far) of the stream;
    `position`, if given, records where each batch ended (what a checkpoint
    stores); `corrupt` is the run's running total of corrupt images (None:
    not counted here); labels are checked against `num_classes` (0: not);
    `cache_part` is the share of `data.cache_limit` a stream from a bucket
    may hold (a run's validation stream holds the rest).
    """
    start: tuple[int, int] = (0, 0)
    position: StreamPosition | None = None
    corrupt: CorruptCounter | None = None
    num_classes: int = 0
    cache_part: streaming.Part = streaming.WHOLE


def train_dataset(split: Split, cfg: DataConfig, global_batch: int, seed: int,
                  input_context: tf.distribute.InputContext | None = None,
                  books: Bookkeeping = Bookkeeping()) -> tf.data.Dataset:
    """Endless shuffled, cropped batches of this input pipeline's share of `split`.

    The record stream is a pure function of (`seed`, position): data epoch `e`
    is the share shuffled with a seed derived from (`seed`, `e`), and under
    `data.deterministic` every crop window is drawn from (`seed`, the record's
    position). A run resumed at `books.start` = (records consumed, corrupt
    images so far) therefore continues with exactly the batches the
    uninterrupted run would have trained on, and reaches that point by
    skipping whole data epochs and then records, before any image is read or
    decoded. `books.position`, if given, records where each batch ended. A
    share in a bucket larger than `data.cache_limit` is read through the
    bounded cache (`tfdp.data.streaming`), example for example the same.
    """
    ctx = input_context or tf.distribute.InputContext()
    share, data_shard = pipeline_share(split, ctx)
    share_size = share_sizes(split, ctx.num_input_pipelines)[ctx.input_pipeline_id]
    consumed, bad = books.start
    first_epoch, offset = divmod(consumed, max(share_size, 1))
    ds, stream = streaming.payloads(share, cfg, seed is not None, functools.partial(
        epoch_payloads, share, cfg, ctx, data_shard, seed, first_epoch, share_size, offset),
        part=books.cache_part)
    transform = DECODERS[cfg.decoder].transform(cfg, seed)  # dali: the checked bytes, decoded after (tfdp.data.dali)
    ds = stream.examples(decoded_examples(ds, share, stream.decoding(cfg), transform, books.num_classes,
                                          first=consumed))
    names = StreamNames.of_training(share, cfg, ctx, data_shard, seed, share_size)
    on_gap = corrupt_namer(names, cfg, transform, stream)
    ds = _replica_batches(ds, cfg, ctx, global_batch, first=consumed, on_gap=on_gap)
    tally = Tally(books.num_classes, cfg.max_bad_fraction, share_size, books.corrupt, books.position,
                  named=on_gap is not None)
    return checked(ds, tally, start=(consumed, bad)).prefetch(AUTOTUNE)


def streams_dataset(split: Split, cfg: DataConfig, global_batch: int, seed: int, count: int,
                    streams: dict[int, Bookkeeping], input_context: tf.distribute.InputContext) -> tf.data.Dataset:
    """This worker's per-replica batches read from several of the run's `count` input streams (`tfdp.train.input_streams`).

    Stream s is exactly the pipeline worker s of a `count`-worker run builds
    (file share s, its seeded order and crops, its position), batched by
    global_batch / count: one block per step. Each step joins one block of
    every stream in `streams` (stream → its bookkeeping, in the order they
    are joined) and cuts the result into this worker's per-replica batches,
    so the step holds the examples it holds on the layout the streams were
    made for. Give the corrupt-image counter to one stream's books: it is
    one running total.
    """
    blocks = []
    for stream, books in streams.items():
        ctx = tf.distribute.InputContext(num_input_pipelines=count, input_pipeline_id=stream,
                                         num_replicas_in_sync=count)
        blocks.append(train_dataset(split, cfg, global_batch, seed, ctx, books))
    joined = tf.data.Dataset.zip(tuple(blocks)).map(
        lambda *parts: tuple(tf.concat([p[j] for p in parts], 0) for j in range(2)))
    per_replica = input_context.get_per_replica_batch_size(global_batch)
    return joined.unbatch().batch(per_replica, drop_remainder=True).prefetch(AUTOTUNE)


def _replica_batches(ds: tf.data.Dataset, cfg: DataConfig, ctx: tf.distribute.InputContext, global_batch: int,
                     first: int, on_gap=None) -> tf.data.Dataset:
    """(index, image, label) examples → `tallied` per-replica batches, in the order the replicas take them.

    Each step takes one batch per local replica, in turn. With repeated
    augmentation a step's batches are cut from one block of examples dealt
    round-robin (example j of the block to replica j mod n, as DeiT's sampler
    gives rank r the indices r, r + n, ...), so the consecutive copies of an
    image land on different replicas. The block's accounting rides on its
    last batch: the stream position after a whole step stays exact.
    """
    per_replica = ctx.get_per_replica_batch_size(global_batch)
    local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
    if cfg.repeated_augmentation == 1 or local == 1:
        return tallied(ds.batch(per_replica, drop_remainder=True), first=first, on_gap=on_gap)
    blocks = tallied(ds.batch(per_replica * local, drop_remainder=True), first=first, on_gap=on_gap)
    return blocks.flat_map(lambda images, labels, counts: tf.data.Dataset.from_tensor_slices(
        (_dealt(images, local), _dealt(labels, local), _last_of(counts, local))))


def _dealt(block: tf.Tensor, n: int) -> tf.Tensor:
    """[n * b, ...] → [n, b, ...] with element j of the block in row j mod n."""
    rank = block.shape.rank
    rows = tf.reshape(block, tf.concat([[-1, n], tf.shape(block)[1:]], 0))
    return tf.transpose(rows, [1, 0, *range(2, rank + 1)])


def _last_of(counts: tf.Tensor, n: int) -> tf.Tensor:
    """A block's [records, corrupt] as n batches' accounts: all of it on the last, zero on the others."""
    return tf.concat([tf.zeros([n - 1, 2], counts.dtype), counts[None]], 0)


def epoch_payloads(share: Split, cfg: DataConfig, ctx: tf.distribute.InputContext, data_shard: bool,
                   seed: int | None, first_epoch: int, share_size: int, offset: int = 0) -> tf.data.Dataset:
    """Data epochs `first_epoch`, `first_epoch + 1`, ... of the share's payloads, each in an order of its own,
    from record `offset` of the first.

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
    buffer = min(cfg.shuffle_buffer, max(share.num_examples, 1))
    repeated = _repeated(cfg.repeated_augmentation, share_size)
    if cfg.cache:
        cached = readers.cached(readers.payloads(share, cfg, ctx, data_shard), share)
        stream = cached.shuffle(buffer, seed=seed, reshuffle_each_iteration=True).apply(repeated).repeat()
        return stream.skip(first_epoch * share_size + offset)
    if share.kind == "images":
        mine = image_share(share, ctx, data_shard)
        numbers = epoch_numbers(len(mine.files), buffer, cfg, seed, first_epoch, share_size).skip(offset)
        return readers.READERS[mine.kind].of_files(mine, cfg, numbers)

    @tf.autograph.experimental.do_not_convert  # plain Python branches on Python values
    def epoch(e):
        order = tf.stack([_seed_or_random(seed), e])
        return readers.payloads(share, cfg, ctx, data_shard, order_seed=order).shuffle(
            buffer, seed=seed, reshuffle_each_iteration=False).apply(repeated)
    return tf.data.Dataset.range(first_epoch, MAX_EPOCHS).flat_map(epoch).skip(offset)


def image_share(share: Split, ctx: tf.distribute.InputContext, data_shard: bool) -> Split:
    """The image files this pipeline reads: with data-level sharding (fewer files than pipelines) every
    n-th one, as `Dataset.shard` would keep of the (path, label) pairs."""
    if not data_shard:
        return share
    return share.subset(range(ctx.input_pipeline_id, len(share.files), ctx.num_input_pipelines))


def epoch_numbers(files: int, buffer: int, cfg: DataConfig, seed: int | None, first_epoch: int,
                  epoch_size: int) -> tf.data.Dataset:
    """The file numbers of an image share's record stream from data epoch `first_epoch` on: epoch `e` is
    0..files-1 in the stateless permutation (`seed`, `e`) draws, through a seeded shuffle buffer of `buffer`
    and repeated augmentation (`epoch_payloads`). Integers only: what a resume skips and what `StreamNames`
    replays are these, not paths."""
    repeated = _repeated(cfg.repeated_augmentation, epoch_size)

    @tf.autograph.experimental.do_not_convert  # plain Python branches on Python values
    def epoch(e):
        numbers = tf.range(files, dtype=tf.int64)
        if files > 1:
            numbers = tf.random.experimental.index_shuffle(numbers, tf.stack([_seed_or_random(seed), e]), files - 1)
        return tf.data.Dataset.from_tensor_slices(numbers).shuffle(
            buffer, seed=seed, reshuffle_each_iteration=False).apply(repeated)
    return tf.data.Dataset.range(first_epoch, MAX_EPOCHS).flat_map(epoch)


def _repeated(k: int, epoch_size: int):
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


MAX_EPOCHS = 1 << 40


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


def eval_dataset(split: Split, cfg: DataConfig, global_batch: int,
                 input_context: tf.distribute.InputContext | None = None, *,
                 num_classes: int = 0, corrupt: CorruptCounter | None = None,
                 cache_part: streaming.Part = streaming.WHOLE) -> tf.data.Dataset:
    """One pass over this pipeline's share of `split` as (image, label, weight), every example once.

    The share is padded with weight-0 images up to the same whole number of
    full steps on every input pipeline, so no replica ever gets a partial or
    empty batch (which TensorFlow's oneDNN kernels mishandle, and which would
    leave multi-worker collectives waiting on a worker with fewer steps), and
    metrics weighted by `weight` count each real image exactly once. A corrupt
    image is counted and replaced by such a padding image. Images come at
    `data.eval_image_size` (0: `data.image_size`); with `data.decoder: dali`
    they come as their checked encoded bytes, for DALI to decode
    (`tfdp.data.dali.distribute_evaluation`). A share in a bucket larger
    than its `cache_part` of `data.cache_limit` is streamed through the
    bounded cache (`tfdp.data.streaming`), in the same order.
    """
    cfg = dataclasses.replace(cfg, image_size=eval_image_size(cfg))  # every reader's images, synthetic ones too
    ctx = input_context or tf.distribute.InputContext()
    batch = ctx.get_per_replica_batch_size(global_batch)
    per_step = global_batch // ctx.num_input_pipelines
    sizes = share_sizes(split, ctx.num_input_pipelines)
    padded = -(-max(sizes) // per_step) * per_step
    share, data_shard = pipeline_share(split, ctx)
    ds, stream = streaming.payloads(share, cfg, True, lambda: readers.payloads(share, cfg, ctx, data_shard),
                                    endless=False, part=cache_part)
    ds = readers.cached(ds, share) if cfg.cache else ds
    transform, blank = DECODERS[cfg.decoder].evaluation(cfg)   # dali: checked bytes, decoded after (tfdp.data.dali)
    ds = stream.examples(decoded_examples(ds, share, stream.decoding(cfg), transform, num_classes)).batch(batch)
    names = StreamNames.of_evaluation(share, ctx, data_shard)
    on_gap = corrupt_namer(names, cfg, transform, stream)
    ds = _counted(ds, Tally(num_classes, cfg.max_bad_fraction, sizes[ctx.input_pipeline_id], corrupt,
                            named=on_gap is not None), on_gap=on_gap)
    padding = tf.data.Dataset.from_tensors((blank, 0, 0.0)).repeat()
    ds = ds.unbatch().map(lambda image, label: (image, label, 1.0)).concatenate(padding).take(padded)
    return ds.batch(batch, drop_remainder=True).prefetch(AUTOTUNE)


def prediction_dataset(files: list[str], cfg: DataConfig, global_batch: int,
                       ctx: "tf.distribute.InputContext") -> "tf.data.Dataset":
    """This input pipeline's share of `files` as per-replica batches of (image number, uint8 image).

    Image i goes to pipeline i mod n. Every pipeline pads its share with
    number -1 up to the same whole number of steps, so every replica gets
    full batches (as `eval_dataset`). An image that cannot be read
    or decoded is left out (its number never comes back; `predict` explains
    it) and the padding makes up for it. Numbers travel with the images, so
    decoding need not keep their order. With `data.decoder: dali` the images
    come as their checked encoded bytes, for DALI to decode
    (`tfdp.data.dali.distribute_prediction`).
    """
    transform, blank = evaluation_decoding(cfg)
    n, i = ctx.num_input_pipelines, ctx.input_pipeline_id
    batch = ctx.get_per_replica_batch_size(global_batch)
    per_step = batch * (ctx.num_replicas_in_sync // n)
    padded = -(-len(range(0, len(files), n)) // per_step) * per_step
    numbers = tf.constant(np.arange(len(files), dtype=np.int64)[i::n], tf.int64)
    paths = tf.constant(files[i::n], tf.string)

    ds = tf.data.Dataset.from_tensor_slices((numbers, paths)).map(
        lambda k, p: (k, transform(tf.io.read_file(p), k)), num_parallel_calls=decode_calls(),
        deterministic=False).ignore_errors()
    padding = tf.data.Dataset.from_tensors((tf.constant(-1, tf.int64), blank)).repeat()
    return ds.concatenate(padding).take(padded).batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def evaluation_decoding(cfg: DataConfig):
    """`data.decoder`'s (transform, padding image) at `data.eval_image_size`, for images with no training crop
    (prediction; `eval_dataset` resizes its config itself): with dali, the check before DALI and a blank JPEG."""
    return DECODERS[cfg.decoder].evaluation(dataclasses.replace(cfg, image_size=eval_image_size(cfg)))


def synthetic_dataset(cfg: DataConfig, num_classes: int, global_batch: int,
                      input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
    """One random uint8 batch, repeated: what benchmarks use to time the model with no input pipeline at all.

    (`data.format: synthetic` is different: a source whose examples run
    through the whole pipeline, see `tfdp.data.readers`.)
    """
    ctx = input_context or tf.distribute.InputContext()
    batch = ctx.get_per_replica_batch_size(global_batch)
    images = tf.random.stateless_uniform([batch, cfg.image_size, cfg.image_size, 3], seed=[0, 1],
                                         maxval=256, dtype=tf.int32)
    labels = tf.random.stateless_uniform([batch], seed=[2, 3], maxval=max(num_classes, 1), dtype=tf.int32)
    return tf.data.Dataset.from_tensors((tf.cast(images, tf.uint8), labels)).repeat()


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


def decoded_examples(ds: tf.data.Dataset, share: Split, cfg: DataConfig, transform, num_classes: int,
                     first: int = 0) -> tf.data.Dataset:
    """(record index, image, label) for every payload that decodes; corrupt ones are dropped, leaving a gap
    in the index that `_counted` counts. `first` is the stream position of the first payload."""
    example = readers.example_fn(share, cfg, num_classes)

    def decode(index, element):
        return (index, *example(element, index, transform))
    return ds.enumerate(start=first).map(decode, num_parallel_calls=decode_calls(), deterministic=True).ignore_errors()


@dataclasses.dataclass(frozen=True)
class Tally:
    """What `_counted` checks batches against and where it reports."""
    num_classes: int                  # labels must lie in 0..num_classes-1 (0: unknown, unchecked)
    max_bad_fraction: float           # data.max_bad_fraction
    share_examples: int               # the bound applies to at least this many records
    corrupt: CorruptCounter | None = None
    position: StreamPosition | None = None
    # Each corrupt image is named in the corrupt-image log as it is met (a local image pipeline): then the count
    # line would say the same thing twice. Records and the tf.data service cannot name theirs, so they count.
    named: bool = False


def _counted(ds: tf.data.Dataset, tally: Tally, start: tuple[int, int] = (0, 0), on_gap=None) -> tf.data.Dataset:
    """Batches of (image, label), with corrupt images counted, logged and bounded, and labels checked.

    The two halves are separate so the tf.data service can run the first
    (`tallied`, no variables) and the trainer the second (`checked`); locally
    they simply follow each other. `start` = (stream position of the first
    element, corrupt images before it) continues a resumed stream.
    """
    return checked(tallied(ds, first=start[0], on_gap=on_gap), tally, start)


def tallied(ds: tf.data.Dataset, first: int = 0, on_gap=None) -> tf.data.Dataset:
    """(index, images, labels) batches → (images, labels, [records, corrupt]): what each batch accounts for.

    Decoding keeps element order, so a skipped image shows as a gap in the
    running index: `records` is how far the stream advanced with this batch,
    corrupt ones included, and `corrupt` the gap. Counting once per batch
    rather than per image keeps the bookkeeping off the per-image path. The
    counts are per batch, not running totals, so batches from several
    producers (the tf.data service's workers) add up. No variable is touched
    here: a dataset that writes variables cannot run in another process (the
    tf.data service serializes it with a warning, and the writes then land
    in the service worker's own copies, silently). `first` is the index of
    the stream's first element. `on_gap(last, index)`, a Python function
    (local pipelines only: it runs in this process), is called for a batch
    with a gap, to name what is missing (`corrupt_namer`).
    """
    def count(last, element):
        index, images, labels = element
        records = index[-1] - last
        gap = records - tf.cast(tf.shape(index)[0], tf.int64)
        if on_gap is not None:
            named = tf.cond(gap > 0, lambda: tf.py_function(on_gap, [last, index], tf.int64),
                            lambda: tf.constant(0, tf.int64))
            with tf.control_dependencies([named]):
                gap = tf.identity(gap)
        return index[-1], (images, labels, tf.stack([records, gap]))
    return ds.scan(tf.constant(first - 1, tf.int64), count)


def checked(ds: tf.data.Dataset, tally: Tally, start: tuple[int, int] = (0, 0)) -> tf.data.Dataset:
    """`tallied` batches → (image, label): corrupt images counted, logged and bounded, labels checked.

    Runs where the trainer's variables live (after the tf.data service, when
    there is one): the running totals are kept here, written into the
    `CorruptCounter` and `StreamPosition`, and checked. Training stops with a
    clear message once more than `data.max_bad_fraction` of the records read
    so far (or of this pipeline's share, whichever is larger) were corrupt. A
    label outside the model's classes is an error, never a silent NaN or a
    wrong class.
    """
    fraction = tally.max_bad_fraction
    floor = max(tally.share_examples, math.ceil(1 / fraction) if fraction else 0)

    def count(state, element):
        seen, bad, number = state
        images, labels, batch = element
        gap = batch[1]
        seen, bad = seen + batch[0], bad + gap
        checks = [
            tf.debugging.Assert(
                tf.cast(bad, tf.float64) <= fraction * tf.cast(tf.maximum(seen, floor), tf.float64),
                [tf.strings.format("tfdp-data-error: too many corrupt images: {} of the first {} records could not "
                                   "be decoded (data.max_bad_fraction is {})", (bad, seen, fraction))]),
        ]
        if not tally.named:
            checks.append(tf.cond(gap > 0, lambda: _warn_skipped(gap, bad), lambda: tf.constant(False)))
        if tally.num_classes:
            low, high = tf.reduce_min(labels), tf.reduce_max(labels)
            checks.append(tf.debugging.Assert(
                tf.logical_and(low >= 0, high < tally.num_classes),
                [tf.strings.format("tfdp-data-error: label {} is outside 0..{} (data and model.num_classes disagree)",
                                   (tf.where(low < 0, low, high), tally.num_classes - 1))]))
        if tally.corrupt is not None:
            checks.append(tally.corrupt.count.assign(bad))
        if tally.position is not None:
            checks.append(tally.position.record(number, seen, bad))
        with tf.control_dependencies(checks):
            return (seen, bad, number + 1), (tf.identity(images), tf.identity(labels))

    first, bad_before = start
    return ds.scan((tf.constant(first, tf.int64), tf.constant(bad_before, tf.int64), tf.constant(0, tf.int64)), count)


class StreamNames:
    """Which file each position of an input pipeline's record stream was read from, for image-file splits.

    Only asked when an image failed to decode (its position is a gap in the
    stream). The stream's order is a pure function of the seed and the
    position (see `epoch_payloads`), so it is replayed with file numbers in place of
    the files: the same permutations and shuffles, nothing read or decoded.
    Each replayed epoch's order is kept until a position in another one is
    asked for.
    """

    def __init__(self, files: tuple[str, ...], epoch_size: int, order):
        self.files, self.epoch_size, self.order = files, max(epoch_size, 1), order
        self._epoch, self._numbers = -1, np.zeros([0], np.int64)

    @classmethod
    def of_training(cls, share: Split, cfg: DataConfig, ctx, data_shard: bool, seed: int | None,
                    share_size: int) -> "StreamNames | None":
        if share.kind != "images" or seed is None:
            return None
        buffer = min(cfg.shuffle_buffer, max(share.num_examples, 1))  # as `epoch_payloads` sizes it
        files = image_share(share, ctx, data_shard).files

        def order(epoch: int) -> tf.data.Dataset:
            if cfg.cache:  # the cached payloads in listing order, reshuffled by tf.data every epoch
                stream = tf.data.Dataset.range(len(files)).shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
                stream = stream.apply(_repeated(cfg.repeated_augmentation, share_size)).repeat()
                return stream.skip(epoch * share_size).take(share_size)
            return epoch_numbers(len(files), buffer, cfg, seed, epoch, share_size).take(share_size)
        return cls(files, share_size, order)

    @classmethod
    def of_evaluation(cls, share: Split, ctx, data_shard: bool) -> "StreamNames | None":
        if share.kind != "images":
            return None
        files = share.files[ctx.input_pipeline_id::ctx.num_input_pipelines] if data_shard else share.files
        return cls(files, len(files), lambda epoch: tf.data.Dataset.range(len(files)))

    def __call__(self, position: int) -> str:
        epoch, place = divmod(int(position), self.epoch_size)
        if epoch != self._epoch:
            self._numbers = np.concatenate([np.zeros([0], np.int64), *self.order(epoch).batch(65536).as_numpy_iterator()])
            self._epoch = epoch
        return self.files[int(self._numbers[place])]


def corrupt_namer(names: StreamNames | None, cfg: DataConfig, transform, stream=streaming.NO_STREAM):
    """`tallied`'s `on_gap`: the files at a batch's missing positions, with TensorFlow's reason, into the
    corrupt-image log (`tfdp.data.corrupt`); None where there is nothing to name (records, synthetic). A
    bucket's file is read from a local copy (`stream.local_copy`: fetched again if the bounded cache has
    let it go)."""
    if names is None:
        return None

    def on_gap(last, index) -> np.int64:
        present = set(index.numpy().tolist())
        for position in range(int(last) + 1, int(index.numpy()[-1]) + 1):
            if position not in present:
                path = names(position)
                with stream.local_copy(path, cfg.cache_dir) as local:
                    CORRUPT_LOG.record(path, decode_error(local, transform))
        return np.int64(0)
    return on_gap


@contextlib.contextmanager
def data_errors():
    """Turns the pipeline's own checks (too many corrupt images, bad labels) into one-line user errors, and a
    bucket that stopped answering into the restart status."""
    try:
        yield
    except tf.errors.OpError as e:
        if (match := re.search(r"tfdp-data-unreachable: ([^\]\n]*)", e.message or "")):
            raise StorageLost(match.group(1).strip()) from None
        match = re.search(r"tfdp-data-error: ([^\]\n]*)", e.message or "")
        if match is None and (stopped := dali_stopped(e.message or "")):
            raise UserError(stopped) from None
        if match is None:
            raise
        raise UserError(match.group(1).strip()) from None


def _warn_skipped(gap: tf.Tensor, bad: tf.Tensor) -> tf.Tensor:
    with tf.control_dependencies([tf.print("tfdp: warning: skipped", gap, "corrupt image(s);", bad,
                                           "so far in this input pipeline", output_stream=sys.stderr)]):
        return tf.constant(True)
