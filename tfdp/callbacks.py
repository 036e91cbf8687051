"""Keras callbacks for timing, the metrics log and checkpoints.

They run in list order on one shared `logs` dict: `EpochStats` adds the
learning rate and throughput first, so the metrics log and checkpoints see them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import keras

from tfdp.checkpoints import CheckpointStore, atomic_write_text


class EpochStats(keras.callbacks.Callback):
    """Adds `lr`, `seconds` (training part of the epoch) and `images_per_sec` to the logs."""

    def __init__(self, global_batch: int, steps_per_epoch: int):
        super().__init__()
        self.images_per_epoch = global_batch * steps_per_epoch
        self._start = self._train_end = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._train_end = 0.0

    def on_test_begin(self, logs=None):
        if self._start and not self._train_end:
            self._train_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = (self._train_end or time.perf_counter()) - self._start
        logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        logs["seconds"] = seconds
        logs["images_per_sec"] = self.images_per_epoch / seconds


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
