"""`tfdp train`: config → data → model (in the strategy's scope) → fit → summary.

Read top to bottom, this is the whole training run: the data (`tfdp.data`),
the plan that sizes the run and makes its decisions once (`tfdp.train.task.make_plan`:
global batch and its layout, XLA), the run built from them (`tfdp.train.run.Run`:
model, restored checkpoint, input streams, validation data, checkpointer
settings), then the fit calls and their callbacks, all in one `Trainer` whose
builder methods a subclass can override; everything else it calls lives in a
module of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import sys
import tempfile
import warnings

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdp import config as config_lib
from tfdp.train.callbacks import (AverageReplicaState, Checkpointer, EmaEvaluation, EpochStats, MetricsLog, WandbLog,
                            tensorboard)
from tfdp.errors import atomic_write_text
from tfdp.rundir.checkpoints import CheckpointStore
from tfdp.config import Config, DataConfig
from tfdp.data import Source, build_source, memory_cache, streaming
from tfdp.data.corrupt import LOG as CORRUPT_LOG, corrupt_images_file
from tfdp.data.counting import CorruptCounter
from tfdp.data.pipeline import data_errors
from tfdp.rundir.bucket import Place, place_for
from tfdp.data.layouts import check_lost
from tfdp.errors import PeerLost, ServiceLost, UserError, first_line
from tfdp.rundir.init_from import recorded
from tfdp.rundir.lease import writer_lease
from tfdp.rundir.metrics_file import METRICS_FILE, read_metrics
from tfdp.rundir.writable import writable_tree
from tfdp.distribute.preemption import PreemptionWatch
from tfdp.distribute.replica_state import start_random_streams, state_averager
from tfdp.config.image_sizes import size_runs
from tfdp.distribute.strategy import Runtime
from tfdp.train.divergence import DivergenceWatch, advice, last_checkpoint_words
from tfdp.train.run import Run
from tfdp.train.input_streams import Streams
from tfdp.train.task import Plan, TrainStream, make_plan
from tfdp.startup.console import say


@dataclasses.dataclass(frozen=True)
class Segment:
    """One `fit` call: epochs [initial_epoch, epochs) of `steps` steps each, on images of `image_size` px
    (0: data.image_size)."""
    initial_epoch: int
    epochs: int
    steps: int
    image_size: int = 0


def segments(resume_epoch: int, step_in_epoch: int, epochs: int, steps_per_epoch: int) -> list[Segment]:
    """The fit calls that finish a run resumed at (epoch, step in it): Keras' fit starts epochs at step 0,
    so the rest of a partial epoch is a fit of its own."""
    if resume_epoch >= epochs:
        return []
    if not step_in_epoch:
        return [Segment(resume_epoch, epochs, steps_per_epoch)]
    rest = [Segment(resume_epoch + 1, epochs, steps_per_epoch)] if resume_epoch + 1 < epochs else []
    return [Segment(resume_epoch, resume_epoch + 1, steps_per_epoch - step_in_epoch), *rest]


def split_by_image_size(fits: list[Segment], data: DataConfig) -> list[Segment]:
    """`fits` split where the training image size changes (progressive resizing), each part with its size:
    a dataset's image size is fixed, so each size is a fit of its own; epochs of one size stay one fit."""
    return [Segment(first, end, fit.steps, size)
            for fit in fits for first, end, size in size_runs(data, fit.initial_epoch, fit.epochs)]


def size_line(data: DataConfig, epoch: int, epochs: int) -> str:
    """What the trainer prints where the training size changes: the epochs (1-based) from `epoch` on at this size."""
    first, end, size = size_runs(data, epoch, epochs)[0]
    which = f"epoch {first + 1} trains" if end == first + 1 else f"epochs {first + 1}-{end} train"
    return f"tfdp: data: {which} at {size} px"


def train(cfg: Config, runtime: Runtime, evaluator: bool = False) -> dict:
    """Trains (or resumes) the run described by `cfg`; returns the final summary. `evaluator`: the cluster has
    an evaluator task (TF_CONFIG), which `train.validate: auto` leaves the validation to."""
    return Trainer(cfg, runtime, evaluator).train()


