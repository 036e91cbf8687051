"""`tfdp train`: config → data → model (in the strategy's scope) → fit → summary.

Read top to bottom, this is the whole training run; everything it calls lives
in a module of its own.
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

from tfdp import compat
from tfdp import config as config_lib
from tfdp.callbacks import AverageReplicaState, Checkpointer, EpochStats, MetricsLog, WandbLog, tensorboard
from tfdp.checkpoints import CheckpointStore, atomic_write_text
from tfdp.config import Config
from tfdp.data import Source, build_source
from tfdp.data.pipeline import CorruptCounter, StreamPosition, data_errors, eval_dataset, train_dataset
from tfdp.data.sources import check_lost
from tfdp.errors import PeerLost, UserError
from tfdp.places import writable_tree
from tfdp.metrics_file import METRICS_FILE, read_metrics
from tfdp.eval_step import install_exact_eval_loss
from tfdp.losses import SparseSmoothedCrossentropy
from tfdp.models import build_model, check_model_name
from tfdp.preemption import PreemptionWatch
from tfdp.replica_state import ReplicaSnapshot, WorkerGather, state_averager
from tfdp.schedules import build_schedule
from tfdp.strategy import Runtime
from tfdp.xla import compile_per_replica_step, use_xla

# Variable names (Keras: BatchNormalization's gamma/beta, layers' bias) left undecayed on request.
NO_DECAY = ("gamma", "beta", "bias")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The numbers a run is sized by, derived once from config, data and strategy."""
    global_batch: int
    steps_per_epoch: int
    train_examples: int
    val_examples: int
    num_classes: int
    lost_records: int = 0           # listed in counts.json but cut off their shards (both splits)
    damaged: tuple[str, ...] = ()   # the shards those records were lost from


def make_plan(cfg: Config, source: Source, runtime: Runtime) -> Plan:
    if source.num_classes and source.num_classes != cfg.model.num_classes:  # 0: unknown until labels are read
        raise UserError(f"the data has {source.num_classes} classes but model.num_classes is {cfg.model.num_classes}")
    train, val = source.split(cfg.data.train_split), source.split(cfg.data.val_split)
    global_batch = cfg.train.batch_size_per_replica * runtime.num_replicas
    steps = train.num_examples // global_batch
    if steps == 0:
        raise UserError(f"the training split has {train.num_examples} images, fewer than one global batch "
                        f"of {global_batch} ({cfg.train.batch_size_per_replica} per replica x {runtime.num_replicas} replicas)")
    return Plan(global_batch, steps, train.num_examples, val.num_examples, cfg.model.num_classes,
                train.lost_records + val.lost_records,
                tuple(f for split in (train, val) for f, n in zip(split.files, split.lost) if n))


def compile_model(cfg: Config, plan: Plan) -> keras.Model:
    """Builds and compiles the model; call inside `strategy.scope()` so variables are mirrored."""
    compat.apply()  # every fit/evaluate goes through a model compiled here
    keras.mixed_precision.set_global_policy(cfg.train.precision)
    model = build_model(cfg.model, cfg.data)
    schedule = build_schedule(cfg.schedule, cfg.optimizer.lr, plan.global_batch, plan.steps_per_epoch, cfg.train.epochs)
    optimizer = keras.optimizers.SGD(
        learning_rate=schedule, momentum=cfg.optimizer.momentum, nesterov=cfg.optimizer.nesterov,
        weight_decay=cfg.optimizer.weight_decay or None)
    if cfg.optimizer.weight_decay and not cfg.optimizer.decay_norm_and_bias:
        optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY))
    metrics = [keras.metrics.SparseCategoricalAccuracy(name="top1")]
    if plan.num_classes > 5:
        metrics.append(keras.metrics.SparseTopKCategoricalAccuracy(k=5, name="top5"))
    # mixed_float16: Keras wraps the optimizer in a LossScaleOptimizer (dynamic loss scaling).
    # Weighted metrics, so evaluation's weight-0 padding images are not counted.
    model.compile(optimizer=optimizer, loss=SparseSmoothedCrossentropy(cfg.train.label_smoothing),
                  weighted_metrics=metrics, jit_compile=False, steps_per_execution=cfg.train.steps_per_execution)
    jit, _ = use_xla(cfg.train.jit_compile, current_devices(), cfg.model.sync_bn)
    if jit:
        compile_per_replica_step(model)  # XLA per replica; Keras' own jit fails with several replicas
    install_exact_eval_loss(model)  # val_loss over the real images, not the evaluation padding
    # Built now, not lazily in the first step, so a checkpoint can restore its state.
    optimizer.build(model.trainable_variables)
    return model


