"""Atomic, resumable checkpoints under `model_dir/checkpoints/`.

Layout:
  epoch-0003/model.weights.h5   weights and optimizer state after 3 epochs
  epoch-0003/state.json         {"epoch": 3, "best": {...}}
  best.weights.h5, best.json    the best epoch by the configured metric

Every write goes to a temporary name first and is renamed into place only
when complete (a rename is atomic on POSIX file systems), so a run killed at
any instant leaves either the previous checkpoint or the new one, never half
of one. `latest()` only ever sees complete `epoch-*` directories.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import keras

from tfdp.errors import UserError

KEEP_LATEST = 2
_EPOCH_DIR = re.compile(r"^epoch-(\d+)$")


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointStore:
    def __init__(self, model_dir: str):
        self.root = os.path.join(model_dir, "checkpoints")

    def completed_epochs(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        found = (_EPOCH_DIR.match(name) for name in os.listdir(self.root))
        return sorted(int(m.group(1)) for m in found if m)

    def latest_state(self) -> dict[str, Any] | None:
        epochs = self.completed_epochs()
        if not epochs:
            return None
        with open(os.path.join(self._epoch_dir(epochs[-1]), "state.json"), encoding="utf-8") as f:
            return json.load(f)

    def restore_latest(self, model: keras.Model) -> dict[str, Any] | None:
        """Loads weights and optimizer state of the newest complete epoch; None if there is none.

        The optimizer must already be built, or Keras would skip its state.
        """
        state = self.latest_state()
        if state is not None:
            path = os.path.join(self._epoch_dir(state["epoch"]), "model.weights.h5")
            try:
                model.load_weights(path)
            except (ValueError, KeyError) as e:
                raise UserError(f"cannot resume from {path}: it does not fit model '{model.name}' "
                                f"(changed architecture or class count? use a new model_dir): "
                                f"{str(e).strip().splitlines()[0][:200]}") from None
        return state

    def save(self, model: keras.Model, state: dict[str, Any]) -> str:
        """Writes `epoch-N/` (N = state['epoch']) atomically, then prunes older epochs."""
        os.makedirs(self.root, exist_ok=True)
        final = self._epoch_dir(state["epoch"])
        tmp = os.path.join(self.root, f".tmp-{os.path.basename(final)}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        model.save_weights(os.path.join(tmp, "model.weights.h5"))
        atomic_write_text(os.path.join(tmp, "state.json"), json.dumps(state, indent=1))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        self._prune()
        return final

    def save_best(self, model: keras.Model, record: dict[str, Any]) -> None:
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".tmp-best-{os.getpid()}.weights.h5")
        model.save_weights(tmp)
        os.replace(tmp, self.best_weights)
        atomic_write_text(os.path.join(self.root, "best.json"), json.dumps(record, indent=1))

    @property
    def best_weights(self) -> str:
        return os.path.join(self.root, "best.weights.h5")

    def remove_partial(self) -> None:
        """Deletes temporaries a killed run left behind; they were never complete."""
        if os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(".tmp-"):
                    path = os.path.join(self.root, name)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

    def _epoch_dir(self, epoch: int) -> str:
        return os.path.join(self.root, f"epoch-{epoch:04d}")

    def _prune(self) -> None:
        for epoch in self.completed_epochs()[:-KEEP_LATEST]:
            shutil.rmtree(self._epoch_dir(epoch), ignore_errors=True)
