"""The training pipeline run by a tf.data service (`data.service_address`), so input scales past this host.

What goes to the service is tfdp's own pipeline, up to the batches: the same
readers, crops, batching and corrupt-image accounting (`batching.tallied`),
but no variable. With `data.decoder: dali` its per-image step is DALI's check
instead of the crop, and the trainer's DALI pipelines decode what it sends
(`tfdp.data.dali`). Each batch carries what it accounts for, [records, corrupt],
and the trainer adds those up after the service (`counting.checked`), where
its `CorruptCounter` and `StreamPosition` live. Evaluation never uses the
service: it is one local pass per epoch.

Two modes (`data.service_mode`), as TensorFlow defines them:

* `distributed_epoch`: every trainer sends the WHOLE split and all trainers
  read one shared job (the same `job_name`). The dispatcher deals the
  split's files out to the service workers one at a time, so every example
  is read once per data epoch across all trainers, whichever trainer gets
  it; the trainers take batches first come, first served, and the stream is
  endless, so none ever runs short in a synchronous step. A service worker
  lost mid-epoch loses only the files it was reading (TensorFlow's
  at-most-once visitation under failures).
* `parallel_epochs`: each trainer sends its own share (the local sharding
  rules) and reads its own job; every service worker streams that whole
  share, each in its own random order, and the trainer takes from all of
  them: each example about once per epoch, on average, not exactly.

Resuming: the service decides which worker reads what and in which order,
so a resumed run cannot replay the exact stream an uninterrupted run would
have read. Training still resumes at the exact epoch and step; the input
restarts at the data epoch and file the checkpoint's position points to
(`distributed_epoch`) or anywhere in the share (`parallel_epochs`), and the
trainer says so in one line.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid

import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.data import readers
from tfdp.data.batching import tallied
from tfdp.data.counting import Tally, checked
from tfdp.data.decoding import decoded_examples
from tfdp.data.order import MAX_EPOCHS, epoch_payloads, pipeline_share, share_sizes
from tfdp.data.pipeline import AUTOTUNE, Bookkeeping
from tfdp.data.preprocess import DECODERS
from tfdp.data.layouts import Split
from tfdp.data.storage import cache_paths, is_remote_url
from tfdp.errors import UserError, first_line

DISTRIBUTED = "distributed_epoch"


def train_dataset(split: Split, cfg: DataConfig, global_batch: int, seed: int,
                  input_context: tf.distribute.InputContext | None = None, books: Bookkeeping = Bookkeeping(), *,
                  job_name: str, epochs: int | None = None) -> tf.data.Dataset:
    """This trainer's training batches through the service at `cfg.service_address`, counted here.

    The counterpart of `pipeline.train_dataset`, with the same arguments and
    the service's job. `books.start` is this trainer's (records consumed,
    corrupt so far); it sets the running totals and where the service's
    stream restarts. `epochs` ends the stream after that many data epochs
    (for tests; training's is endless).
    """
    ctx = input_context or tf.distribute.InputContext()
    sent = sent_batches(split, cfg, global_batch, seed, ctx, books.num_classes, books.start, epochs)
    compression = "AUTO" if cfg.service_compression == "auto" else None
    served = sent.apply(tf.data.experimental.service.distribute(
        processing_mode=cfg.service_mode, service=cfg.service_address, job_name=job_name,
        compression=compression))
    share = share_sizes(split, ctx.num_input_pipelines)[ctx.input_pipeline_id]
    tally = Tally(books.num_classes, cfg.max_bad_fraction, share, books.corrupt, books.position)
    return checked(served, tally, books.start).prefetch(AUTOTUNE)


def sent_batches(split: Split, cfg: DataConfig, global_batch: int, seed: int, ctx: tf.distribute.InputContext,
                 num_classes: int = 0, start: tuple[int, int] = (0, 0), epochs: int | None = None) -> tf.data.Dataset:
    """The pipeline the service runs: payloads → decoded, cropped, batched, `tallied`. No variables.

    `data.cache` is not used: it would keep a copy per service worker, and
    with `distributed_epoch` each worker reads a different part every epoch.
    """
    cfg = dataclasses.replace(cfg, cache=False)
    split = read_by_workers(split, cfg)
    if cfg.service_mode == DISTRIBUTED:
        payloads, share = _whole_split(split, cfg, seed, ctx, start[0], epochs), split
    else:
        payloads, share = _own_share(split, cfg, ctx, epochs)
    # tf: decoded and cropped here; dali: the checked encoded bytes, decoded on the trainer's replicas (tfdp.data.dali).
    # Labels are checked by the trainer.
    ds = decoded_examples(payloads, share, cfg, DECODERS[cfg.decoder].transform(cfg, seed), num_classes)
    ds = ds.batch(ctx.get_per_replica_batch_size(global_batch), drop_remainder=True)
    return tallied(ds)


def read_by_workers(split: Split, cfg: DataConfig) -> Split:
    """The split with each bucket file replaced by the path of the service workers' copy of it.

    TensorFlow reads no bucket of its own here (no s3:// at all, gs:// only at
    Google's endpoint), so the pipeline the service runs reads local paths: the
    workers mirror the bucket into `data.service_cache_dir` before they serve
    (`tfdp data-service worker --mirror`), and the trainer only names the files.
    """
    return dataclasses.replace(split, files=tuple(cache_paths(split.files, workers_cache_dir(cfg))))


def check_workers_read(split: Split, cfg: DataConfig, timeout: float) -> None:
    """One line, before training, when the service's workers cannot read the split's files.

    A worker that cannot open them (data not on its disk, a bucket not
    mirrored) would skip every file as unreadable and loop over empty epochs,
    and the trainer would wait forever for its first batch. So a one-element
    job reads the split's first file on a worker first; its error, or its
    silence for `timeout` s, is reported here. The read runs in a thread,
    since TensorFlow's wait cannot be interrupted.
    """
    if split.kind == "synthetic" or not split.files:
        return  # nothing on disk to read
    path = read_by_workers(split, cfg).files[0]
    probe = tf.data.Dataset.from_tensors(path).map(lambda p: tf.strings.length(tf.io.read_file(p))).apply(
        tf.data.experimental.service.distribute(processing_mode="parallel_epochs", service=cfg.service_address,
                                                job_name=f"tfdp-probe-{uuid.uuid4().hex}"))
    outcome: list = []

    def read():
        try:
            outcome.append(int(next(iter(probe))))
        except Exception as e:  # noqa: BLE001  (reported below, in the caller's thread)
            outcome.append(e)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    hint = (f"; for data in a bucket, start the workers with --mirror={cfg.dir} --cache_dir={workers_cache_dir(cfg)}"
            if is_remote_url(split.files[0]) else "; the workers must see the data at the trainers' paths")
    if not outcome:
        raise UserError(f"the tf.data service's workers did not read {path} within {timeout:g} s "
                        f"(data.service_timeout){hint}")
    if isinstance(outcome[0], Exception):
        raise UserError(f"the tf.data service's workers cannot read {path} ({first_line(outcome[0])}){hint}")


def workers_cache_dir(cfg: DataConfig) -> str:
    return cfg.service_cache_dir or cfg.cache_dir


def restart_slot(split: Split, consumed: int, trainers: int) -> int:
    """The file slot (data epoch x files + place) a `distributed_epoch` stream restarts at.

    The trainers share one stream and train the same number of batches, so
    together they consumed about `trainers` times this one's records; the
    place within the data epoch is the same fraction of its files (exact for
    one image per file, to the shard for equal TFRecord shards).
    """
    total, n = split.num_examples, len(split.files)
    epoch, offset = divmod(consumed * trainers, max(total, 1))
    return epoch * n + offset * n // max(total, 1)


def resume_note(split: Split, cfg: DataConfig, consumed: int, trainers: int) -> str:
    """The one line a resumed run prints: where the service's stream restarts, and that it is not exact."""
    if cfg.service_mode == DISTRIBUTED:
        epoch, place = divmod(restart_slot(split, consumed, trainers), len(split.files))
        return (f"tfdp: data: resumed through the tf.data service ({DISTRIBUTED}): the input restarts at data epoch "
                f"{epoch + 1}, file {place + 1} of {len(split.files)}, not at the exact record (the service decides "
                f"which worker reads which file, so the stream cannot be replayed)")
    return ("tfdp: data: resumed through the tf.data service (parallel_epochs): every service worker reads this "
            "trainer's share in its own random order, so the input is not the exact stream of an uninterrupted run")


def _whole_split(split: Split, cfg: DataConfig, seed: int, ctx: tf.distribute.InputContext, consumed: int,
                 epochs: int | None) -> tf.data.Dataset:
    """`distributed_epoch`: the whole split's payloads, file slot by file slot, shuffled through a buffer."""
    first = restart_slot(split, consumed, ctx.num_input_pipelines)
    n = len(split.files)
    end = MAX_EPOCHS * n if epochs is None else (first // n + epochs) * n
    buffer = min(cfg.shuffle_buffer, max(split.num_examples, 1))
    return readers.slot_payloads(split, cfg, seed, first, end).shuffle(buffer, seed=seed)


def _own_share(split: Split, cfg: DataConfig, ctx: tf.distribute.InputContext,
               epochs: int | None) -> tuple[tf.data.Dataset, Split]:
    """`parallel_epochs`: this trainer's share, in an order each service worker draws for itself."""
    share, data_shard = pipeline_share(split, ctx)
    size = share_sizes(split, ctx.num_input_pipelines)[ctx.input_pipeline_id]
    stream = epoch_payloads(share, cfg, ctx, data_shard, None, size)
    return (stream if epochs is None else stream.take(epochs * size)), share
