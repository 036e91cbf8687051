"""Naming corrupt images: which file each missing position of a stream was read from, and why it failed.

The batching stage counts an image that fails to decode from the gap it
leaves in the stream (`tfdp.data.batching.tallied`) and calls the namer made
here for a batch with a gap (`corrupt_namer`): it replays the stream's order
(`StreamNames`, from `tfdp.data.order`) to find the files at the missing
positions, decodes each once more (`tfdp.data.corrupt.decode_error`) and
records it in the corrupt-image log. Kept apart from `tfdp.data.corrupt`,
which commands load before TensorFlow.
"""

from __future__ import annotations

from typing import Callable, ContextManager

import numpy as np
import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.data.corrupt import LOG, decode_error
from tfdp.data.layouts import Split
from tfdp.data.order import replayed_epochs


class StreamNames:
    """Which file each position of an input pipeline's record stream was read from, for image-file splits.

    Only asked when an image failed to decode (its position is a gap in the
    stream). The stream's order is a pure function of the seed and the
    position (see `tfdp.data.order.epoch_payloads`), so it is replayed with file numbers in place of
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
        """The names of a training stream's positions (`tfdp.data.order.replayed_epochs`)."""
        return cls.replaying(replayed_epochs(share, cfg, ctx, data_shard, seed, share_size), share_size)

    @classmethod
    def replaying(cls, replay, share_size: int) -> "StreamNames | None":
        """From the order stage's replay (files, epoch → file numbers), made before the stream is opened."""
        return None if replay is None else cls(replay[0], share_size, replay[1])

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


def corrupt_namer(names: StreamNames | None, transform, local_copy: Callable[[str], ContextManager[str]]):
    """`batching.tallied`'s `on_gap`: the files at a batch's missing positions, with TensorFlow's reason, into the
    corrupt-image log (`LOG`); None where there is nothing to name (records, synthetic). A file is decoded
    again from `local_copy(url)` (`tfdp.data.streaming.Feed`: a bucket's file fetched again if the bounded
    cache has let it go)."""
    if names is None:
        return None

    def on_gap(last, index) -> np.int64:
        present = set(index.numpy().tolist())
        for position in range(int(last) + 1, int(index.numpy()[-1]) + 1):
            if position not in present:
                path = names(position)
                with local_copy(path) as local:
                    LOG.record(path, decode_error(local, transform))
        return np.int64(0)
    return on_gap