@dataclasses.dataclass(frozen=True)
class FitInputs:
    """What every fit call of a run reads and watches, built once for all of them: the training stream and the
    per-worker streams it continues, the corrupt-image counter, the validation dataset (None: the run does not
    validate) and the preemption watch."""
    stream: TrainStream
    streams: Streams
    corrupt: CorruptCounter
    val_ds: tf.data.Dataset | None
    watch: PreemptionWatch


class Trainer:
    """Runs one training run, as Model Garden's runner does: `Trainer(cfg, runtime).train()`.

    `train` checks and leases model_dir, `train_in` sizes and builds the run
    and prints what it is, `fit_all` runs the fit calls. What they are wired
    from comes out of builder methods a subclass can override: `build_run`
    (the task's model, restored or initialised), `build_callbacks` (what runs
    around each step and epoch) and `build_loggers` (TensorBoard, Weights &
    Biases).
    """

    def __init__(self, cfg: Config, runtime: Runtime, evaluator: bool = False):
        self.cfg = cfg
        self.runtime = runtime
        self.evaluator = evaluator
        self.validates = config_lib.workers_validate(cfg.train, evaluator)   # train.validate

    def train(self) -> dict:
        cfg, runtime = self.cfg, self.runtime
        if not self.validates:
            say(self.validation_line())
        if cfg.train.deterministic:
            tf.config.experimental.enable_op_determinism()
            say("tfdp: deterministic: TensorFlow op determinism on, seeded input; an op without a "
                "deterministic kernel on this device fails instead of running")
        place = place_for(cfg.model_dir, cfg.scratch_dir, own=runtime.is_chief,
                          retry_seconds=cfg.train.upload_retry_seconds)
        if runtime.is_chief and place.bucket:  # the other workers write only into scratch
            place.bucket.check_writable()
        elif runtime.is_chief:
            writable_tree(place.local, "model_dir")
        try:
            with writer_lease(place.lease_target, cfg.train.lease_timeout, runtime.is_chief):  # one writer per run
                place.pull_run(runtime.is_chief)   # a bucket run: its committed state, into the local copy
                return self.train_in(place)
        finally:
            place.close()

    def validation_line(self) -> str:
        """What a run whose workers skip validation says first; one whose best checkpoint needs it stops."""
        cfg = self.cfg
        why = ("the cluster's evaluator task evaluates each checkpoint and keeps the best one" if self.evaluator
               else "`tfdp evaluate --continuous` beside the run evaluates each checkpoint and keeps the best one")
        if cfg.train.best_metric.startswith("val_ema_"):
            raise UserError(f"train.best_metric {cfg.train.best_metric} is measured by the workers' validation, "
                            f"which they skip (train.validate: {cfg.train.validate}: {why}); set "
                            f"train.validate: always")
        return f"tfdp: validation: not on the workers (train.validate: {cfg.train.validate}): {why}"

    def build_run(self, source: Source, plan: Plan, model_dir: str) -> Run:
        """The model (in the strategy's scope), restored from model_dir's latest checkpoint or filled from
        `model.init_from`, with its frozen layers."""
        return Run.build(self.cfg, self.runtime, source, plan, model_dir)

    def train_in(self, place: Place) -> dict:
        """`train` once model_dir is checked and, on the chief, leased to this run; `place.local` holds the run
        (model_dir itself, or the local copy of a bucket run)."""
        cfg, runtime = self.cfg, self.runtime
        model_dir = place.local
        keras.utils.set_random_seed(cfg.train.seed)
        source = build_source(cfg.data)
        plan = make_plan(cfg, source, runtime, CheckpointStore(model_dir).newest_state())  # a resume: its global batch
        for split in (cfg.data.train_split, cfg.data.val_split):
            check_lost(source.split(split), cfg.data.max_bad_fraction)
        if cfg.data.cache and not cfg.data.service_address:   # the service's workers read, and cache nothing
            cached = [cfg.data.train_split] + ([cfg.data.val_split] if self.validates else [])
            memory_cache.check_fits([source.split(split) for split in cached], runtime.num_workers,
                                    runtime.workers_on_host)
        say(plan.layout.line() + f", {runtime.num_workers} worker(s)")
        if plan.resume_line:
            say(plan.resume_line)
        say(f"tfdp: data: {plan.train_examples} train / {plan.val_examples} val images, {plan.num_classes} classes; "
            f"global batch {plan.global_batch}, {plan.steps_per_epoch} steps/epoch")
        run = self.build_run(source, plan, model_dir)
        say(run.xla_line())
        state = run.state
        epoch, step_in_epoch = run.resume
        previous = [r for r in read_metrics(os.path.join(model_dir, METRICS_FILE)) if r["epoch"] <= epoch]
        if epoch >= cfg.train.epochs:
            say(f"tfdp: all {cfg.train.epochs} epochs already trained in {place.model_dir}")
        elif state:
            where = f", step {step_in_epoch + 1} of {plan.steps_per_epoch}" if step_in_epoch else ""
            say(f"tfdp: resuming at epoch {epoch + 1} of {cfg.train.epochs}{where} "
                f"from {os.path.relpath(state['path'], model_dir)}")

        with output_dir(runtime, model_dir) as out:
            uploader = place.uploader() if runtime.is_chief else None
            store = CheckpointStore(out, uploader)
            store.remove_partial()
            save_config(cfg, out, f"{place.model_dir.rstrip('/')}/config.yaml" if uploader else None)
            if uploader:
                uploader.sync_logs()   # the resolved config, before the first step
            metrics_log = MetricsLog(os.path.join(out, METRICS_FILE), previous)
            fits = split_by_image_size(segments(epoch, step_in_epoch, cfg.train.epochs, plan.steps_per_epoch), cfg.data)
            fits = run.freezing.split(fits)  # one trainable set per fit
            if fits:
                try:
                    self.fit_all(run, fits, store, metrics_log, out, model_dir)
                except BaseException:
                    if uploader:   # a preempted run's last checkpoint goes up before it exits
                        uploader.finish(quiet=True)
                    raise
            if uploader:
                uploader.finish()
        summary = summarize(metrics_log.rows, runtime, plan, cfg.train.best_metric)
        summary["fingerprint"] = weights_fingerprint(run.model)
        say(f"tfdp: worker {runtime.worker_index} of {runtime.num_workers}: weights fingerprint "
            f"{summary['fingerprint']}")
        say(format_summary(summary))
        return summary

    def fit_all(self, run: Run, fits: list[Segment], store: CheckpointStore, metrics_log: MetricsLog, out: str,
                model_dir: str) -> None:
        """Runs the `segments` fit calls, each continuing the input stream where the last one stopped (`out`: where
        this worker writes; `model_dir`: the run's local folder, where every worker names its corrupt images)."""
        cfg, model, freezing = self.cfg, run.model, run.freezing
        corrupt = CorruptCounter()
        CORRUPT_LOG.write_to(corrupt_images_file(model_dir, self.runtime.worker_index))
        streams, line = run.input_streams()
        if line:
            say(line)
        stream = run.train_stream(corrupt, streams)
        watch = PreemptionWatch(self.runtime.strategy, self.runtime.num_workers)
        # Each replica flips and drops its own images, continuing where the checkpoint's streams stood.
        if (line := start_random_streams(model, run.state)):
            say(line)
        val_ds = run.validation() if self.validates else None
        inputs = FitInputs(stream, streams, corrupt, val_ds, watch)
        callbacks = self.build_callbacks(run, inputs, store, metrics_log, out, fits[0].initial_epoch)
        progressive = bool(cfg.data.progressive_min_size)
        start = list(streams.starts)
        watch.install()
        try:
            address = cfg.data.service_address
            with warnings.catch_warnings(), data_errors(), peer_errors(self.runtime), service_errors(address):
                warnings.filterwarnings("ignore", message=".*ran out of data.*")
                size = None
                for fit in fits:
                    if progressive and fit.image_size != size:
                        say(size_line(cfg.data, fit.initial_epoch, cfg.train.epochs))
                    size = fit.image_size
                    if (line := freezing.enter(model, fit.initial_epoch, cfg.train.epochs)):
                        say(line)
                    model.fit(stream.dataset(start, fit.image_size), validation_data=val_ds, epochs=fit.epochs,
                              initial_epoch=fit.initial_epoch, steps_per_epoch=fit.steps, callbacks=callbacks,
                              shuffle=False, verbose=1 if sys.stdout.isatty() else 2)
                    start = stream.local_state(fit.steps * (fit.epochs - fit.initial_epoch))
        finally:
            watch.uninstall()
            streaming.close_all()   # the bounded cache's windows go with the run
            CORRUPT_LOG.close()     # and so does its list of corrupt images

    def build_callbacks(self, run: Run, inputs: FitInputs, store: CheckpointStore, metrics_log: MetricsLog, out: str,
                        initial_epoch: int) -> list[keras.callbacks.Callback]:
        """Every callback of the fit calls, in the order they run: the divergence watch (first: a non-finite
        loss stops the run before anything records its step), epoch statistics, the replicas' averaged state,
        the EMA evaluation, the metrics log, the loggers, and the checkpointer last."""
        cfg, stream, val_ds = self.cfg, inputs.stream, inputs.val_ds
        average = state_averager(run.model)
        settings, hint = run.checkpoint_settings(inputs.streams), advice(cfg.optimizer)
        checkpointer = Checkpointer(store, settings, average=average, input_state=stream.state,
                                    snapshot=run.replica_snapshot(), watch=inputs.watch, hint=hint)
        divergence = DivergenceWatch(settings.steps_per_epoch, cfg.model.num_classes,
                                     lambda: last_checkpoint_words(store), hint, settings.resume)
        ema = [EmaEvaluation(val_ds)] if cfg.optimizer.ema_decay and val_ds is not None else []
        stats = EpochStats(run.plan.global_batch, inputs.corrupt, live=sys.stdout.isatty(),
                           image_size=(lambda: stream.image_size) if cfg.data.progressive_min_size else None)
        # Loggers before the checkpointer: a run killed between the two redoes the epoch, and TensorBoard
        # drops the killed run's copy of it (see `callbacks.tensorboard`).
        return [divergence, stats, AverageReplicaState(average), *ema, metrics_log,
                *self.build_loggers(out, initial_epoch), checkpointer]

    def build_loggers(self, out: str, initial_epoch: int) -> list[keras.callbacks.Callback]:
        """TensorBoard (into `out`, so only the chief's survives) and, on the chief, Weights & Biases."""
        cfg, found = self.cfg, []
        if cfg.log.tensorboard:
            found.append(tensorboard(os.path.join(out, "tensorboard"), cfg.log.profile_steps, initial_epoch))
        if cfg.log.wandb_project and self.runtime.is_chief:
            found.append(WandbLog(cfg.log.wandb_project, cfg.log.wandb_mode, out, config_lib.to_dict(cfg),
                                  initial_epoch))
        return found


