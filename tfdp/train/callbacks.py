"""Keras callbacks for timing, the metrics log and checkpoints.

They run in list order on one shared `logs` dict: `EpochStats` adds the
learning rate and throughput first, so the metrics log and checkpoints see them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from typing import Any, Callable

import keras

from tfdp.errors import atomic_write_text
from tfdp.rundir.checkpoints import CheckpointStore
from tfdp.errors import Preempted
from tfdp.distribute.preemption import PreemptionWatch
from tfdp.distribute.replica_state import ReplicaSnapshot, metric_totals, restore_metric_totals
from tfdp.train.divergence import check_finite_weights, last_checkpoint_words


class EpochStats(keras.callbacks.Callback):
    """Adds `lr`, `seconds` (training part of the epoch), `images_per_sec`, `corrupt_images` and (progressive
    resizing) `image_size` to the logs.

    With a live progress bar the per-batch logs get `lr` and a running
    `images_per_sec` too (Keras runs the bar after every other callback).
    Throughput counts the steps this process ran, so the partial first epoch
    of a resumed run is timed correctly. `images_per_sec_after_first_step`
    leaves out the epoch's first step (its tracing): a run of one epoch has no
    later epoch to time, and a short one spends most of its epoch tracing.
    """

    def __init__(self, global_batch: int, corrupt=None, live: bool = False,
                 image_size: Callable[[], int] | None = None):
        super().__init__()
        self.corrupt = corrupt  # tfdp.data.counting.CorruptCounter: images skipped so far
        self.image_size = image_size  # progressive resizing: the side of the images this epoch trains on
        self.global_batch = global_batch
        self.live = live  # a progress bar shows per-batch values (a terminal); otherwise none are computed
        self._start = self._train_end = self._first_end = 0.0
        self._steps = self._first_steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._train_end = self._first_end = 0.0
        self._steps = self._first_steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps = batch + 1
        if not self._first_steps:   # the first call (of train.steps_per_execution steps): tracing ends here
            self._first_end, self._first_steps = time.perf_counter(), self._steps
        # Reading the learning rate waits for the step in flight; without a progress bar to show it, that
        # wait would only keep the host from queueing the next step.
        if self.live and logs is not None:
            logs["lr"] = self._lr()
            logs["images_per_sec"] = self._steps * self.global_batch / (time.perf_counter() - self._start)

    def _lr(self) -> float:
        return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def on_test_begin(self, logs=None):
        if self._start and not self._train_end:
            self._train_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = (self._train_end or time.perf_counter()) - self._start
        logs["lr"] = self._lr()
        logs["seconds"] = seconds
        logs["images_per_sec"] = self._steps * self.global_batch / seconds
        if self._steps > self._first_steps > 0:
            after = (self._train_end or time.perf_counter()) - self._first_end
            logs["images_per_sec_after_first_step"] = (self._steps - self._first_steps) * self.global_batch / after
        if self.corrupt is not None:
            logs["corrupt_images"] = self.corrupt.value()
        if self.image_size is not None:
            logs["image_size"] = self.image_size()


class MetricsLog(keras.callbacks.Callback):
    """One JSON line per epoch in `path`, after the `previous` rows of the epochs a resumed run keeps.

    The file is rewritten atomically each epoch, so after any crash and resume
    every epoch appears exactly once.
    """

    def __init__(self, path: str, previous: list[dict[str, Any]]):
        super().__init__()
        self.path = path
        self.rows = list(previous)

    def on_train_begin(self, logs=None):
        self._write()

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()}}
        self.rows.append(row)
        self._write()

    def _write(self):
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))


class AverageReplicaState(keras.callbacks.Callback):
    """Averages the non-trained state (batch-norm statistics) over replicas before every validation,
    so validation, like the checkpoints, sees the one model every replica agrees on; at the end of an
    epoch without validation (train.validate), the same, for the epoch checkpoint."""

    def __init__(self, average: Callable[[], None]):
        super().__init__()
        self.average = average
        self._averaged = False

    def on_epoch_begin(self, epoch, logs=None):
        self._averaged = False

    def on_test_begin(self, logs=None):
        self.average()
        self._averaged = True

    def on_epoch_end(self, epoch, logs=None):
        if not self._averaged:   # at the point validation would have: the run computes the same either way
            self.average()


class EmaEvaluation(keras.callbacks.Callback):
    """With `optimizer.ema_decay`: each epoch also evaluates the weights' moving average (`val_ema_*`).

    The averages are swapped into the model for one more pass over the
    validation split and swapped out again, as timm's `--model-ema` evaluates
    both; `train.best_metric: val_ema_top1` then picks the best checkpoint by
    them. Batch-norm statistics: under rules timm and torchvision the EMA's own
    (their averages, as timm's and torchvision's EMA models hold them); under
    keras rules the raw model's (replica-averaged), Keras averaging trainable
    weights only. Every worker runs it (a collective).
    """

    def __init__(self, validation):
        super().__init__()
        self.validation = validation

    def on_epoch_end(self, epoch, logs=None):
        with ema_weights(self.model):
            result = self.model.evaluate(self.validation, verbose=0, return_dict=True)
        if logs is not None:
            logs.update({f"val_ema_{name}": float(value) for name, value in result.items()})


@contextlib.contextmanager
def ema_weights(model: keras.Model):
    """The optimizer's moving averages in place of the trained weights (and, under rules timm and
    torchvision, of the batch-norm statistics), which are put back after."""
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)   # mixed_float16's loss scaling wraps it
    # All trained variables, frozen ones too (train.freeze): what the averages follow; then the buffers.
    averaged = [*optimizer._trainable_variables, *getattr(optimizer, "tfdp_buffers", ())]
    averages = [*optimizer._model_variables_moving_average, *getattr(optimizer, "tfdp_buffer_averages", ())]
    raw = [keras.ops.convert_to_numpy(v) for v in averaged]
    for variable, average in zip(averaged, averages):
        variable.assign(average)
    try:
        yield
    finally:
        for variable, value in zip(averaged, raw):
            variable.assign(value)


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """What a run tells its `Checkpointer`: the metric that picks the best epoch (and the best so far), the
    epoch length, how often to save mid-epoch, and where the run resumed (epoch, step in it) with that
    checkpoint's metric totals, and the facts every checkpoint records about the batch and layout that wrote
    it (`tfdp.train.input_streams.run_facts`)."""
    monitor: str
    steps_per_epoch: int
    every_steps: int = 0
    best: dict[str, Any] | None = None
    resume: tuple[int, int] = (0, 0)
    resume_metrics: dict[str, list[float]] | None = None
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)


class Checkpointer(keras.callbacks.Callback):
    """Saves every epoch and every `every_steps` steps (atomically), keeps the best epoch by `monitor`,
    and stops at an agreed step on a preemption notice.

    A step checkpoint holds what a mid-epoch resume needs beyond the weights:
    the global step, each worker's input position (`input_state(steps)`, a
    collective), the metric accumulators of the partial epoch, and every
    replica's own batch-norm statistics (`snapshot`); the saved weights hold
    their average (`average`), as evaluation and export read them. `settings` holds the rest
    (`CheckpointSettings`: the monitored metric, where the run resumed, ...).

    No checkpoint holds a nan or inf weight: the weights are checked before
    each write, and non-finite ones end the run (`Diverged`, with `hint`: what
    to change) keeping the checkpoints already written; an epoch whose
    monitored metric is not a number is never the best.
    """

    def __init__(self, store: CheckpointStore, settings: CheckpointSettings, *, average: Callable[[], None],
                 input_state: Callable[[int], list], snapshot: ReplicaSnapshot, watch: PreemptionWatch | None = None,
                 hint: str = "lower optimizer.lr or set optimizer.clip_norm"):
        super().__init__()
        self.hint = hint
        self.store = store
        self.monitor = settings.monitor
        self.best = settings.best
        self._higher_is_better = not settings.monitor.endswith("loss")
        self.steps_per_epoch = settings.steps_per_epoch
        self.every_steps = settings.every_steps
        self.average = average
        self.input_state = input_state
        self.watch = watch
        self.resume = settings.resume
        self.resume_metrics = settings.resume_metrics
        self.snapshot = snapshot
        self._epoch = self._offset = 0
        self._fit_steps = 0
        self.facts = settings.facts

    def on_train_begin(self, logs=None):
        self._fit_steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._offset = self.resume[1] if epoch == self.resume[0] else 0
        if self._offset and self.resume_metrics:
            restore_metric_totals(self.model, self.resume_metrics)

    def on_train_batch_end(self, batch, logs=None):
        self._fit_steps += 1
        in_epoch = self._offset + batch + 1
        if in_epoch >= self.steps_per_epoch:
            return  # the epoch checkpoint follows validation
        global_step = self._epoch * self.steps_per_epoch + in_epoch
        due = self.every_steps and global_step % self.every_steps == 0
        preempted = self.watch is not None and self.watch.agreed()
        if due or preempted:
            self._save_step(global_step, in_epoch)
        if preempted:
            raise Preempted(f"saved at step {global_step} (epoch {self._epoch + 1}, step {in_epoch})")

    def _save_step(self, global_step: int, in_epoch: int) -> None:
        """Saves the replica-averaged weights, and each replica's own state beside them, leaving the
        run exactly as it was: where checkpoints are taken never changes what it computes."""
        own = self.snapshot.take()
        self.average()
        self._check_weights(f"step {global_step} (epoch {self._epoch + 1})")
        state = {"epoch": self._epoch, "step": global_step, "step_in_epoch": in_epoch, "best": self.best,
                 "input": self.input_state(self._fit_steps), "metrics": metric_totals(self.model), **self.facts}
        self.store.save(self.model, state, kind="step", replica_state=own)
        self.snapshot.put_back(own)

    def _check_weights(self, where: str) -> None:
        check_finite_weights(self.model, where, lambda: last_checkpoint_words(self.store), self.hint)

    def on_epoch_end(self, epoch, logs=None):
        # Workers that skip validation (train.validate) have no val_ metric: the evaluator keeps the best.
        value = float(logs[self.monitor]) if self.monitor in logs else math.nan
        self._check_weights(f"step {(epoch + 1) * self.steps_per_epoch} (the end of epoch {epoch + 1})")
        if self._improved(value):
            self.best = {"epoch": epoch + 1, "metric": self.monitor, "value": value}
            # Chosen by the moving average's metrics, the best checkpoint holds the moving average.
            with ema_weights(self.model) if self.monitor.startswith("val_ema_") else contextlib.nullcontext():
                self.store.save_best(self.model, self.best)
        self.store.save(self.model, {"epoch": epoch + 1, "step": (epoch + 1) * self.steps_per_epoch,
                                     "step_in_epoch": 0, "best": self.best,
                                     "input": self.input_state(self._fit_steps), **self.facts})
        if self.watch is not None and self.watch.agreed():
            raise Preempted(f"saved at the end of epoch {epoch + 1}")

    def _improved(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value > self.best["value"] if self._higher_is_better else value < self.best["value"]


class WandbLog(keras.callbacks.Callback):
    """Sends each epoch's logs to Weights & Biases (only wired in on the chief)."""

    def __init__(self, project: str, mode: str, run_dir: str, config: dict[str, Any], initial_epoch: int):
        super().__init__()
        import wandb
        self._wandb = wandb
        # A resumed run continues the same W&B run: its id is fixed by the model_dir.
        run_id = "tfdp-" + hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]
        self.run = wandb.init(project=project, mode=mode, dir=run_dir, config=config, id=run_id,
                              resume="allow", reinit=True)
        self.initial_epoch = initial_epoch

    def on_epoch_end(self, epoch, logs=None):
        self.run.log({k: float(v) for k, v in (logs or {}).items()}, step=epoch + 1)

    def on_train_end(self, logs=None):
        self.run.finish()


