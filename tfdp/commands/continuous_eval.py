"""`tfdp evaluate --continuous`: the evaluator beside the workers.

As TensorFlow's side-car evaluator (the `evaluator` task of TF_CONFIG) and
Model Garden's `--mode=continuous_eval`, it waits for each checkpoint the run
commits in model_dir, evaluates it once on the validation split and writes,
beside what training writes:

- `eval_metrics.jsonl`: one row per checkpoint (`step`, `epoch`,
  `step_in_epoch`, `checkpoint`, `val_loss`, `val_top1`, ...); in a bucket, one
  object per checkpoint under `eval_metrics/`, read in name order (object
  stores have no append);
- `tensorboard/eval/`: an epoch checkpoint's metrics as `epoch_<metric>` at
  Keras' epoch index, so they are drawn on the charts of training's `train/`
  and `validation/` runs; a mid-epoch checkpoint's as `step_<metric>` at its
  global step;
- `checkpoints/best.weights.h5` and `best.json` by `train.best_metric`, only
  where the workers skip their own validation (`train.validate`): otherwise
  the trainer keeps them, so each file has one writer.

It reads only committed checkpoints (a local one is complete once renamed
into place, a bucket one once its commit marker lists every object at its
size, tfdp/rundir/bucket.py), copied into a folder of its own before it loads
them. It takes no lease and joins no collective: the workers never wait for
it. A checkpoint pruned before it was copied (the run keeps only its newest
few) is skipped with one line; restarted, it goes on after the newest
checkpoint its own metrics log holds. It ends once it has evaluated the
checkpoint of the run's last epoch (`train.epochs`), or when no new
checkpoint came for `timeout` seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

from tfdp.commands.evaluate import Evaluator
from tfdp.config import Config
from tfdp.distribute.strategy import Runtime
from tfdp.errors import UserError, atomic_write_text, write_errors
from tfdp.rundir.bucket import CHECKPOINTS, TENSORBOARD, Bucket, Place, Uploader, place_for
from tfdp.rundir.checkpoints import STATE, WEIGHTS, CheckpointStore, UnreadableWeights
from tfdp.rundir.metrics_file import EVAL_METRICS, EVAL_METRICS_FILE, read_metrics
from tfdp.startup.console import say

EVAL_RUN = "eval"               # the evaluator's TensorBoard run, beside Keras' train/ and validation/


@dataclasses.dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its global step, whether it ends an epoch, its folder's name, and (in a bucket)
    its objects' committed sizes."""
    step: int
    is_epoch: bool
    name: str
    files: tuple[tuple[str, int], ...] = ()


class LocalCheckpoints:
    """The committed checkpoints of a local (or shared-volume) model_dir."""

    def __init__(self, model_dir: str):
        self.store = CheckpointStore(model_dir)

    def committed(self) -> list[Committed]:
        return [Committed(step, bool(is_epoch), os.path.basename(path))
                for step, is_epoch, path in self.store.checkpoints(warn=False)]

    def where(self, c: Committed) -> str:
        return os.path.join(self.store.root, c.name)

    def copy(self, c: Committed, into: str) -> str | None:
        """`c`'s weights and state copied into `into/<name>` (its path), or None if it is gone."""
        target = os.path.join(into, c.name)
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        try:
            for f in (STATE, WEIGHTS):
                shutil.copyfile(os.path.join(self.where(c), f), os.path.join(target, f))
        except FileNotFoundError:
            shutil.rmtree(target, ignore_errors=True)
            return None
        return target


class BucketCheckpoints:
    """The committed checkpoints of a model_dir in a bucket: those whose marker lists every object at its size."""

    def __init__(self, bucket: Bucket):
        self.bucket = bucket

    def committed(self) -> list[Committed]:
        found, _ = self.bucket.checkpoints(warn=False)
        return [Committed(step, bool(is_epoch), name, tuple(sorted(files.items())))
                for step, is_epoch, name, files in found]

    def where(self, c: Committed) -> str:
        return self.bucket.where(f"{CHECKPOINTS}/{c.name}")

    def copy(self, c: Committed, into: str) -> str | None:
        try:
            return self.bucket.pull_checkpoint(c.name, dict(c.files), into)
        except (FileNotFoundError, UserError):   # pruned, or changed, while it was read
            return None


def watched(place: Place):
    """Where the run's committed checkpoints are listed and copied from: its folder, or its bucket."""
    return BucketCheckpoints(place.bucket) if place.bucket else LocalCheckpoints(place.local)


