"""Atomic, resumable checkpoints under `model_dir/checkpoints/`.

Layout:
  epoch-0003/model.weights.h5      weights and optimizer state after 3 whole epochs
  epoch-0003/state.json            {"epoch": 3, "step": 3 * steps_per_epoch, "best": {...},
                                   "random_streams": [[seed, counter], ...], ...}
  step-000000140/...               the same, mid-epoch, every `train.checkpoint_every_steps` steps;
                                   state.json also holds the input position and partial metrics,
                                   replicas.npy each replica's own batch-norm statistics
  best.weights.h5, best.json       the best epoch by the configured metric

Every write goes to a temporary name first and is renamed into place only
when complete (a rename is atomic on POSIX file systems), so a run killed at
any instant leaves either the previous checkpoint or the new one, never half
of one. A checkpoint that is there but cannot be read (a truncated file from a
failing disk or a bad copy) is skipped with a warning naming it, and the run
resumes from the newest one that can be read. A write that fails (disk full,
read-only folder) removes its partial files and ends in one line saying what
was being written, where, and how much space it needed.

Keras' weights file leaves out the state of the model's seed generators
(the random layers': flip, dropout, drop path), so every checkpoint records
it in state.json (`random_streams`, replica 0's: the other replicas' differ
from it by a fixed offset, `tfdp.distribute.replica_state`), and a resumed
run's random layers continue their streams instead of restarting them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import warnings
import zipfile
from typing import Any

import keras
import numpy as np
import yaml

from tfdp.config import Config, yaml_floats
from tfdp.config.pretrained import run_dir_of
from tfdp.errors import UserError, atomic_write_text, first_line, write_errors

KEEP_EPOCHS = 2
KEEP_STEPS = 2
_CHECKPOINT_DIR = re.compile(r"^(epoch|step)-(\d+)$")
WEIGHTS, STATE, REPLICAS = "model.weights.h5", "state.json", "replicas.npy"
RANDOM_STREAMS = "random_streams"


def seed_generator_states(model: keras.Model) -> list:
    """The state variable of every seed generator the model owns, in the model's (fixed) order."""
    return [v for v in model.non_trainable_variables if v.path.endswith("seed_generator_state")]


def random_stream_states(model: keras.Model) -> list[list[int]]:
    """Replica 0's [seed, counter] of each seed generator: read only when a checkpoint is written, so no step
    waits for it. Under a strategy the variable's first local copy is replica 0's on the chief, the one
    worker whose checkpoints are kept."""
    states = []
    for variable in seed_generator_states(model):
        copies = getattr(variable.value, "values", None) or (variable.value,)
        states.append([int(x) for x in copies[0].numpy().reshape(-1)])
    return states


def weights_size(model: keras.Model) -> int:
    """Bytes a weights file of this model (with its optimizer state) needs, about."""
    variables = list(model.weights) + list(getattr(model.optimizer, "variables", None) or [])
    return sum(int(np.prod(v.shape)) * _itemsize(v.dtype) for v in variables)


def _itemsize(dtype) -> int:
    try:
        return np.dtype(keras.backend.standardize_dtype(dtype)).itemsize
    except TypeError:  # bfloat16 and other dtypes numpy does not name
        return 2


def load_weights(model: keras.Model, path: str, what: str) -> None:
    """Loads a weights file; one that does not fit is one line saying so and naming `what` it was loaded into.

    Keras' own warnings are silenced: they would bury that line. A file that
    cannot be read at all is `UnreadableWeights`, for the caller to decide.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.load_weights(path)
    except (OSError, zipfile.BadZipFile) as e:   # h5py's, or a `.keras` that is no zip archive
        raise UnreadableWeights(path, first_line(e, 120)) from None
    except (ValueError, KeyError) as e:
        if str(e).startswith("File format not supported"):   # Keras' words for a name it does not know
            raise UnreadableWeights(path, "not a Keras weights file: Keras reads .weights.h5, .keras and .h5") from None
        raise UserError(f"checkpoint {path} does not fit {what}: {mismatch(e)}") from None


def mismatch(error: Exception) -> str:
    """Keras' words for weights that do not fit, in one line: its message opens with a count and a colon and
    puts the example's reason (and then a dump of the variable's values) on the lines after."""
    text = str(error).strip()
    found = KERAS_MISMATCH.match(text)
    if not found:
        return text.splitlines()[0][:200] if text else type(error).__name__
    count, kind, name, reason = found.groups()
    reason = next((line for line in reason.splitlines() if line.strip()), "").split(" Target variable:")[0]
    return f"{count} layer(s) do not fit, the first {kind} '{name}': {reason.strip()[:200]}"


KERAS_MISMATCH = re.compile(r"A total of (\d+) objects could not be loaded\. Example error message for object "
                            r"<(\w+) name=([^,>]+)[^>]*>:(.*)", re.S)


class UnreadableWeights(UserError):
    """A weights file that cannot be read at all: damaged, cut short, or not Keras weights. Where it was only
    found (resuming, the evaluator beside a run) an older checkpoint is taken instead; one the user named stops
    the command in one line."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"checkpoint {path} cannot be read ({reason})")
        self.reason = reason


