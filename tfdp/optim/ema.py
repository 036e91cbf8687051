"""The weights' moving average as timm and torchvision compute it (`rules: timm | torchvision`).

Keras rules keep tfdp's `EmaWarmup` (tfdp/optim/optimizers.py): trainable
variables only, decay warmed up as (1 + t) / (10 + t). The torch trainers
average the whole state dict instead, batch-norm running statistics
included, so their EMA model is evaluated with its own statistics:

- timm's `ModelEmaV3` (timm/utils/model_ema.py), updated after every
  optimizer step with step = number of updates so far (train.py's
  `num_updates`): the first update copies the model, later ones lerp with the
  decay (`optimizer.ema_decay`, `--model-ema-decay`), or with
  --model-ema-warmup (`optimizer.ema_warmup`) with
  min(decay, 1 - (1 + s) ** (-2/3)), s = step - 1 (warmup_gamma 1, power 2/3).
- torchvision's `ExponentialMovingAverage` (references/classification/
  utils.py: an `AveragedModel` with use_buffers=True), updated after the
  step of every batch whose index in its epoch is a multiple of
  `--model-ema-steps` (`optimizer.ema_every_steps`), with the decay adjusted
  for the batch and the run's length:
  alpha = min(1, (1 - decay) * global_batch * every_steps / epochs), decay' = 1 - alpha;
  an update copies the model while n_averaged is 0, which the reference
  resets after every update of the warmup epochs (`--lr-warmup-epochs`): so
  the update of global step k (0-based) copies while k <= warmup_epochs * steps_per_epoch.

The averages of the batch-norm statistics ("buffers": the model's float
non-trainable variables, `track_buffers`) are optimizer variables beside
the weights' averages, so every checkpoint holds them and a resumed run
continues them exactly. They average the statistics as the forward pass of
the same step left them: the compiled step hands the new values in
(`tfdp_fresh_buffers`, averaged over replicas: the mean of the replicas'
averages, which is what timm's --dist-bn reduce evaluates), and Keras' own
step has written them already (its update reads the mean of the local
replicas' copies).
"""

from __future__ import annotations

import dataclasses
import math

from keras import ops


@dataclasses.dataclass(frozen=True)
class EmaTiming:
    """What torchvision's decay adjustment and warmup reset read from the run: the global batch (its
    world_size x batch_size), the optimizer steps of an epoch, the epochs, and the warmup epochs."""
    global_batch: int = 1
    steps_per_epoch: int = 1
    epochs: int = 1
    warmup_epochs: float = 0.0


class TorchEma:
    """Mixed into an optimizer class: the moving average of the weights and of the model's buffers, with a
    schedule (`ema_schedule`: whether this step updates, and the decay) that the subclasses define."""

    tfdp_buffers: list = []          # the model's float non-trainable variables (batch-norm statistics)
    tfdp_buffer_averages: list = []  # their averages (optimizer variables, checkpointed with the optimizer)
    tfdp_fresh_buffers: dict | None = None   # {id(buffer): this step's value}, set by the compiled step

    def track_buffers(self, buffers: list) -> None:
        """Averages `buffers` too (call once, after `build`, before a checkpoint is restored)."""
        self.tfdp_buffers = list(buffers)
        self.tfdp_buffer_averages = [self.add_variable_from_reference(b, name="buffer_average") for b in buffers]

    def buffer_now(self, buffer):
        """The buffer as this step's forward pass left it: the compiled step hands the value in (replica-averaged);
        Keras' own step has written it, and under a tf.distribute strategy updates the average in cross-replica
        context, where the mean of this worker's replicas' copies is read."""
        fresh = self.tfdp_fresh_buffers or {}
        if id(buffer) in fresh:
            return fresh[id(buffer)]
        copies = getattr(buffer.value, "values", None)
        if copies and len(copies) > 1:
            return ops.mean(ops.stack([ops.convert_to_tensor(c) for c in copies]), axis=0)
        return buffer

    def ema_schedule(self):
        """(update this step: a bool tensor, decay, 1 - decay: float32 tensors); decay 0 copies. Both factors
        are rounded from double precision, as torch rounds the Python floats the references compute: at a
        decay of 0.99996 a 1 - decay taken in float32 would be 1.3e-4 off."""
        raise NotImplementedError

    def blend(self, average, value, decay, weight):
        raise NotImplementedError

    def _update_model_variables_moving_average(self, trainable_variables):
        if not self.use_ema:
            return
        update, decay, weight = self.ema_schedule()
        pairs = [(v, a) for v, a in zip(trainable_variables, self._model_variables_moving_average) if a is not None]
        pairs += [(self.buffer_now(b), a) for b, a in zip(self.tfdp_buffers, self.tfdp_buffer_averages)]
        for variable, average in pairs:
            value = ops.cast(variable, average.dtype)
            new = self.blend(average, value, ops.cast(decay, average.dtype), ops.cast(weight, average.dtype))
            average.assign(ops.where(update, new, average))

    def finalize_variable_values(self, var_list):
        """Leaves the trained weights in the model (see `EmaWarmup.finalize_variable_values`)."""


class TimmEma(TorchEma):
    """timm's ModelEmaV3: every step; step s = iterations + 1; decay 0 at s = 1, then `ema_momentum`, or with
    `tfdp_ema_warmup` min(ema_momentum, 1 - (1 + s - 1) ** (-2/3)). torch's lerp_, including its form for
    weights of 0.5 and more."""

    tfdp_ema_warmup: bool = False

    def ema_schedule(self):
        s = ops.cast(self.iterations, "float32")   # timm's step - 1 (update_after_step 0)
        weight = ops.convert_to_tensor(1.0 - self.ema_momentum, "float32")
        if self.tfdp_ema_warmup:   # 1 - min(decay, 1 - (1 + s) ** -p), without the cancellation
            weight = ops.maximum(weight, ops.power(1.0 + s, -2.0 / 3.0))
        weight = ops.where(s > 0, weight, 1.0)
        return ops.convert_to_tensor(True), 1.0 - weight, weight

    def blend(self, average, value, decay, weight):
        # ema.lerp_(model, weight), torch's two forms
        return ops.where(weight < 0.5, average + weight * (value - average), value - (value - average) * (1 - weight))


class TorchvisionEma(TorchEma):
    """torchvision's ExponentialMovingAverage as its train.py drives it (`tfdp_ema_timing`, `tfdp_ema_every`)."""

    tfdp_ema_every: int = 32
    tfdp_ema_timing: EmaTiming = EmaTiming()

    def adjusted_alpha(self) -> float:
        t = self.tfdp_ema_timing
        return min(1.0, (1.0 - self.ema_momentum) * t.global_batch * self.tfdp_ema_every / t.epochs)

    def adjusted_decay(self) -> float:
        return 1.0 - self.adjusted_alpha()

    def ema_schedule(self):
        t = self.tfdp_ema_timing
        k = ops.cast(self.iterations, "int64")
        update = ops.equal(ops.mod(ops.mod(k, t.steps_per_epoch), self.tfdp_ema_every), 0)
        copy = k <= math.ceil(t.warmup_epochs) * t.steps_per_epoch   # `epoch < args.lr_warmup_epochs` resets
        decay, weight = self.adjusted_decay(), 1.0 - self.adjusted_decay()   # ema_avg's decay and (1 - decay)
        return update, ops.where(copy, 0.0, decay), ops.where(copy, 1.0, weight)

    def blend(self, average, value, decay, weight):
        return ops.where(decay == 0, value, decay * average + weight * value)   # copy_, then ema_avg
