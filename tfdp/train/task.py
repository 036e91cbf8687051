"""The image-classification task, as Model Garden's (`official/vision/tasks/image_classification.py`):
one object, built once from the config, that builds each part a command needs and nothing it does not.

`ClassificationTask` holds the config (and, for what reads data, the runtime
and the listed source). `train` sizes a run first (`make_plan`: the global
batch, its layout on the replicas, XLA), then asks the task for the model
compiled for training, its losses and metrics, the weights it starts from,
its training stream (`TrainStream`) and its validation data; `evaluate` asks
for the model compiled for evaluation only and the validation data (no
optimizer, no training pipeline, no listing of the training data); `export`
and `predict` ask for the bare model. Everything is built inside the
strategy scope the caller holds; nothing here branches on the strategy.
"""

from __future__ import annotations

import dataclasses
import os
import secrets

import keras
import tensorflow as tf

from tfdp.config import Config, TrainConfig
from tfdp.data import Source
from tfdp.data import dali, streaming
from tfdp.data.counting import CorruptCounter, StreamPosition
from tfdp.data.preprocess import DECODERS
from tfdp.data.service import client as service
from tfdp.data.pipeline import Bookkeeping, eval_dataset, prediction_dataset, streams_dataset, train_dataset
from tfdp.data.storage import is_remote_url
from tfdp.errors import UserError
from tfdp.optim.finetune import scale_learning_rates
from tfdp.keras_patches.eval_step import install_exact_eval_loss
from tfdp.augment import build_batch_augment
from tfdp.train.global_batch import BatchLayout, CheckpointBatch, batch_layout, resumed_layout
from tfdp.train.input_streams import Streams
from tfdp.keras_patches.train_step import augment_before_step, compile_train_step, use_xla
from tfdp.optim.losses import BinaryCrossEntropy, SparseSmoothedCrossentropy, Top1, TopK
from tfdp.models import build_model
from tfdp.models.weights import init_from
from tfdp.optim.ema import EmaTiming
from tfdp.optim.optimizers import build_optimizer, track_buffers
from tfdp.distribute.replica_state import WorkerGather
from tfdp.optim.schedules import build_schedule
from tfdp.train.distillation import build_teacher, install_distillation
from tfdp.distribute.strategy import Runtime
from tfdp.startup.console import say


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
    accum_steps: int = 1            # micro-batches per optimizer step (a step is always an optimizer step)
    # How the global batch is cut on the replicas found (`tfdp.train.global_batch`); None in a Plan built by hand.
    layout: BatchLayout | None = None
    # Whole-step XLA, on or off, and why (`use_xla` on the run's devices): decided here, once per run.
    # None in a Plan built by hand: `compile_model` then decides on the devices of the scope it runs in.
    xla: tuple[bool, str] | None = None
    # The line a resume prints where its global batch, the checkpoint's, is cut differently ('' otherwise).
    resume_line: str = ""
    # Who decodes the training images, data.decoder with auto resolved on the run's devices (`tfdp.data.dali`).
    decoder: str = "tf"

    def micro_batch(self) -> int:
        """Images per micro-batch over all replicas: what one forward pass sees, and the evaluation batch."""
        return self.global_batch // self.accum_steps