@contextlib.contextmanager
def peer_errors(runtime: Runtime):
    """A worker that stops answering mid-run (killed, its host gone) ends the others with one line and
    the restart status, not a collective's traceback: the last checkpoint is where the job goes on."""
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError) as e:
        if runtime.num_workers == 1:
            raise
        raise PeerLost(f"worker {runtime.worker_index}: another worker stopped answering ({first_line(e)})") from None


@contextlib.contextmanager
def service_errors(address: str):
    """A tf.data service that has forgotten the run's job (its dispatcher restarted without its journal, or
    another dispatcher took the address) ends the run with one line and the restart status: the same
    command resumes from the last checkpoint with a new job."""
    try:
        yield
    except tf.errors.NotFoundError as e:
        if not address:
            raise
        raise ServiceLost(f"the tf.data service at {address} no longer knows this run's input job ({first_line(e)}); a "
                          f"dispatcher restarted without its --work_dir forgets its jobs; restart its workers too"
                          ) from None


@contextlib.contextmanager
def output_dir(runtime: Runtime, model_dir: str):
    """model_dir on the chief; a temporary directory, removed afterwards, on every other worker.

    All workers run the same callbacks (saving may involve collectives), but
    only the chief's files are kept: the documented multi-worker pattern.
    """
    if runtime.is_chief:
        os.makedirs(model_dir, exist_ok=True)
        yield model_dir
        return
    tmp = tempfile.mkdtemp(prefix=f"tfdp-worker{runtime.worker_index}-")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def weights_fingerprint(model: keras.Model) -> str:
    """A short hash of every weight: equal on all workers of a healthy data-parallel run."""
    digest = hashlib.sha256()
    for w in model.weights:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(w)).tobytes())
    return digest.hexdigest()[:16]


