"""Learning-rate schedules by rule set (`rules: keras | timm | torchvision`), functions of the optimizer's step.

keras (tfdp's own): linear warmup per step, then cosine, linear, step, exponential, constant or one-cycle; the
rate given per 256 images and scaled linearly with the global batch (Goyal et al. 2017), so changing the replica
count keeps the recipe.

timm: timm 1.0.31's CosineLRScheduler, StepLRScheduler and MultiStepLRScheduler (timm/scheduler/) as its
train.py drives them: `step(epoch)` at the end of each epoch, or with --sched-on-updates `step_update(n)` after
the n-th update, so optimizer update k trains at the scheduler's value for t = k // steps_per_epoch (per epoch) or
t = k (per update), and t = 0 at the value the scheduler set when it was built. Its warmup rises from
--warmup-lr and lies inside the cosine's epochs unless --warmup-prefix; the cosine ends at --min-lr.

torchvision: references/classification/train.py's SequentialLR of a LinearLR or ConstantLR warmup (factor
--lr-warmup-decay) and StepLR, CosineAnnealingLR (eta_min --lr-min) or ExponentialLR, stepped once an epoch:
epoch e trains at the warmup's value for e < W, then at the main scheduler's for e - W (SequentialLR restarts it
at its milestone).

The timm and torchvision schedules compute in float64 and round once to float32, so every step's rate is the
reference's (float64, Python) to half a float32 ulp, 6e-8 relative, at any magnitude: the end of a cosine too.
All are ops of the step counter, which is checkpointed, so a resumed run picks up exactly where the rate was,
and they compile under XLA. tests/optim/test_schedules.py checks them against the references themselves.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from tfdp.config import OptimizerConfig, ScheduleConfig
from tfdp.config.schedule_rules import lr_scaling, resolve_schedule, timm_cosine_epochs


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


@keras.saving.register_keras_serializable(package="tfdp")
class TimmSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """timm's scheduler `kind` (cosine, step, multistep) with its arguments in its own units, epochs or updates,
    as create_scheduler_v2 passes them: `warmup` {t, lr_init, prefix}; `decay` {t_initial, lr_min} (cosine),
    {decay_t, decay_rate} (step), {milestones, decay_rate} (multistep)."""

    def __init__(self, kind: str, base_lr: float, warmup: dict, decay: dict, steps_per_epoch: int,
                 on_updates: bool):
        self.kind, self.base_lr = kind, float(base_lr)
        self.warmup, self.decay = dict(warmup), dict(decay)
        self.steps_per_epoch, self.on_updates = int(steps_per_epoch), bool(on_updates)

    def __call__(self, step):
        t = ops.cast(step_count(step, 1 if self.on_updates else self.steps_per_epoch), "float64")
        return ops.cast(self.rate(t), "float32")

    def rate(self, t):
        """CosineLRScheduler/StepLRScheduler/MultiStepLRScheduler._get_lr(t), and at t = 0 the value the
        scheduler's constructor set (what the first epoch or update trains at before any step)."""
        w = self.warmup
        after = TIMM_DECAYS[self.kind](self, t - w["t"] if w["prefix"] else t)
        if not w["t"]:
            return ops.where(t == 0, self.base_lr, after)
        warmup_step = (self.base_lr - w["lr_init"]) / w["t"]
        lr = ops.where(t < w["t"], w["lr_init"] + t * warmup_step, after)
        return ops.where(t == 0, w["lr_init"], lr)

    def _cosine(self, t):
        t_initial, lr_min = self.decay["t_initial"], self.decay["lr_min"]
        cosine = lr_min + 0.5 * (self.base_lr - lr_min) * (1.0 + ops.cos(math.pi * t / t_initial))
        return ops.where(python_floordiv(t, t_initial) < 1, cosine, lr_min)  # cycle_limit 1: then lr_min

    def _step(self, t):
        return self.base_lr * ops.power(self.decay["decay_rate"], python_floordiv(t, self.decay["decay_t"]))

    def _multistep(self, t):
        # timm's bisect_right(milestones, t + 1): milestone m applies from t == m - 1 on
        passed = sum(ops.cast(t + 1.0 >= m, "float64") for m in self.decay["milestones"])
        return self.base_lr * ops.power(self.decay["decay_rate"], ops.convert_to_tensor(passed, "float64"))

    def get_config(self):
        return dict(kind=self.kind, base_lr=self.base_lr, warmup=self.warmup, decay=self.decay,
                    steps_per_epoch=self.steps_per_epoch, on_updates=self.on_updates)