class ClassificationTask:
    """What every command builds, from one config: `build_model` (for training, evaluation or serving),
    `build_losses`, `build_metrics`, `initialize` (the weights a fresh run starts from), and the inputs:
    `build_train_inputs`, `build_validation_inputs` and `build_predict_inputs`. `runtime` and `source` are needed only by what reads
    data; call the builders inside the runtime's strategy scope so variables are mirrored."""

    def __init__(self, cfg: Config, runtime: Runtime | None = None, source: Source | None = None):
        self.cfg, self.runtime, self.source = cfg, runtime, source

    def build_model(self, purpose: str = "train", plan: "Plan | None" = None) -> keras.Model:
        """`train`: compiled with the optimizer and schedule `plan` sizes (XLA as it decided); `evaluate`:
        compiled with loss and metrics only; `serve`: the bare model, for export and prediction."""
        if purpose not in MODELS_FOR:
            raise ValueError(f"purpose must be one of {', '.join(MODELS_FOR)}, got {purpose!r}")
        return MODELS_FOR[purpose](self.cfg, plan)

    def build_losses(self) -> keras.losses.Loss:
        return build_loss(self.cfg.train)

    def build_metrics(self) -> list[keras.metrics.Metric]:
        return build_metrics(self.cfg)

    def initialize(self, model: keras.Model, resumed: bool) -> None:
        """A fresh run's weights from `model.init_from` (none for a resumed one: its checkpoint has them)."""
        init_from(model, self.cfg.model, self.cfg.data, resumed=resumed)

    def build_train_inputs(self, plan: "Plan", corrupt: CorruptCounter | None,
                           streams: Streams | None = None) -> "TrainStream":
        """This worker's training pipeline over the input `streams` it reads, startable at any position."""
        return TrainStream(self.cfg, self._source(), self._runtime(), plan, corrupt, streams)

    def build_validation_inputs(self, layout: BatchLayout | None = None, decoder: str = ""):
        """Per-worker validation pipelines (`validation_dataset`): at a training run's `layout` and with its
        decoder (`Plan.decoder`), or, for `tfdp evaluate` (None, ''), at the replicas found, with data.decoder
        resolved on them."""
        source, runtime = self._source(), self._runtime()
        if not decoder:
            decoder = dali.choose(self.cfg.data, list(runtime.devices))
            if decoder == "dali":
                say("tfdp: data: validation images decoded and cropped by DALI on each replica's device "
                    "(data.decoder)")
        return validation_dataset(self.cfg, source, runtime, layout, decoder)

    def build_predict_inputs(self, files: list[str], global_batch: int, decoder: str = "tf"):
        """`files` as per-replica batches of (image number, uint8 image) for `tfdp predict`
        (`pipeline.prediction_dataset`): every replica gets full batches, unreadable images are left out.
        `decoder`: who decodes (tf, or dali: a DALI pipeline per replica, `tfdp.data.dali.distribute_prediction`)."""
        runtime, data = self._runtime(), dataclasses.replace(self.cfg.data, decoder=decoder)

        def worker_dataset(ctx):
            return prediction_dataset(files, data, global_batch, ctx)
        if DECODERS[decoder].dealt:
            return dali.distribute_prediction(runtime, worker_dataset, data, global_batch)
        return runtime.strategy.distribute_datasets_from_function(worker_dataset)

    def _source(self) -> Source:
        if self.source is None:
            raise ValueError("this task was built without the data's source")
        return self.source

    def _runtime(self) -> Runtime:
        if self.runtime is None:
            raise ValueError("this task was built without a runtime")
        return self.runtime


def make_plan(cfg: Config, source: Source, runtime: Runtime, checkpoint: dict | None = None) -> Plan:
    """The run's sizes and the two decisions every later part reads: the batch layout and XLA.

    `checkpoint` is the state of the checkpoint the run resumes (None: a fresh
    run). A resume keeps its global batch whatever the hardware found
    (`tfdp.train.global_batch.resumed_layout`), so the schedule, steps per epoch and
    stream position built from this Plan are the checkpoint's."""
    if source.num_classes and source.num_classes != cfg.model.num_classes:  # 0: unknown until labels are read
        raise UserError(f"the data has {source.num_classes} classes but model.num_classes is {cfg.model.num_classes}")
    train, val = source.split(cfg.data.train_split), source.split(cfg.data.val_split)
    layout, resume_line = resumed_layout(cfg.train, runtime.num_replicas, CheckpointBatch.of(checkpoint))
    global_batch = layout.global_batch
    steps = train.num_examples // global_batch
    if steps == 0:
        raise UserError(f"the training split has {train.num_examples} images, fewer than one global batch "
                        f"of {global_batch} ({layout.per_replica} per replica x {runtime.num_replicas} replicas x "
                        f"{layout.accum_steps} accumulation steps)")
    return Plan(global_batch, steps, train.num_examples, val.num_examples, cfg.model.num_classes,
                train.lost_records + val.lost_records,
                tuple(f for split in (train, val) for f, n in zip(split.files, split.lost) if n),
                accum_steps=layout.accum_steps, layout=layout,
                xla=use_xla(cfg.train.jit_compile, runtime.devices, cfg.model.sync_bn), resume_line=resume_line,
                decoder=dali.choose(cfg.data, list(runtime.devices)))