def tensorboard(log_dir: str, profile_steps: tuple[int, int], initial_epoch: int = 0) -> keras.callbacks.Callback:
    """Keras' TensorBoard writer: per-epoch scalars (every key in the logs) and an optional profile.

    A run that finds runs logged before it (a resume) first marks a restart
    at its first epoch, so TensorBoard drops whatever a killed run had logged
    from that epoch on (its 'orphaned data' purge) and every epoch shows once.
    Epoch 0 too: a run killed after logging epoch 0 but before its epoch
    checkpoint resumes inside epoch 0 and logs it again.
    """
    mark_restart(log_dir, initial_epoch)   # nothing to mark in a new run
    return FlushingTensorBoard(log_dir=log_dir, update_freq="epoch", write_graph=False,
                               profile_batch=tuple(profile_steps) if profile_steps[0] else 0)


class FlushingTensorBoard(keras.callbacks.TensorBoard):
    """Keras' TensorBoard callback, flushed every epoch: TensorFlow's writers otherwise hold events up
    to two minutes, and a killed or preempted run would lose epochs it had finished."""

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._train_writer.flush()
        self._val_writer.flush()


KERAS_RUNS = ("train", "validation")   # the run folders Keras' TensorBoard callback writes


def mark_restart(log_dir: str, step: int) -> None:
    """Writes a restart at `step` into each existing run folder Keras writes (train/, validation/); the
    evaluator's eval/ is its own (tfdp/commands/continuous_eval.py).

    TensorBoard takes the first SessionLog START of a run for its session's start and purges at the later
    ones only, and Keras' writers write none: so a restart is two STARTs, the second of which purges.
    TensorBoard reads a run's event files in name order, and a name holds its second, host, pid and a
    per-writer counter: the file is named to sort before every file this run's writers open in the same
    second (a counter of '12' would sort before one of '2'), so the restart precedes the run's events."""
    import socket
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter
    if not os.path.isdir(log_dir):
        return
    now = time.time()
    events = [event_pb2.Event(wall_time=now, file_version="brain.Event:2")] + [
        event_pb2.Event(wall_time=now, step=step, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
        for _ in range(2)]
    for name in KERAS_RUNS:
        run = os.path.join(log_dir, name)
        if os.path.isdir(run):   # a bucket run's copy has the folders of the run's events, not the files
            # '-' sorts before the '.' that follows the second in the names TensorFlow's writers give.
            path = os.path.join(run, f"events.out.tfevents.{int(now):010d}-restart.{socket.gethostname()}.{os.getpid()}")
            with open(path, "wb") as f:
                writer = RecordWriter(f)
                for event in events:
                    writer.write(event.SerializeToString())