TIMM_DECAYS = {"cosine": TimmSchedule._cosine, "step": TimmSchedule._step, "multistep": TimmSchedule._multistep}


@keras.saving.register_keras_serializable(package="tfdp")
class TorchvisionSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """torchvision's reference schedule, per epoch: `warmup` {epochs, method (linear | constant), factor}, then
    `kind` (cosine, step, exponential) with `decay` {t_max, eta_min} (CosineAnnealingLR), {step_size, gamma}
    (StepLR) or {gamma} (ExponentialLR)."""

    def __init__(self, kind: str, base_lr: float, warmup: dict, decay: dict, steps_per_epoch: int):
        self.kind, self.base_lr = kind, float(base_lr)
        self.warmup, self.decay = dict(warmup), dict(decay)
        self.steps_per_epoch = int(steps_per_epoch)

    def __call__(self, step):
        epoch = ops.cast(step_count(step, self.steps_per_epoch), "float64")
        return ops.cast(self.rate(epoch), "float32")

    def rate(self, epoch):
        w = self.warmup
        # SequentialLR restarts the main scheduler at its milestone: epoch W is the main schedule's epoch 0
        main = TORCHVISION_DECAYS[self.kind](self, epoch - w["epochs"])
        if not w["epochs"]:
            return main
        return ops.where(epoch < w["epochs"], TORCHVISION_WARMUPS[w["method"]](self, epoch), main)

    def _linear_warmup(self, epoch):  # LinearLR(start_factor=factor, total_iters=epochs)
        factor = self.warmup["factor"]
        return self.base_lr * (factor + (1.0 - factor) * epoch / self.warmup["epochs"])

    def _constant_warmup(self, epoch):  # ConstantLR(factor=factor, total_iters=epochs)
        return self.base_lr * self.warmup["factor"] + 0.0 * epoch

    def _cosine(self, j):
        eta_min = self.decay["eta_min"]
        return eta_min + (self.base_lr - eta_min) * (1.0 + ops.cos(math.pi * j / self.decay["t_max"])) / 2.0

    def _step(self, j):
        return self.base_lr * ops.power(self.decay["gamma"], ops.floor(j / self.decay["step_size"]))

    def _exponential(self, j):
        return self.base_lr * ops.power(self.decay["gamma"], j)

    def get_config(self):
        return dict(kind=self.kind, base_lr=self.base_lr, warmup=self.warmup, decay=self.decay,
                    steps_per_epoch=self.steps_per_epoch)


TORCHVISION_WARMUPS = {"linear": TorchvisionSchedule._linear_warmup, "constant": TorchvisionSchedule._constant_warmup}
TORCHVISION_DECAYS = {"cosine": TorchvisionSchedule._cosine, "step": TorchvisionSchedule._step,
                      "exponential": TorchvisionSchedule._exponential}


def step_count(step, steps_per_unit: int):
    """The whole epochs (steps_per_unit = steps per epoch) or updates (1) behind optimizer step `step`."""
    return ops.floor_divide(ops.cast(step, "int64"), steps_per_unit)


def python_floordiv(x, y):
    """Python's float `x // y` (CPython's float_floor_div), as timm's schedulers compute it: the floor of the exact
    quotient, not of the rounded x / y (12 // 0.1 is 119.0, floor(12 / 0.1) 120.0). floormod is exact (fmod)."""
    div = (x - ops.mod(x, y)) / y
    whole = ops.floor(div)
    return whole + ops.cast(div - whole > 0.5, div.dtype)


def scaled_lr(lr: float, global_batch: int, scale: str, base_size: int) -> float:
    """The peak rate: `lr` scaled from `base_size` images to the global batch as timm's train.py scales --lr-base
    (batch_ratio = global_batch / base_size, its square root for sqrt); none: `lr` as given."""
    return lr * LR_SCALES[scale](global_batch / base_size)