def save_config(cfg: Config, model_dir: str, shown: str | None = None) -> None:
    """Saves the resolved config; warns when a resumed run's config changed. `shown`: where the user
    will find it, when that is not here (a bucket run's upload). `model.init_from` is what the user named (a bucket
    URL, a Hub handle at its commit), not tfdp's local copy of it; so is `train.teacher.init_from`."""
    path = os.path.join(model_dir, "config.yaml")
    teacher = dataclasses.replace(cfg.train.teacher, init_from=recorded(cfg.train.teacher.init_from))
    text = config_lib.dump_yaml(dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, init_from=recorded(cfg.model.init_from)), train=dataclasses.replace(cfg.train, teacher=teacher)))
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() != text:
                logging.warning("config differs from the one saved in %s; the new one replaces it", path)
    atomic_write_text(path, text)
    say(f"tfdp: config: the resolved config is in {shown or path}")
    logging.info("resolved config:\n%s", text)


def summarize(rows: list[dict], runtime: Runtime, plan: Plan, best_metric: str = "val_top1") -> dict:
    """Final numbers from the metrics log; throughput skips the first epoch (tracing) when it can (`throughput`).

    The best epoch is the one `train.best_metric` picks, as for the best checkpoint.
    """
    if not rows:
        raise UserError("no epochs recorded in the metrics log")
    last = rows[-1]
    timed = rows[1:] if len(rows) > 1 else rows
    rate, window = throughput(rows)
    if best_metric.endswith("loss"):
        best = min(rows, key=lambda r: r.get(best_metric, float("inf")))
    else:
        best = max(rows, key=lambda r: r.get(best_metric, 0.0))
    return {
        "epochs": last["epoch"],
        "val_top1": last.get("val_top1"),
        "val_top5": last.get("val_top5"),
        "best_val_top1": best.get("val_top1"),
        "best_epoch": best["epoch"],
        "seconds_per_epoch": sum(r["seconds"] for r in timed) / len(timed),
        "images_per_sec": rate,
        "rate_window": window,
        "replicas": runtime.num_replicas,
        "global_batch": plan.global_batch,
        "corrupt_images": int(last.get("corrupt_images", 0)),
        "lost_records": plan.lost_records,
        "damaged_shards": [os.path.basename(f) for f in plan.damaged],
    }


