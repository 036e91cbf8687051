"""Learning-rate schedules: linear warmup, then cosine, linear, step, exponential, constant or one-cycle.

The peak rate follows the linear scaling rule (Goyal et al. 2017): the config
gives the rate per 256 images and `peak_lr` multiplies it by global_batch/256,
so changing the replica count keeps the recipe. The schedule is a function of
the optimizer's step counter, which is checkpointed, so a resumed run picks up
exactly where the rate was.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from tfdp.config import ScheduleConfig


def peak_lr(lr_per_256: float, global_batch: int) -> float:
    return lr_per_256 * global_batch / 256.0


@keras.saving.register_keras_serializable(package="tfdp")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from ~0 to `peak` over `warmup_steps`, then `decay` until `total_steps`."""

    def __init__(self, peak: float, warmup_steps: int, total_steps: int, decay: str = "cosine",
                 boundaries: tuple[int, ...] = (), rate: float = 0.1):
        self.peak = float(peak)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.decay = decay
        self.boundaries = tuple(int(b) for b in boundaries)
        self.rate = float(rate)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warmup = self.peak * (step + 1.0) / max(self.warmup_steps, 1)
        decayed = self._decayed(step)
        return ops.where(step < self.warmup_steps, warmup, decayed)

    def _decayed(self, step):
        if self.decay == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = ops.clip((step - self.warmup_steps) / span, 0.0, 1.0)
            return self.peak * 0.5 * (1.0 + ops.cos(math.pi * progress))
        if self.decay == "linear":  # FFCV's "cyclic" (triangular) schedule: straight down to 0 at the end
            span = max(self.total_steps - self.warmup_steps, 1)
            return self.peak * (1.0 - ops.clip((step - self.warmup_steps) / span, 0.0, 1.0))
        if self.decay == "step":
            passed = sum(ops.cast(step >= b, "float32") for b in self.boundaries) if self.boundaries else 0.0
            return self.peak * ops.power(self.rate, passed)
        if self.decay == "exponential":  # boundaries[0] holds the steps per epoch
            epochs = ops.floor((step - self.warmup_steps) / self.boundaries[0])
            return self.peak * ops.power(self.rate, ops.maximum(epochs, 0.0))
        return ops.convert_to_tensor(self.peak, "float32")

    def get_config(self):
        return dict(peak=self.peak, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                    decay=self.decay, boundaries=self.boundaries, rate=self.rate)


@keras.saving.register_keras_serializable(package="tfdp")
class OneCycle(keras.optimizers.schedules.LearningRateSchedule):
    """One-cycle ("super-convergence"): linear rise from peak/div to peak, cosine fall to peak/(div*final_div)."""

    def __init__(self, peak: float, total_steps: int, pct_start: float = 0.3, div_factor: float = 25.0,
                 final_div_factor: float = 1e4):
        self.peak, self.total_steps = float(peak), int(total_steps)
        self.pct_start, self.div_factor, self.final_div_factor = float(pct_start), float(div_factor), float(final_div_factor)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        start, end = self.peak / self.div_factor, self.peak / (self.div_factor * self.final_div_factor)
        rise = max(self.pct_start * self.total_steps, 1.0)
        up = start + (self.peak - start) * ops.clip(step / rise, 0.0, 1.0)
        progress = ops.clip((step - rise) / max(self.total_steps - rise, 1.0), 0.0, 1.0)
        down = end + (self.peak - end) * 0.5 * (1.0 + ops.cos(math.pi * progress))
        return ops.where(step < rise, up, down)

    def get_config(self):
        return dict(peak=self.peak, total_steps=self.total_steps, pct_start=self.pct_start,
                    div_factor=self.div_factor, final_div_factor=self.final_div_factor)


def build_schedule(cfg: ScheduleConfig, lr_per_256: float, global_batch: int, steps_per_epoch: int,
                   epochs: int) -> keras.optimizers.schedules.LearningRateSchedule:
    if cfg.name == "one_cycle":
        return OneCycle(peak_lr(lr_per_256, global_batch), epochs * steps_per_epoch, cfg.pct_start,
                        cfg.div_factor, cfg.final_div_factor)
    return WarmupDecay(
        peak=peak_lr(lr_per_256, global_batch),
        warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
        total_steps=epochs * steps_per_epoch,
        decay=cfg.name,
        boundaries=(steps_per_epoch,) if cfg.name == "exponential" else tuple(e * steps_per_epoch for e in cfg.decay_epochs),
        rate=cfg.decay_rate,
    )