def compile_model(cfg: Config, plan: Plan) -> keras.Model:
    """The model compiled for training: optimizer, loss, metrics, XLA as configured.

    Call inside `strategy.scope()` so variables are mirrored.
    """
    schedule = build_schedule(cfg.schedule, cfg.optimizer.lr, plan.global_batch, plan.steps_per_epoch, cfg.train.epochs,
                              cfg.rules, cfg.optimizer)
    optimizer = build_optimizer(cfg.optimizer, schedule, cfg.rules, EmaTiming(
        plan.global_batch, plan.steps_per_epoch, cfg.train.epochs, cfg.schedule.warmup_epochs or 0.0))
    model = _compiled(cfg, optimizer)
    if cfg.train.teacher.distillation != "none":   # the teacher's logits in the student's loss (tfdp/train/distillation.py)
        install_distillation(model, build_teacher(cfg), cfg.train.teacher)
    jit = (plan.xla or use_xla(cfg.train.jit_compile, current_devices(), cfg.model.sync_bn))[0]
    if jit or plan.accum_steps > 1:
        # Whole-step XLA per replica (Keras' own jit fails with several replicas); accumulation needs this step.
        compile_train_step(model, jit, plan.accum_steps)
    # Label smoothing stays the loss's: smoothing the mixed targets equals mixing smoothed ones.
    augment = build_batch_augment(cfg.augment, cfg.model.num_classes, mean=cfg.data.mean, std=cfg.data.std)
    if augment is not None:
        augment_before_step(model, augment, cfg.train.seed, jit)
    # Built now, not lazily in the first step, so a checkpoint can restore its state; over every variable, before
    # train.freeze freezes any (tfdp/optim/finetune.py), so its state has one shape in every phase.
    optimizer.build(model.trainable_variables)
    track_buffers(optimizer, model)   # rules timm/torchvision: the EMA averages batch-norm statistics too
    scales = scale_learning_rates(cfg, model, optimizer)  # optimizer.layer_decay, optimizer.head_lr_multiplier
    if scales:
        say(scales)
    return model


def _training_model(cfg: Config, plan: "Plan | None") -> keras.Model:
    if plan is None:
        raise ValueError("a model for training needs the run's plan")
    return compile_model(cfg, plan)


def evaluation_model(cfg: Config) -> keras.Model:
    """The model compiled for evaluation only: loss and metrics, no optimizer, no schedule, no training data.

    Call inside `strategy.scope()` to evaluate on every replica.
    """
    return _compiled(cfg, optimizer="sgd")  # Keras wants one to compile; it is never built or used


def serving_model(cfg: Config) -> keras.Model:
    """The bare model, for export: no optimizer, no metrics."""
    return model_in_precision(cfg)


# ClassificationTask.build_model's purposes -> (config, plan) -> the model built for it.
MODELS_FOR = {
    "train": _training_model,
    "evaluate": lambda cfg, plan: evaluation_model(cfg),
    "serve": lambda cfg, plan: serving_model(cfg),
}


def model_in_precision(cfg: Config) -> keras.Model:
    """`build_model` under `train.precision`, leaving Keras' global dtype policy as it was.

    The layers keep the policy they were built with (and `compile` reads the
    model's own policy for loss scaling), so nothing built later in the same
    process, a test or a notebook, inherits a run's precision by accident.
    """
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(cfg.train.precision)
    try:
        return build_model(cfg.model, cfg.data)
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _softmax_loss(train: TrainConfig) -> keras.losses.Loss:
    return SparseSmoothedCrossentropy(train.label_smoothing)


def _bce_loss(train: TrainConfig) -> keras.losses.Loss:
    return BinaryCrossEntropy(train.label_smoothing, train.bce_target_threshold)


# train.loss -> the loss it builds; config validation keeps the names to these keys.
LOSSES = {"softmax": _softmax_loss, "bce": _bce_loss}


def build_loss(train: TrainConfig) -> keras.losses.Loss:
    """The training (and validation) loss `train.loss` names, with its smoothing and threshold."""
    return LOSSES[train.loss](train)


def build_metrics(cfg: Config) -> list[keras.metrics.Metric]:
    """Top-1, and top-5 where there are more than 5 classes; weighted, so evaluation's padding never counts."""
    metrics = [Top1(name="top1")]
    if cfg.model.num_classes > 5:
        metrics.append(TopK(k=5, name="top5"))
    return metrics


def _compiled(cfg: Config, optimizer) -> keras.Model:
    model = model_in_precision(cfg)
    # mixed_float16: Keras wraps the optimizer in a LossScaleOptimizer (dynamic loss scaling).
    # Weighted metrics, so evaluation's weight-0 padding images are not counted.
    model.compile(optimizer=optimizer, loss=build_loss(cfg.train), weighted_metrics=build_metrics(cfg),
                  jit_compile=False, steps_per_execution=cfg.train.steps_per_execution)
    install_exact_eval_loss(model)  # val_loss over the real images, not the evaluation padding
    return model


