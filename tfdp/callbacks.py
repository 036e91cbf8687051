"""Keras callbacks for timing, the metrics log and checkpoints.

They run in list order on one shared `logs` dict: `EpochStats` adds the
learning rate and throughput first, so the metrics log and checkpoints see them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import keras

from tfdp.checkpoints import CheckpointStore, atomic_write_text


class EpochStats(keras.callbacks.Callback):
    """Adds `lr`, `seconds` (training part of the epoch), `images_per_sec` and `corrupt_images` to the logs.

    The per-batch logs get `lr` and a running `images_per_sec` too, so the
    progress bar (which Keras runs after every other callback) shows them.
    """

    def __init__(self, global_batch: int, steps_per_epoch: int, corrupt=None):
        super().__init__()
        self.corrupt = corrupt  # tfdp.data.pipeline.CorruptCounter: images skipped so far
        self.global_batch = global_batch
        self.images_per_epoch = global_batch * steps_per_epoch
        self._start = self._train_end = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._train_end = 0.0

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None:
            logs["lr"] = self._lr()
            logs["images_per_sec"] = (batch + 1) * self.global_batch / (time.perf_counter() - self._start)

    def _lr(self) -> float:
        return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def on_test_begin(self, logs=None):
        if self._start and not self._train_end:
            self._train_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = (self._train_end or time.perf_counter()) - self._start
        logs["lr"] = self._lr()
        logs["seconds"] = seconds
        logs["images_per_sec"] = self.images_per_epoch / seconds
        if self.corrupt is not None:
            logs["corrupt_images"] = self.corrupt.value()


def read_metrics(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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


class Checkpointer(keras.callbacks.Callback):
    """Saves every epoch (atomically) and keeps the best one by `monitor`."""

    def __init__(self, store: CheckpointStore, monitor: str, best: dict[str, Any] | None):
        super().__init__()
        self.store = store
        self.monitor = monitor
        self.best = best
        self._higher_is_better = not monitor.endswith("loss")

    def on_epoch_end(self, epoch, logs=None):
        value = float(logs[self.monitor])
        if self._improved(value):
            self.best = {"epoch": epoch + 1, "metric": self.monitor, "value": value}
            self.store.save_best(self.model, self.best)
        self.store.save(self.model, {"epoch": epoch + 1, "best": self.best})

    def _improved(self, value: float) -> bool:
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


def tensorboard(log_dir: str, profile_steps: tuple[int, int]) -> keras.callbacks.Callback:
    """Keras' TensorBoard writer: per-epoch scalars (every key in the logs) and an optional profile."""
    return keras.callbacks.TensorBoard(log_dir=log_dir, update_freq="epoch", write_graph=False,
                                       profile_batch=tuple(profile_steps) if profile_steps[0] else 0)