class CheckpointStore:
    """The checkpoints of the run whose (local) folder is `model_dir`; with an `uploader`
    (`tfdp.rundir.bucket.Uploader`), each one is also committed to the bucket the run lives in, once complete here."""

    def __init__(self, model_dir: str, uploader=None):
        self.root = os.path.join(model_dir, "checkpoints")
        self.uploader = uploader

    def checkpoints(self, warn: bool = True) -> list[tuple[int, int, str]]:
        """Complete checkpoints as (global step, 1 for an epoch checkpoint else 0, path), oldest first; one whose
        state cannot be read is left out, with a warning if `warn`."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            m = _CHECKPOINT_DIR.match(name)
            if m and os.path.exists(os.path.join(self.root, name, STATE)):
                step = _read_step(os.path.join(self.root, name))
                if step is not None:
                    found.append((step, int(m.group(1) == "epoch"), os.path.join(self.root, name)))
                elif warn:
                    _warn(f"skipping checkpoint {os.path.join(self.root, name)}: its {STATE} cannot be read")
        return sorted(found)

    def completed_epochs(self) -> list[int]:
        return sorted(int(os.path.basename(p).split("-")[1]) for _, is_epoch, p in self.checkpoints() if is_epoch)

    def newest_state(self) -> dict[str, Any] | None:
        """The state.json of the newest checkpoint that has a readable one (its `path` added), weights unread;
        None if there is none.

        A resumed run is sized by its checkpoint (the global batch, `tfdp.train.task.make_plan`) before its model
        exists to load weights into, so this reads the state alone, quietly: `restore_latest` warns about
        what it skips. Should it go back past this checkpoint to an older one, every checkpoint of a run
        holds the same global batch, and `tfdp.train.run.Run.build` checks it.
        """
        for _, _, path in reversed(self.checkpoints(warn=False)):
            try:
                with open(os.path.join(path, STATE), encoding="utf-8") as f:
                    return {**json.load(f), "path": path}
            except (OSError, ValueError):
                continue
        return None

    def restore_latest(self, model: keras.Model) -> dict[str, Any] | None:
        """Loads weights and optimizer state of the newest readable checkpoint; None if there is none.

        The optimizer must already be built, or Keras would skip its state. A
        checkpoint whose files cannot be read is skipped with a warning; one
        that does not fit the model (another architecture or class count) is
        an error, since an older one would not fit either.
        """
        for _, _, path in reversed(self.checkpoints()):
            weights = os.path.join(path, WEIGHTS)
            try:
                with open(os.path.join(path, STATE), encoding="utf-8") as f:
                    state = json.load(f)
            except ValueError:
                _warn(f"skipping checkpoint {path}: {STATE} is not valid JSON")
                continue
            try:
                load_weights(model, weights, f"model '{model.name}' (changed architecture or class count? "
                                             f"use a new model_dir)")
            except UnreadableWeights as e:  # truncated or damaged
                _warn(f"skipping damaged checkpoint {path} ({e.reason}); trying the one before it")
                continue
            replicas = os.path.join(path, REPLICAS)
            try:
                state["replica_state"] = np.load(replicas) if os.path.exists(replicas) else None
            except (OSError, ValueError):
                _warn(f"skipping damaged checkpoint {path} ({REPLICAS} cannot be read); trying the one before it")
                continue
            state["path"] = path
            return state
        return None

    def save(self, model: keras.Model, state: dict[str, Any], kind: str = "epoch",
             replica_state: np.ndarray | None = None) -> str:
        """Writes `epoch-N/` (N = state['epoch']) or `step-N/` (N = state['step']) atomically, then prunes.

        `replica_state` (every replica's own non-trained state, see
        `tfdp.distribute.replica_state.ReplicaSnapshot`) goes beside the weights; the seed generators'
        state goes into state.json (`random_streams`).
        """
        if self.uploader:
            self.uploader.wait()   # the previous checkpoint's upload reads its folder, which pruning may delete
        number = state["epoch"] if kind == "epoch" else state["step"]
        final = os.path.join(self.root, f"{kind}-{number:04d}" if kind == "epoch" else f"{kind}-{number:09d}")
        tmp = os.path.join(self.root, f".tmp-{os.path.basename(final)}-{os.getpid()}")
        state = {**state, RANDOM_STREAMS: random_stream_states(model)}
        try:
            with write_errors(f"checkpoint {os.path.basename(final)}", self.root, weights_size(model)):
                os.makedirs(self.root, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
                model.save_weights(os.path.join(tmp, WEIGHTS))
                if replica_state is not None:
                    np.save(os.path.join(tmp, REPLICAS), replica_state)
                atomic_write_text(os.path.join(tmp, STATE), json.dumps(state, indent=1))
                if os.path.exists(final):
                    shutil.rmtree(final)
                os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._prune()
        if self.uploader:
            self.uploader.publish_checkpoint(final, int(state["step"]), kept)
        return final

    def save_best(self, model: keras.Model, record: dict[str, Any]) -> None:
        tmp = os.path.join(self.root, f".tmp-best-{os.getpid()}.weights.h5")
        try:
            with write_errors("the best checkpoint", self.root, weights_size(model)):
                os.makedirs(self.root, exist_ok=True)
                model.save_weights(tmp)
                os.replace(tmp, self.best_weights)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        atomic_write_text(os.path.join(self.root, "best.json"), json.dumps(record, indent=1))
        if self.uploader:
            self.uploader.publish_best(self.best_weights, os.path.join(self.root, "best.json"))

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

    def _prune(self) -> None:
        keep = {p for _, _, p in kept(self.checkpoints())}
        for _, _, path in self.checkpoints(warn=False):
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)



def load_checkpoint(model: keras.Model, path: str, cfg: Config) -> None:
    """Loads weights, turning Keras' mismatch errors into one line that says what does not fit, and what the
    checkpoint's own run was trained as where its config.yaml says."""
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}")
    what = f"model '{cfg.model.name}' with {cfg.model.num_classes} classes at {cfg.data.image_size} px"
    try:
        load_weights(model, path, what)
    except UnreadableWeights:
        raise
    except UserError as e:   # the hint before Keras' own words
        hint = trained_as(path, cfg) or "another architecture or class count?"
        raise UserError(str(e).replace(f"{what}: ", f"{what} ({hint}): ", 1)) from None