def current_devices() -> list[str]:
    """The devices of the strategy whose scope we are in (outside any scope: where TensorFlow places ops)."""
    if tf.distribute.has_strategy():
        return list(tf.distribute.get_strategy().extended.worker_devices)
    return [d.name for d in tf.config.list_logical_devices("GPU")[:1]] or ["/device:CPU:0"]


def cache_parts(cfg: Config, source: Source) -> tuple[streaming.Part, streaming.Part]:
    """A training run's (training, validation) shares of data.cache_limit: both streams hold files at once."""
    train, val = source.split(cfg.data.train_split), source.split(cfg.data.val_split)
    return streaming.run_parts(any(map(is_remote_url, train.files[:1])), any(map(is_remote_url, val.files[:1])))


def validation_dataset(cfg: Config, source: Source, runtime: Runtime, layout: BatchLayout | None = None,
                       decoder: str = "tf"):
    """Per-worker validation pipelines: each worker builds (and reads) only its own share, a training
    micro-batch per replica at a time (what fits in memory). `layout`: the training run's (`Plan.layout`);
    None for `tfdp evaluate`, which derives it and has the whole data.cache_limit to itself. `decoder`: who
    decodes (tf, or dali: a DALI pipeline per replica, `tfdp.data.dali.distribute_evaluation`)."""
    val, data = source.split(cfg.data.val_split), dataclasses.replace(cfg.data, decoder=decoder)
    part = cache_parts(cfg, source)[1] if layout is not None else streaming.WHOLE
    if layout is not None and val.files == source.split(cfg.data.train_split).files:
        # Validation on the training split: its copies kept apart from the training stream's, which deletes
        # what it has read.
        data = dataclasses.replace(data, cache_dir=os.path.join(data.cache_dir, "validation"))
    try:
        per_replica = (layout or batch_layout(cfg.train, runtime.num_replicas)).per_replica
    except UserError:  # `tfdp evaluate` on replicas that could not train this global batch: it need not divide
        per_replica = cfg.train.batch_size_per_replica
    global_batch = per_replica * runtime.num_replicas

    def worker_dataset(ctx):
        return eval_dataset(val, data, global_batch, ctx, num_classes=cfg.model.num_classes, cache_part=part)
    if DECODERS[decoder].dealt:
        return dali.distribute_evaluation(runtime, worker_dataset, data, global_batch)
    return runtime.strategy.distribute_datasets_from_function(worker_dataset)


