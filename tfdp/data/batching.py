"""Batching: decoded examples into per-replica batches, each with what it accounts for, dealt to the replicas.

The stage after decoding (`tfdp.data.decoding`): batches of (index, image,
label) become (images, labels, [records, corrupt]) (`tallied`: how far the
stream advanced with the batch, and the gap corrupt images left in it, named
by the function the caller hands in, `tfdp.data.naming.corrupt_namer`), cut
and dealt so each step takes one batch per local replica. The running totals
are kept after it (`tfdp.data.counting`).
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.config import DataConfig


def replica_batches(ds: tf.data.Dataset, cfg: DataConfig, ctx: tf.distribute.InputContext, global_batch: int,
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