LR_SCALES = {"linear": lambda ratio: ratio, "sqrt": lambda ratio: ratio ** 0.5, "none": lambda ratio: 1.0}


def build_schedule(cfg: ScheduleConfig, lr: float, global_batch: int, steps_per_epoch: int, epochs: int,
                   rules: str = "keras", optimizer: OptimizerConfig | None = None,
                   ) -> keras.optimizers.schedules.LearningRateSchedule:
    """The schedule of a run of `epochs` epochs of `steps_per_epoch` optimizer steps (with gradient accumulation
    too: a step is an update) by `rules`; `optimizer` says how `lr` scales with the batch (default: the rule
    set's own, OptimizerConfig's lr_scale auto)."""
    s = resolve_schedule(cfg, rules)
    peak = scaled_lr(lr, global_batch, *lr_scaling(optimizer or OptimizerConfig(), rules))
    return SCHEDULE_BUILDERS[rules](s, peak, steps_per_epoch, epochs)


def keras_schedule(cfg: ScheduleConfig, peak: float, steps_per_epoch: int, epochs: int):
    if cfg.name == "one_cycle":
        return OneCycle(peak, epochs * steps_per_epoch, cfg.pct_start, cfg.div_factor, cfg.final_div_factor)
    return WarmupDecay(
        peak=peak,
        warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
        total_steps=epochs * steps_per_epoch,
        decay=cfg.name,
        boundaries=((steps_per_epoch,) if cfg.name == "exponential"
                    else tuple(e * steps_per_epoch for e in cfg.decay_epochs or ())),
        rate=cfg.decay_rate,
    )


def timm_schedule(cfg: ScheduleConfig, peak: float, steps_per_epoch: int, epochs: int) -> TimmSchedule:
    """create_scheduler_v2 with train.py's arguments; with --sched-on-updates every span in updates."""
    per = steps_per_epoch if cfg.on_updates else 1
    warmup = dict(t=int(cfg.warmup_epochs) * per, lr_init=cfg.warmup_lr, prefix=cfg.warmup_prefix)
    kind, decay = TIMM_ARGS[cfg.name](cfg, per, epochs)
    return TimmSchedule(kind, peak, warmup, decay, steps_per_epoch, cfg.on_updates)


TIMM_ARGS = {
    "cosine": lambda s, per, epochs: ("cosine", dict(t_initial=timm_cosine_epochs(s, epochs) * per,
                                                     lr_min=s.min_lr)),
    "step": lambda s, per, epochs: ("step", dict(decay_t=float(s.decay_epochs) * per, decay_rate=s.decay_rate)),
    "multistep": lambda s, per, epochs: ("multistep", dict(milestones=[m * per for m in s.decay_epochs],
                                                           decay_rate=s.decay_rate)),
    # timm's constant: a StepLRScheduler with decay_t 1 and decay_rate 1 (its warmup, then the rate)
    "constant": lambda s, per, epochs: ("step", dict(decay_t=1.0, decay_rate=1.0)),
}


def torchvision_schedule(cfg: ScheduleConfig, peak: float, steps_per_epoch: int, epochs: int) -> TorchvisionSchedule:
    warmup_epochs = int(cfg.warmup_epochs)
    warmup = dict(epochs=warmup_epochs, method=cfg.warmup_method, factor=cfg.warmup_decay)
    return TorchvisionSchedule(cfg.name, peak, warmup, TORCHVISION_ARGS[cfg.name](cfg, epochs - warmup_epochs),
                               steps_per_epoch)


TORCHVISION_ARGS = {
    "cosine": lambda s, t_max: dict(t_max=max(t_max, 1), eta_min=s.min_lr),  # T_max=epochs - lr_warmup_epochs
    "step": lambda s, t_max: dict(step_size=int(s.decay_epochs), gamma=s.decay_rate),
    "exponential": lambda s, t_max: dict(gamma=s.decay_rate),
}

SCHEDULE_BUILDERS = {"keras": keras_schedule, "timm": timm_schedule, "torchvision": torchvision_schedule}