class TrainStream:
    """This worker's training pipeline, started at any position of its record stream.

    It remembers where each batch ended (`StreamPosition`), so a checkpoint
    can record the exact position after the last trained step and a resumed
    run can start there, skipping records rather than decoding them. With
    `data.service_address` the pipeline runs on the tf.data service's workers
    (`tfdp.data.service.client`) and only the counting runs here.
    """

    def __init__(self, cfg: Config, source: Source, runtime: Runtime, plan: Plan, corrupt: CorruptCounter | None,
                 streams: Streams | None = None):
        self.cfg, self.source, self.runtime, self.plan, self.corrupt = cfg, source, runtime, plan, corrupt
        self.start: tuple[int, int] = (0, 0)
        self.position: StreamPosition | None = None   # made with each dataset
        # The run's input streams this worker reads (`tfdp.train.input_streams`, `Run.input_streams`): by
        # default its own one, from the start.
        self.streams = streams or Streams(runtime.num_workers, (runtime.worker_index,), ((0, 0),))
        self.positions: list[StreamPosition] = []
        self.image_size = 0                             # the side of the current dataset's images
        # Each step takes one batch per local replica from this worker's pipeline.
        self.batches_per_step = runtime.num_replicas // runtime.num_workers
        self.gather = WorkerGather(runtime.strategy, runtime.worker_index, runtime.num_workers)
        self._run_id: int | None = None
        self._jobs = 0
        if plan.decoder == "dali":
            say("tfdp: data: training and validation images decoded and cropped by DALI on each replica's device "
                "(data.decoder)")
        if cfg.data.service_address:
            train = source.split(cfg.data.train_split)
            say(service_line(cfg, runtime.num_workers, any(map(is_remote_url, train.files))))
            service.check_workers_read(train, cfg.data, cfg.data.service_timeout)

    def dataset(self, starts: list[tuple[int, int]], image_size: int = 0):
        """The stream(s) from `starts` on (one position per stream this worker reads), cropped to
        `image_size` px (0: data.image_size; progressive resizing starts a dataset per size). Crop windows
        do not depend on the size, so resuming stays exact."""
        if starts and isinstance(starts[0], int):
            starts = [starts]  # one position: this worker's own stream
        train, cfg, plan = self.source.split(self.cfg.data.train_split), self.cfg, self.plan
        data = dataclasses.replace(cfg.data, image_size=image_size or cfg.data.image_size, decoder=plan.decoder)
        if not self.streams.single:
            return self._streams_dataset(train, data, starts)
        self.start, self.position = tuple(starts[0]), StreamPosition()
        self.positions = [self.position]
        books = Bookkeeping(self.start, self.position, self.corrupt, plan.num_classes,
                            cache_parts(cfg, self.source)[0])
        build, extra = train_dataset, {}
        if data.service_address:
            build, extra = service.train_dataset, {"job_name": self._job_name()}
            if any(self.start):
                say(service.resume_note(train, data, self.start[0], self.runtime.num_workers))
        ds = self._distributed(lambda ctx: build(train, data, plan.global_batch, cfg.train.seed, ctx, books, **extra),
                               data)
        self.image_size = data.image_size
        return ds

    def _streams_dataset(self, train, data, starts):
        """Several of the run's streams on this worker (a resume on fewer workers, `tfdp.train.input_streams`)."""
        self.starts = [tuple(p) for p in starts]
        self.positions = [StreamPosition() for _ in self.streams.mine]
        cfg, plan, streams = self.cfg, self.plan, self.streams
        part = cache_parts(cfg, self.source)[0].divided(len(streams.mine))
        books = {stream: Bookkeeping(start, position, self.corrupt if i == 0 else None, plan.num_classes, part)
                 for i, (stream, start, position) in enumerate(zip(streams.mine, self.starts, self.positions))}
        ds = self._distributed(  # corrupt images: counted on the first stream
            lambda ctx: streams_dataset(train, data, plan.global_batch, cfg.train.seed, streams.count, books, ctx),
            data)
        self.image_size = data.image_size
        return ds

    def _distributed(self, worker_dataset, data):
        """This worker's pipeline on the replicas; with DALI, its checked batches of encoded images decoded by a
        DALI pipeline per replica (`tfdp.data.dali.distribute`)."""
        runtime = self.runtime
        if not DECODERS[data.decoder].dealt:
            return runtime.strategy.distribute_datasets_from_function(worker_dataset)
        return dali.distribute(runtime, worker_dataset, data, self.plan.global_batch, self.cfg.train.seed)

    def _job_name(self) -> str:
        """The tf.data service job of the next dataset: new for every dataset (a restarted stream is a new
        job) and every run (a job name must not be reused while the service lives), and the same on every
        trainer, so that with `distributed_epoch` they all read one job. A collective on first use."""
        if self._run_id is None:
            self._run_id = secrets.randbits(48)  # not `random`: the trainer seeds it, every run alike
            if self.runtime.num_workers > 1:
                self._run_id = self.gather([self._run_id])[0][0]  # the chief's
        self._jobs += 1
        name = f"tfdp-{self._run_id:012x}-{self._jobs}"
        if self.cfg.data.service_mode != service.DISTRIBUTED:
            name += f"-trainer{self.runtime.worker_index}"  # its own share, its own job
        return name

    def local_state(self, steps: int) -> list[tuple[int, int]]:
        """(records consumed, corrupt so far) of each stream this worker reads, after `steps` steps of the
        current dataset."""
        if self.streams.single:
            return [self.start if not steps else self.position.after(steps * self.batches_per_step)]
        return [start if not steps else position.after(steps)  # one block per stream per step
                for start, position in zip(self.starts, self.positions)]

    def state(self, steps: int) -> list[list[int]]:
        """Every stream's position, indexed by stream (a collective: all workers call it)."""
        rows = self.gather([n for pair in self.local_state(steps) for n in pair])
        return [row[i:i + 2] for row in rows for i in range(0, len(row), 2)]


def service_line(cfg: Config, trainers: int, bucket: bool = False) -> str:
    """What the trainer prints once about the tf.data service it reads from (and, for training data in a
    bucket, where the service's workers must have mirrored it)."""
    what = ("this trainer's share, every service worker a pass of it" if cfg.data.service_mode != service.DISTRIBUTED
            else f"the whole training split, one job shared by {trainers} trainer(s)")
    unused = "; data.cache is not used through the service" if cfg.data.cache else ""
    mirrored = (f"; the service's workers read the bucket's training files from their mirror in "
                f"{service.workers_cache_dir(cfg.data)} (tfdp data-service worker --mirror={cfg.data.dir})"
                if bucket else "")
    return (f"tfdp: data: training input from the tf.data service at {cfg.data.service_address} "
            f"({cfg.data.service_mode}: {what}); evaluation reads locally{unused}{mirrored}")