class EvalLog:
    """What the evaluator writes into the run: its metrics rows, its TensorBoard run and (`keep_best`) the
    best checkpoint. `work` is the evaluator's own folder; a bucket run's files are written there and
    uploaded."""

    def __init__(self, place: Place, work: str, keep_best: bool, best_metric: str):
        self.place, self.work = place, work
        self.keep_best, self.best_metric = keep_best, best_metric
        self.rows = place.bucket.rows(EVAL_METRICS) if place.bucket else read_metrics(self.metrics_path)
        base = work if place.bucket else place.local
        self.events = os.path.join(base, TENSORBOARD, EVAL_RUN)
        self.uploader = Uploader(place.bucket, work) if place.bucket else None
        self._writer = None

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.place.local, EVAL_METRICS_FILE)

    @property
    def where(self) -> str:
        """The metrics log as the user finds it."""
        return self.place.bucket.where(EVAL_METRICS) + "/" if self.place.bucket else self.metrics_path

    def last_step(self) -> int:
        return max((int(r["step"]) for r in self.rows), default=-1)

    def best(self) -> dict | None:
        """The best epoch so far by `best_metric`, from the rows (the rows are the evaluator's record)."""
        epochs = [r for r in self.rows if not r.get("step_in_epoch") and self.best_metric in r]
        if not epochs:
            return None
        pick = min if self.best_metric.endswith("loss") else max
        row = pick(epochs, key=lambda r: r[self.best_metric])
        return {"epoch": row["epoch"], "metric": self.best_metric, "value": row[self.best_metric], "step": row["step"]}

    def record(self, c: Committed, state: dict, result: dict, weights: str) -> None:
        """One checkpoint's row and TensorBoard points, then (an improved epoch, `keep_best`) the best checkpoint.
        TensorBoard first: a kill between the two evaluates the checkpoint again and draws the same point."""
        row = {"step": c.step, "epoch": int(state.get("epoch", 0)), "step_in_epoch": int(state.get("step_in_epoch", 0)),
               "checkpoint": c.name, **{f"val_{k}": float(v) for k, v in result.items() if k != "examples"},
               "examples": int(result["examples"])}
        self._draw(row, c.is_epoch)
        before = self.best()
        self.rows.append(row)
        if self.place.bucket:
            self.place.bucket.put_bytes((json.dumps(row) + "\n").encode(), f"{EVAL_METRICS}/step-{c.step:09d}.jsonl")
        else:
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.rows))
        best = self.best()
        if self.keep_best and c.is_epoch and best != before and best["step"] == c.step:
            self._keep_best(weights, best)

    def _draw(self, row: dict, is_epoch: bool) -> None:
        import tensorflow as tf
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.events)
        prefix, x = ("epoch_", row["epoch"] - 1) if is_epoch else ("step_", row["step"])  # Keras: epoch index
        with self._writer.as_default():
            for key, value in row.items():
                if key.startswith("val_"):
                    tf.summary.scalar(prefix + key[len("val_"):], value, step=x)
        self._writer.flush()
        if self.uploader:
            self.uploader.sync_events()

    def _keep_best(self, weights: str, best: dict) -> None:
        """The checkpoint's weights as checkpoints/best.weights.h5, then best.json, each replaced whole."""
        record = json.dumps(best, indent=1)
        if self.place.bucket:
            self.place.bucket.put_file(weights, f"{CHECKPOINTS}/best.weights.h5")
            self.place.bucket.put_bytes(record.encode(), f"{CHECKPOINTS}/best.json")
            return
        store = CheckpointStore(self.place.local)
        tmp = os.path.join(store.root, f".eval-best-{os.getpid()}.weights.h5")  # not .tmp-: the chief sweeps those
        try:
            with write_errors("the best checkpoint", store.root, os.path.getsize(weights)):
                shutil.copyfile(weights, tmp)
                os.replace(tmp, store.best_weights)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        atomic_write_text(os.path.join(store.root, "best.json"), record)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self.uploader:
            self.uploader.sync_events()
            self.uploader.finish(quiet=True)


def ended(state: dict, epochs: int) -> bool:
    """The checkpoint a run writes last: the end of its last epoch."""
    return int(state.get("epoch", 0)) >= epochs and not int(state.get("step_in_epoch", 0))


def check_request(cfg: Config, poll_seconds: float, timeout: float, keep_best: bool) -> None:
    """What the evaluator is asked, checked before it reads anything: each mistake one line (tfdp/cli.py checks
    the flags before TensorFlow starts; this, for any caller)."""
    if not poll_seconds > 0:
        raise UserError(f"--poll_seconds must be above 0, got {poll_seconds:g}")
    if timeout < 0:
        raise UserError(f"--eval_timeout must be 0 (wait for ever) or more seconds, got {timeout:g}")
    if keep_best and cfg.train.best_metric.startswith("val_ema_"):
        raise UserError(f"train.best_metric {cfg.train.best_metric} is measured by the workers' validation, which "
                        f"they skip here (train.validate: {cfg.train.validate}); the evaluator measures the weights, "
                        f"not their moving average: set train.validate: always or another train.best_metric")


