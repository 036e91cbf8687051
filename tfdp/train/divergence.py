"""A training loss that stops being a number ends the run at once, keeping its last good checkpoint; one that
explodes but stays finite is reported once, and the run goes on.

Keras hands every callback each step's logs as Python floats already: tfdp's
`Checkpointer` has a per-step hook, so `fit` waits for every step's logs
anyway, and reading the loss there costs nothing more. That loss is the
epoch's running mean over every replica of every worker (Keras reduces the
metric across replicas, and tfdp's multi-worker reduction is a collective
mean, `tfdp.keras_patches.fit_fixes`), so all workers see the same value at
the same step and stop alike, before any of them enters the checkpointer's
collectives. A non-finite value never leaves a running mean, so the first
one seen names the step that produced it (with `train.steps_per_execution`
above 1: the last step of the execution that did).

A step can also leave non-finite weights behind a finite loss (gradients
that overflow: the loss is computed before the update). `check_finite_weights`
catches that where it matters, before a checkpoint is written.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import keras
import tensorflow as tf

from tfdp.config import OptimizerConfig
from tfdp.errors import Diverged
from tfdp.rundir.checkpoints import CheckpointStore
from tfdp.startup.console import say

# A running loss above this many times its reference is reported as exploding (`explosion_threshold`).
EXPLOSION_FACTOR = 100.0


def explosion_threshold(first_loss: float, num_classes: int) -> float:
    """The running loss above which a run is reported as exploding: EXPLOSION_FACTOR times the larger of the
    loss at the first step this process trained and ln(classes), a uniform guess's cross-entropy.

    A fresh classifier starts near ln(classes), and a loss a hundred times
    that is a model confidently wrong about most images: no schedule or
    augmentation makes a healthy run climb there. The floor keeps a resumed
    run, whose first loss may be small and noisy, from being reported for a
    bad batch.
    """
    return EXPLOSION_FACTOR * max(first_loss, math.log(max(num_classes, 2)))


def advice(optimizer: OptimizerConfig) -> str:
    """What to change before running again."""
    if optimizer.clip_norm:
        return f"lower optimizer.lr (now {optimizer.lr:g}) or optimizer.clip_norm (now {optimizer.clip_norm:g})"
    return f"lower optimizer.lr (now {optimizer.lr:g}) or set optimizer.clip_norm"


def last_checkpoint_words(store: CheckpointStore) -> str:
    """The newest complete checkpoint, named relative to model_dir, for the line that ends a diverged run."""
    found = store.checkpoints(warn=False)
    if not found:
        return "no checkpoint was written before it"
    return f"the last good checkpoint ({os.path.relpath(found[-1][2], os.path.dirname(store.root))}) is kept"


def check_finite_weights(model: keras.Model, where: str, kept: Callable[[], str], hint: str) -> None:
    """Raises `Diverged` when any floating-point weight (batch-norm statistics included) is nan or inf: called
    before each checkpoint is written, so none holds them. One reduction per variable on its device, at a
    checkpoint only."""
    finite = [tf.reduce_all(tf.math.is_finite(w.value)) for w in model.weights
              if keras.backend.is_float_dtype(w.dtype)]
    if not finite or bool(tf.reduce_all(tf.stack(finite))):
        return
    raise Diverged(f"the weights are not finite after {where}; {kept()}; {hint}")


class DivergenceWatch(keras.callbacks.Callback):
    """Stops the run at the first non-finite training loss, or at an epoch whose validation loss is not
    finite (`Diverged`: one line naming the global step and epoch, the checkpoint kept, and what to change),
    and says once when the loss explodes (`explosion_threshold`). First in the callback list: nothing after
    it sees the step that diverged."""

    def __init__(self, steps_per_epoch: int, num_classes: int, kept: Callable[[], str], hint: str,
                 resume: tuple[int, int] = (0, 0)):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.num_classes = num_classes
        self.kept = kept
        self.hint = hint
        self.resume = resume
        self.threshold: float | None = None   # set at the first step this process trains
        self.warned = False
        self._epoch = self._offset = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._offset = self.resume[1] if epoch == self.resume[0] else 0

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        step = self._epoch * self.steps_per_epoch + self._offset + batch + 1
        where = f"step {step} (epoch {self._epoch + 1})"
        if not math.isfinite(loss):
            raise Diverged(f"training loss is {loss} at {where}; {self.kept()}; {self.hint}")
        self._watch_explosion(loss, where)

    def on_epoch_end(self, epoch, logs=None):
        """A validation loss that is not a number means weights that are finite yet overflow on real images:
        a checkpoint of them could serve nothing, so the run stops before the checkpointer writes one."""
        loss = (logs or {}).get("val_loss")
        if loss is not None and not math.isfinite(loss):
            raise Diverged(f"validation loss is {loss} after step {(epoch + 1) * self.steps_per_epoch} (the end "
                           f"of epoch {epoch + 1}): the model's outputs overflow; {self.kept()}; {self.hint}")

    def _watch_explosion(self, loss: float, where: str) -> None:
        if self.threshold is None:
            self.threshold = explosion_threshold(loss, self.num_classes)
        elif loss > self.threshold and not self.warned:
            self.warned = True
            say(f"tfdp: warning: training loss {loss:.3g} at {where} is over {EXPLOSION_FACTOR:g}x its start "
                f"({self.threshold / EXPLOSION_FACTOR:.3g}): the run may be diverging; if it goes on climbing, "
                f"{self.hint}", err=True)
