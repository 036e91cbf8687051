"""A training run held in one object: built once from (config, runtime, source, plan), read by the trainer.

`Run.build` asks the run's `ClassificationTask` for the model compiled for
training (in the strategy's scope), plans its frozen layers, restores the
latest checkpoint and lets the task fill a fresh run from `model.init_from`;
the `Plan` it is given already holds the run's two decisions, the batch
layout and XLA (`tfdp.train.task.make_plan`, made once). What runs the run
(`tfdp.train.trainer.Trainer.fit_all`) takes the run and asks it for the parts it
needs, the input streams, the validation data, the checkpointer's settings,
rather than taking ten of them. Nothing here prints: the trainer prints what
the run reports (`xla_line`, `input_streams`' line).
"""

from __future__ import annotations

import dataclasses

import keras

from tfdp.train.callbacks import CheckpointSettings
from tfdp.rundir.checkpoints import CheckpointStore
from tfdp.config import Config
from tfdp.data import Source
from tfdp.data.counting import CorruptCounter
from tfdp.train.input_streams import Streams, check_global_batch, plan_streams, run_facts
from tfdp.optim.finetune import Freezing
from tfdp.distribute.replica_state import ReplicaSnapshot
from tfdp.distribute.strategy import Runtime
from tfdp.train.task import ClassificationTask, Plan, TrainStream


@dataclasses.dataclass
class Run:
    """One training run: what it was asked (config), where it runs (runtime), what it reads (source), how
    it is sized and compiled (plan: global batch, layout, XLA), its model and frozen layers, and the
    checkpoint it resumes from (`state`; None for a fresh run)."""
    cfg: Config
    runtime: Runtime
    source: Source
    plan: Plan
    task: ClassificationTask
    model: keras.Model
    freezing: Freezing
    state: dict | None

    @classmethod
    def build(cls, cfg: Config, runtime: Runtime, source: Source, plan: Plan, model_dir: str) -> "Run":
        """Model (in the strategy's scope), frozen layers, XLA line, checkpoint restore, `model.init_from`."""
        task = ClassificationTask(cfg, runtime, source)
        with runtime.strategy.scope():
            model = task.build_model("train", plan)
        freezing = Freezing.plan(cfg.train, cfg.model.name, model)  # train.freeze checked against the model's layers
        state = CheckpointStore(model_dir).restore_latest(model)
        check_global_batch(state, plan.layout)
        task.initialize(model, resumed=state is not None)
        return cls(cfg, runtime, source, plan, task, model, freezing, state)

    @property
    def resume(self) -> tuple[int, int]:
        """(epoch, step in it) where this run starts: the checkpoint's, or (0, 0)."""
        return (self.state["epoch"], self.state.get("step_in_epoch", 0)) if self.state else (0, 0)

    def train_stream(self, corrupt: CorruptCounter | None, streams: Streams) -> TrainStream:
        """This worker's training pipeline over the input `streams` it reads, startable at any position."""
        return self.task.build_train_inputs(self.plan, corrupt, streams)

    def input_streams(self) -> tuple[Streams, str]:
        """The input streams this worker reads, at the checkpoint's positions (`tfdp.train.input_streams`; a
        fresh run: its own stream from the start), and the line a layout change prints: exact, or why not
        ('' when the layout is the checkpoint's)."""
        state, runtime = self.state, self.runtime
        steps_done = state.get("step", state["epoch"] * self.plan.steps_per_epoch) if state else 0
        return plan_streams(state, runtime.num_workers, runtime.worker_index, steps_done,
                            self.plan.global_batch, bool(self.cfg.data.service_address))

    def xla_line(self) -> str:
        jit, why = self.plan.xla
        return f"tfdp: xla: {'on' if jit else 'off'} ({why})"

    def validation(self):
        """Per-worker validation pipelines at the run's micro-batch per replica."""
        return self.task.build_validation_inputs(self.plan.layout, self.plan.decoder)

    def replica_snapshot(self) -> ReplicaSnapshot:
        """Each replica's own non-trained state, put back as the checkpoint saved it when its layout fits."""
        snapshot = ReplicaSnapshot(self.model)
        own = self.state.get("replica_state") if self.state else None
        if own is not None and own.shape == (self.runtime.num_replicas, snapshot.width):
            snapshot.put_back(own)  # each replica's statistics as they were, not just their saved average
        return snapshot

    def checkpoint_settings(self, streams: Streams) -> CheckpointSettings:
        """The checkpointer's part of the run: best metric (and best so far), epoch length, step interval,
        resume point and that checkpoint's metric totals, and what every checkpoint records about the batch
        and layout that wrote it (the run's number of input `streams` among them)."""
        state = self.state
        return CheckpointSettings(self.cfg.train.best_metric, self.plan.steps_per_epoch,
                                  self.cfg.train.checkpoint_every_steps, state["best"] if state else None,
                                  self.resume, state.get("metrics") if state else None,
                                  run_facts(self.plan.layout, self.runtime.num_workers, streams.count))