def evaluate_continuously(cfg: Config, runtime: Runtime, poll_seconds: float = 10.0, timeout: float = 3600.0,
                          keep_best: bool = False) -> list[dict]:
    """Evaluates each checkpoint the run in `cfg.model_dir` commits, once, until its last epoch's; returns the
    rows of the evaluator's metrics log. `keep_best`: the workers do not validate, so the best checkpoint is
    the evaluator's to keep."""
    check_request(cfg, poll_seconds, timeout, keep_best)
    place = place_for(cfg.model_dir, cfg.scratch_dir, own=False, retry_seconds=cfg.train.upload_retry_seconds)
    work = tempfile.mkdtemp(prefix="eval-", dir=_scratch(cfg))
    log = None
    try:
        checkpoints = watched(place)
        log = EvalLog(place, work, keep_best, cfg.train.best_metric)
        evaluator = Evaluator(cfg, runtime)
        say(start_line(cfg, log, poll_seconds, timeout))
        if any(r.get("epoch", 0) >= cfg.train.epochs and not r.get("step_in_epoch") for r in log.rows):
            say(f"tfdp: evaluate: training had ended: {log.where} holds its last epoch's checkpoint")
            return log.rows
        return watch(checkpoints, evaluator, log, cfg.train.epochs, poll_seconds, timeout, work)
    finally:
        if log is not None:
            log.close()
        shutil.rmtree(work, ignore_errors=True)
        place.close()


def watch(checkpoints, evaluator: Evaluator, log: EvalLog, epochs: int, poll_seconds: float, timeout: float,
          work: str) -> list[dict]:
    """The loop: each new committed checkpoint, oldest first, evaluated once; until the last epoch's."""
    done, idle_since, evaluated = log.last_step(), time.monotonic(), 0
    while True:
        new = [c for c in checkpoints.committed() if c.step > done]
        for c in new:
            done = c.step
            copy = checkpoints.copy(c, work)
            if copy is None:
                _warn(f"evaluate: skipping checkpoint {checkpoints.where(c)}: it was deleted before it was read "
                      f"(the run keeps only its newest checkpoints, and evaluating takes longer than training)")
                continue
            read = evaluate_copy(evaluator, copy, checkpoints.where(c))
            if read is None:
                continue
            state, result = read
            log.record(c, state, result, os.path.join(copy, WEIGHTS))
            shutil.rmtree(copy, ignore_errors=True)
            evaluated += 1
            if ended(state, epochs):
                say(end_line(log, epochs, evaluated))
                return log.rows
        if new:
            idle_since = time.monotonic()
        elif timeout and time.monotonic() - idle_since >= timeout:
            say(f"tfdp: evaluate: no new checkpoint for {timeout:g} s; stopping after {evaluated} checkpoint(s) "
                f"(the run's last epoch, {epochs}, was not committed)")
            return log.rows
        time.sleep(poll_seconds)


def evaluate_copy(evaluator: Evaluator, copy: str, where: str) -> tuple[dict, dict] | None:
    """(state, result) of the checkpoint copied to `copy`; None, after a warning, for weights that cannot be read
    (a damaged disk or copy), which the evaluator skips as a resumed run does (`CheckpointStore.restore_latest`).
    A state.json that is not JSON never gets here: the listing reads each checkpoint's step from it."""
    with open(os.path.join(copy, STATE), encoding="utf-8") as f:
        state = json.load(f)
    try:
        return state, evaluator.evaluate(os.path.join(copy, WEIGHTS), where)
    except UnreadableWeights as e:
        _warn(f"evaluate: skipping damaged checkpoint {where} ({e.reason})")
        shutil.rmtree(copy, ignore_errors=True)
        return None


def start_line(cfg: Config, log: EvalLog, poll_seconds: float, timeout: float) -> str:
    until = f"or {timeout:g} s without a new one" if timeout else "however long that takes"
    resumed = (f"; going on after {log.rows[-1]['checkpoint']} ({len(log.rows)} row(s) in {log.where})"
               if log.rows else "")
    best = "; it keeps the best checkpoint (the workers do not validate)" if log.keep_best else ""
    return (f"tfdp: evaluate: watching {cfg.model_dir.rstrip('/')} for committed checkpoints every {poll_seconds:g} s, "
            f"until epoch {cfg.train.epochs}'s ({until}){resumed}{best}")


def end_line(log: EvalLog, epochs: int, evaluated: int) -> str:
    best = log.best()
    kept = (f"; best {best['metric']} {best['value']:.4f} at epoch {best['epoch']}" if best else "")
    return (f"tfdp: evaluate: training ended (epoch {epochs} of {epochs} evaluated); {evaluated} checkpoint(s) "
            f"evaluated, rows in {log.where}{kept}")


def _scratch(cfg: Config) -> str:
    root = os.path.abspath(os.path.expanduser(cfg.scratch_dir))
    os.makedirs(root, exist_ok=True)
    return root


def _warn(message: str) -> None:
    sys.stderr.write(f"tfdp: warning: {message}\n")
    sys.stderr.flush()