def current_devices() -> list[str]:
    """The devices of the strategy whose scope we are in (outside any scope: where TensorFlow places ops)."""
    if tf.distribute.has_strategy():
        return list(tf.distribute.get_strategy().extended.worker_devices)
    return [d.name for d in tf.config.list_logical_devices("GPU")[:1]] or ["/device:CPU:0"]


def validation_dataset(cfg: Config, source: Source, runtime: Runtime, plan: Plan):
    """Per-worker validation pipelines: each worker builds (and reads) only its own share."""
    val = source.split(cfg.data.val_split)
    return runtime.strategy.distribute_datasets_from_function(
        lambda ctx: eval_dataset(val, cfg.data, plan.global_batch, ctx, num_classes=plan.num_classes))


class TrainStream:
    """This worker's training pipeline, started at any position of its record stream.

    It remembers where each batch ended (`StreamPosition`), so a checkpoint
    can record the exact position after the last trained step and a resumed
    run can start there, skipping records rather than decoding them.
    """

    def __init__(self, cfg: Config, source: Source, runtime: Runtime, plan: Plan, corrupt: CorruptCounter | None):
        self.cfg, self.source, self.runtime, self.plan, self.corrupt = cfg, source, runtime, plan, corrupt
        self.start: tuple[int, int] = (0, 0)
        self.position = StreamPosition()
        # Each step takes one batch per local replica from this worker's pipeline.
        self.batches_per_step = runtime.num_replicas // runtime.num_workers
        self.gather = WorkerGather(runtime.strategy, runtime.worker_index, runtime.num_workers)

    def dataset(self, start: tuple[int, int]):
        self.start, self.position = tuple(start), StreamPosition()
        train, cfg, plan = self.source.split(self.cfg.data.train_split), self.cfg, self.plan
        start, position = self.start, self.position
        return self.runtime.strategy.distribute_datasets_from_function(
            lambda ctx: train_dataset(train, cfg.data, plan.global_batch, cfg.train.seed, ctx,
                                      num_classes=plan.num_classes, corrupt=self.corrupt,
                                      start=start, position=position))

    def local_state(self, steps: int) -> tuple[int, int]:
        """(records consumed, corrupt so far) of this worker's stream after `steps` steps of the current dataset."""
        if not steps or self.source.split(self.cfg.data.train_split).synthetic:
            return self.start
        return self.position.after(steps * self.batches_per_step)

    def state(self, steps: int) -> list[list[int]]:
        """Every worker's `local_state`, indexed by worker (a collective: all workers call it)."""
        return self.gather(list(self.local_state(steps)))


@dataclasses.dataclass(frozen=True)
class Segment:
    """One `fit` call: epochs [initial_epoch, epochs) of `steps` steps each."""
    initial_epoch: int
    epochs: int
    steps: int


def segments(resume_epoch: int, step_in_epoch: int, epochs: int, steps_per_epoch: int) -> list[Segment]:
    """The fit calls that finish a run resumed at (epoch, step in it): Keras' fit starts epochs at step 0,
    so the rest of a partial epoch is a fit of its own."""
    if resume_epoch >= epochs:
        return []
    if not step_in_epoch:
        return [Segment(resume_epoch, epochs, steps_per_epoch)]
    rest = [Segment(resume_epoch + 1, epochs, steps_per_epoch)] if resume_epoch + 1 < epochs else []
    return [Segment(resume_epoch, resume_epoch + 1, steps_per_epoch - step_in_epoch), *rest]