def trained_as(path: str, cfg: Config) -> str | None:
    """The settings the checkpoint's run (its config.yaml) was trained with where they differ from `cfg`'s, and how
    to pass them: the usual mismatch is a run trained with `--model=X`, then evaluated or exported without it."""
    run = run_dir_of(path)
    try:
        with open(os.path.join(run, "config.yaml"), encoding="utf-8") as f:
            found = yaml_floats.load(f) or {}
        theirs = {"model.name": found["model"]["name"], "model.num_classes": found["model"]["num_classes"],
                  "data.image_size": found["data"]["image_size"]}
    except (TypeError, OSError, KeyError, yaml.YAMLError):   # no run around it, or an unreadable config
        return None
    ours = {"model.name": cfg.model.name, "model.num_classes": cfg.model.num_classes,
            "data.image_size": cfg.data.image_size}
    differ = [f"{key}={value}" for key, value in theirs.items() if value != ours[key]]
    return (f"its run was trained with {', '.join(differ)}: set the same, or pass --config="
            f"{os.path.join(run, 'config.yaml')}") if differ else None

def kept(found: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Of checkpoints as (global step, 1 for an epoch checkpoint else 0, name), oldest first, those to keep:
    the newest KEEP_EPOCHS epoch checkpoints and the newest KEEP_STEPS step checkpoints newer than the
    last epoch checkpoint (older step checkpoints are superseded by it)."""
    epochs = [c for c in found if c[1]]
    last_epoch_step = epochs[-1][0] if epochs else -1
    steps = [c for c in found if not c[1] and c[0] > last_epoch_step]
    return sorted(epochs[-KEEP_EPOCHS:] + steps[-KEEP_STEPS:])


def _read_step(path: str) -> int | None:
    try:
        with open(os.path.join(path, STATE), encoding="utf-8") as f:
            state = json.load(f)
        return int(state.get("step", state.get("epoch", 0)))
    except (OSError, ValueError, TypeError):
        return None


def _warn(message: str) -> None:
    sys.stderr.write(f"tfdp: warning: {message}\n")
    sys.stderr.flush()
