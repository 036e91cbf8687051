"""tf.data pipelines: files → decoded, cropped uint8 batches, counted and resumable.

The entry points compose the data stages in the order an input flows, each
handing the next what it needs (docs/architecture.md, how an input flows):
the readers list where each record is (`tfdp.data.readers`), in each data
epoch's order for this pipeline's share (`tfdp.data.order`); a share in a
bucket larger than its room comes through the bounded cache
(`tfdp.data.streaming`); each payload is decoded and cropped
(`tfdp.data.decoding` with a transform from `tfdp.data.preprocess`), batched
with what each batch accounts for and dealt to the replicas
(`tfdp.data.batching`, corrupt images named by `tfdp.data.corrupt`), and
counted where the trainer's variables live (`tfdp.data.counting`). Images
leave as uint8 and are flipped, augmented and normalised by the model's
first layers on the device, which keeps per-pixel work off the CPU; with
`data.decoder: dali` they leave as checked encoded bytes, which
`tfdp.data.dali` decodes on each replica's device.

Each function taking an `input_context` is meant for
`strategy.distribute_datasets_from_function`: it builds one input pipeline's
share and batches by the per-replica batch size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import numpy as np
import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.config.image_sizes import eval_image_size
from tfdp.data import streaming
from tfdp.data.batching import replica_batches, tallied
from tfdp.data.naming import StreamNames, corrupt_namer
from tfdp.data.counting import CorruptCounter, StreamPosition, Tally, checked
from tfdp.data.decoding import decode_calls, decoded_examples
from tfdp.data.layouts import Split
from tfdp.data.order import epoch_payloads, one_pass, pipeline_share, replayed_epochs, share_sizes
from tfdp.data.preprocess import DECODERS, dali_stopped
from tfdp.errors import StorageLost, UserError

AUTOTUNE = tf.data.AUTOTUNE


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
    share_size = share_sizes(split, ctx.num_input_pipelines)[ctx.input_pipeline_id]
    share, data_shard = pipeline_share(split, ctx)
    replay = replayed_epochs(share, cfg, ctx, data_shard, seed, share_size)
    consumed, bad = books.start
    payloads = functools.partial(epoch_payloads, share, cfg, ctx, data_shard, seed, share_size,
                                 divmod(consumed, max(share_size, 1)))
    feed = streaming.open_stream(share, cfg, payloads, seed is not None, part=books.cache_part)
    transform = DECODERS[cfg.decoder].transform(cfg, seed)  # dali: the checked bytes, decoded after (tfdp.data.dali)
    ds = decoded_examples(feed.payloads, share, feed.decoding, transform, books.num_classes, first=consumed,
                          ending=feed.ending)
    names = StreamNames.replaying(replay, share_size)
    on_gap = corrupt_namer(names, transform, feed.local_copy)
    ds = replica_batches(ds, cfg, ctx, global_batch, first=consumed, on_gap=on_gap)
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
    payloads = functools.partial(one_pass, share, cfg, ctx, data_shard)
    feed = streaming.open_stream(share, cfg, payloads, True, endless=False, part=cache_part)
    transform, blank = DECODERS[cfg.decoder].evaluation(cfg)   # dali: checked bytes, decoded after (tfdp.data.dali)
    ds = decoded_examples(feed.payloads, share, feed.decoding, transform, num_classes, ending=feed.ending).batch(batch)
    names = StreamNames.of_evaluation(share, ctx, data_shard)
    on_gap = corrupt_namer(names, transform, feed.local_copy)
    ds = checked(tallied(ds, on_gap=on_gap), Tally(num_classes, cfg.max_bad_fraction, sizes[ctx.input_pipeline_id],
                                                  corrupt, named=on_gap is not None))
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