def resume_input(state: dict | None, runtime: Runtime, plan: Plan) -> tuple[int, int]:
    """This worker's input position from a checkpoint's state (the stream's start for a fresh run)."""
    if not state:
        return (0, 0)
    positions = state.get("input")
    if positions and len(positions) == runtime.num_workers:
        return tuple(positions[runtime.worker_index])
    step = state.get("step", state["epoch"] * plan.steps_per_epoch)
    logging.warning("the checkpoint was written by %s worker(s), this run has %d: the input continues at about "
                    "the same position, not exactly", len(positions) if positions else "an unknown number of",
                    runtime.num_workers)
    return (step * (plan.global_batch // runtime.num_workers), 0)


def train(cfg: Config, runtime: Runtime) -> dict:
    """Trains (or resumes) the run described by `cfg`; returns the final summary."""
    check_model_name(cfg.model.name)
    if cfg.train.deterministic:
        tf.config.experimental.enable_op_determinism()
        print("tfdp: deterministic: TensorFlow op determinism on, seeded input; an op without a "
              "deterministic kernel on this device fails instead of running", flush=True)
    model_dir = os.path.abspath(os.path.expanduser(cfg.model_dir))
    if runtime.is_chief:  # the other workers write only into scratch
        writable_tree(model_dir, "model_dir")
    keras.utils.set_random_seed(cfg.train.seed)
    source = build_source(cfg.data)
    plan = make_plan(cfg, source, runtime)
    for split in (cfg.data.train_split, cfg.data.val_split):
        check_lost(source.split(split), cfg.data.max_bad_fraction)
    print(f"tfdp: data: {plan.train_examples} train / {plan.val_examples} val images, {plan.num_classes} classes; "
          f"global batch {plan.global_batch} ({cfg.train.batch_size_per_replica} x {runtime.num_replicas} replicas, "
          f"{runtime.num_workers} worker(s)), {plan.steps_per_epoch} steps/epoch", flush=True)
    with runtime.strategy.scope():
        model = compile_model(cfg, plan)
    jit, why = use_xla(cfg.train.jit_compile, runtime.devices, cfg.model.sync_bn)  # as compile_model resolved it
    print(f"tfdp: xla: {'on' if jit else 'off'} ({why})", flush=True)
    state = CheckpointStore(model_dir).restore_latest(model)
    epoch, step_in_epoch = (state["epoch"], state.get("step_in_epoch", 0)) if state else (0, 0)
    previous = [r for r in read_metrics(os.path.join(model_dir, METRICS_FILE)) if r["epoch"] <= epoch]
    if epoch >= cfg.train.epochs:
        print(f"tfdp: all {cfg.train.epochs} epochs already trained in {model_dir}", flush=True)
    elif state:
        where = f", step {step_in_epoch + 1} of {plan.steps_per_epoch}" if step_in_epoch else ""
        print(f"tfdp: resuming at epoch {epoch + 1} of {cfg.train.epochs}{where} "
              f"from {os.path.relpath(state['path'], model_dir)}", flush=True)

    with output_dir(runtime, model_dir) as out:
        store = CheckpointStore(out)
        store.remove_partial()
        save_config(cfg, out)
        metrics_log = MetricsLog(os.path.join(out, METRICS_FILE), previous)
        fits = segments(epoch, step_in_epoch, cfg.train.epochs, plan.steps_per_epoch)
        if fits:
            fit_all(cfg, runtime, model, source, plan, fits, state, store, metrics_log, out)
    summary = summarize(metrics_log.rows, runtime, plan, cfg.train.best_metric)
    summary["fingerprint"] = weights_fingerprint(model)
    print(f"tfdp: worker {runtime.worker_index} of {runtime.num_workers}: weights fingerprint {summary['fingerprint']}",
          flush=True)
    print(format_summary(summary), flush=True)
    return summary


def fit_all(cfg: Config, runtime: Runtime, model: keras.Model, source: Source, plan: Plan, fits: list[Segment],
            state: dict | None, store: CheckpointStore, metrics_log: MetricsLog, out: str) -> None:
    """Runs the `segments` fit calls, each continuing the input stream where the last one stopped."""
    corrupt = CorruptCounter()
    stream = TrainStream(cfg, source, runtime, plan, corrupt)
    average = state_averager(model)
    watch = PreemptionWatch(runtime.strategy)
    snapshot = ReplicaSnapshot(model)
    own = state.get("replica_state") if state else None
    if own is not None and own.shape == (runtime.num_replicas, snapshot.width):
        snapshot.put_back(own)  # each replica's statistics as they were, not just their saved average
    checkpointer = Checkpointer(
        store, f"val_{cfg.train.best_metric.removeprefix('val_')}", state["best"] if state else None,
        steps_per_epoch=plan.steps_per_epoch, every_steps=cfg.train.checkpoint_every_steps, average=average,
        input_state=stream.state, snapshot=snapshot, watch=watch,
        resume=(state["epoch"], state.get("step_in_epoch", 0)) if state else (0, 0),
        resume_metrics=state.get("metrics") if state else None)
    # Loggers before the checkpointer: a run killed between the two redoes the epoch, and TensorBoard
    # drops the killed run's copy of it (see `callbacks.tensorboard`).
    callbacks = [EpochStats(plan.global_batch, corrupt), AverageReplicaState(average), metrics_log,
                 *loggers(cfg, out, runtime, fits[0].initial_epoch), checkpointer]
    val_ds = validation_dataset(cfg, source, runtime, plan)
    start = resume_input(state, runtime, plan)
    watch.install()
    try:
        with warnings.catch_warnings(), data_errors(), peer_errors(runtime):
            warnings.filterwarnings("ignore", message=".*ran out of data.*")
            for fit in fits:
                model.fit(stream.dataset(start), validation_data=val_ds, epochs=fit.epochs,
                          initial_epoch=fit.initial_epoch, steps_per_epoch=fit.steps, callbacks=callbacks,
                          shuffle=False, verbose=1 if sys.stdout.isatty() else 2)
                start = stream.local_state(fit.steps * (fit.epochs - fit.initial_epoch))
    finally:
        watch.uninstall()


@contextlib.contextmanager
def peer_errors(runtime: Runtime):
    """A worker that stops answering mid-run (killed, its host gone) ends the others with one line and
    the restart status, not a collective's traceback: the last checkpoint is where the job goes on."""
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError) as e:
        if runtime.num_workers == 1:
            raise
        first = (e.message or "").strip().splitlines()[0][:160] if e.message else type(e).__name__
        raise PeerLost(f"worker {runtime.worker_index}: another worker stopped answering ({first})") from None


def loggers(cfg: Config, out: str, runtime: Runtime, initial_epoch: int) -> list[keras.callbacks.Callback]:
    """TensorBoard (into `out`, so only the chief's survives) and, on the chief, Weights & Biases."""
    found = []
    if cfg.log.tensorboard:
        found.append(tensorboard(os.path.join(out, "tensorboard"), cfg.log.profile_steps, initial_epoch))
    if cfg.log.wandb_project and runtime.is_chief:
        found.append(WandbLog(cfg.log.wandb_project, cfg.log.wandb_mode, out, config_lib.to_dict(cfg), initial_epoch))
    return found


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


def save_config(cfg: Config, model_dir: str) -> None:
    """Saves the resolved config; warns when a resumed run's config changed."""
    path = os.path.join(model_dir, "config.yaml")
    text = config_lib.dump_yaml(cfg)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() != text:
                logging.warning("config differs from the one saved in %s; the new one replaces it", path)
    atomic_write_text(path, text)
    print(f"tfdp: config: the resolved config is in {path}", flush=True)
    logging.info("resolved config:\n%s", text)


def summarize(rows: list[dict], runtime: Runtime, plan: Plan, best_metric: str = "val_top1") -> dict:
    """Final numbers from the metrics log; throughput skips the first epoch (tracing) when it can.

    The best epoch is the one `train.best_metric` picks, as for the best checkpoint.
    """
    if not rows:
        raise UserError("no epochs recorded in the metrics log")
    last = rows[-1]
    timed = rows[1:] if len(rows) > 1 else rows
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
        "images_per_sec": sum(r["images_per_sec"] for r in timed) / len(timed),
        "replicas": runtime.num_replicas,
        "global_batch": plan.global_batch,
        "corrupt_images": int(last.get("corrupt_images", 0)),
        "lost_records": plan.lost_records,
        "damaged_shards": [os.path.basename(f) for f in plan.damaged],
    }


def format_summary(s: dict) -> str:
    return (f"tfdp: done: {s['epochs']} epochs, validation top-1 {100 * s['val_top1']:.2f}% "
            f"(best {100 * s['best_val_top1']:.2f}% at epoch {s['best_epoch']}), "
            f"{s['seconds_per_epoch']:.1f} s/epoch, {s['images_per_sec']:.0f} images/s "
            f"on {s['replicas']} replica(s), global batch {s['global_batch']}"
            + (f"; skipped {s['corrupt_images']} corrupt training image(s)" if s.get("corrupt_images") else "")
            + (f"; {s['lost_records']} record(s) lost from cut-short shard(s) {', '.join(s['damaged_shards'])}"
               if s.get("lost_records") else ""))