def throughput(rows: list[dict]) -> tuple[float, str]:
    """Training images/s, and what it leaves out where that is not the first epoch: the mean over the epochs after
    the first (whose steps include tracing); a run of one epoch has none, so its steps after its first; a run of one
    step (or rows without that column), that step, tracing included. A short run's rate is then its model's, not
    its tracing's: a one-epoch fine-tune on a few images spends most of its epoch tracing."""
    if len(rows) > 1:
        return sum(r["images_per_sec"] for r in rows[1:]) / (len(rows) - 1), ""
    if rows[0].get("images_per_sec_after_first_step"):
        return rows[0]["images_per_sec_after_first_step"], "after the first step, whose tracing it leaves out"
    return rows[0]["images_per_sec"], "over the one step, tracing included"


def rate_words(rate: float, window: str = "") -> str:
    """`rate` images/s to two significant digits or more (a slow model's 0.27 is not 0), and its window."""
    number = f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"
    return f"{number} images/s" + (f" ({window})" if window else "")


def validation_words(s: dict) -> str:
    """The summary's validation: the last epoch's and the best one's, or where the evaluator's are."""
    if s.get("val_top1") is None:
        return "no validation on the workers (the evaluator's is in eval_metrics.jsonl)"
    return (f"validation top-1 {100 * s['val_top1']:.2f}% "
            f"(best {100 * s['best_val_top1']:.2f}% at epoch {s['best_epoch']})")


def format_summary(s: dict) -> str:
    return (f"tfdp: done: {s['epochs']} epochs, {validation_words(s)}, "
            f"{s['seconds_per_epoch']:.1f} s/epoch, {rate_words(s['images_per_sec'], s.get('rate_window', ''))} "
            f"on {s['replicas']} replica(s), global batch {s['global_batch']}"
            + (f"; skipped {s['corrupt_images']} corrupt training image(s)" if s.get("corrupt_images") else "")
            + (f"; {s['lost_records']} record(s) lost from cut-short shard(s) {', '.join(s['damaged_shards'])}"
               if s.get("lost_records") else ""))
