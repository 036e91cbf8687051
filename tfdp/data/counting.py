"""Counting: the running totals of one stream, where the trainer's variables live.

The stage after batching (`tfdp.data.batching`, whose batches each carry
[records, corrupt]): corrupt images counted, logged and bounded by
`data.max_bad_fraction`, labels checked against the model's classes, and
each batch's stream position recorded for the checkpoint. The two halves
are apart so the tf.data service can run the stream up to `tallied` (no
variables) and the trainer this stage (`tfdp.data.service.client`); a
local stream simply follows one with the other.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import tensorflow as tf


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
class Tally:
    """What `checked` checks batches against and where it reports."""
    num_classes: int                  # labels must lie in 0..num_classes-1 (0: unknown, unchecked)
    max_bad_fraction: float           # data.max_bad_fraction
    share_examples: int               # the bound applies to at least this many records
    corrupt: CorruptCounter | None = None
    position: StreamPosition | None = None
    # Each corrupt image is named in the corrupt-image log as it is met (a local image pipeline): then the count
    # line would say the same thing twice. Records and the tf.data service cannot name theirs, so they count.
    named: bool = False


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


def _warn_skipped(gap: tf.Tensor, bad: tf.Tensor) -> tf.Tensor:
    with tf.control_dependencies([tf.print("tfdp: warning: skipped", gap, "corrupt image(s);", bad,
                                           "so far in this input pipeline", output_stream=sys.stderr)]):
        return tf.constant(True)
