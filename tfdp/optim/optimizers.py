"""Optimizers by name (`optimizer.name`): a registry of builders, plus what every recipe shares.

SGD with momentum is the classic ImageNet recipe, its weight decay L2 through
the gradient as in torch.optim.SGD (`SGD`); AdamW and LAMB are Keras' own
(decoupled weight decay, as in PyTorch's AdamW); LARS, which Keras lacks, is
here (`LARS`), and so is TensorFlow 1's RMSProp (`RMSPropTF`), the EfficientNet optimizer; Muon, Lion,
ScheduleFreeAdamW and Adafactor are Keras' own. Every one takes the learning-rate
schedule, weight decay (optionally sparing batch-norm scale/shift and
biases, `NO_DECAY`), global gradient-norm clipping (`optimizer.clip_norm`) and an
exponential moving average of the weights (`optimizer.ema_decay`).

`rules` (Config.rules) picks whose update rules they follow. keras: Keras'
forms, and the EMA with the warm-up of TensorFlow's
`ExponentialMovingAverage(num_updates=...)`, which Model Garden and the
EfficientNet recipes use: decay_t = min(decay, (1 + t) / (10 + t)) (the first
update copies the weights). timm and torchvision: torch's forms of SGD,
AdamW and timm's LAMB (tfdp/optim/torch_forms.py), and the EMA of timm's
ModelEmaV3 or torchvision's ExponentialMovingAverage, batch-norm statistics
included (tfdp/optim/ema.py).
All of them run inside tfdp's whole-step XLA update (their maths is Keras'
backend-neutral `update_step`).
"""

from __future__ import annotations

from typing import Callable

import keras
from keras import ops

from tfdp.config import OptimizerConfig
from tfdp.optim.ema import EmaTiming, TimmEma, TorchEma, TorchvisionEma
from tfdp.optim.torch_forms import TimmLamb, TorchAdamW, TorchSGD

# Variable names (Keras: BatchNormalization's and LayerNormalization's gamma/beta, layers' bias, layer scale's
# gamma; a ViT's position embeddings, class, distillation and register tokens, a Swin's relative position bias
# tables, as timm's `no_weight_decay`) left undecayed on request. Matched as substrings of the variable's name.
NO_DECAY = ("gamma", "beta", "bias", "pos_embed", "cls_token", "dist_token", "reg_token")


def spared_from_decay(cfg: OptimizerConfig) -> tuple[str, ...]:
    """The name parts whose variables get no weight decay: none, NO_DECAY, or NO_DECAY less the biases
    (`optimizer.decay_bias`: torchvision's --norm-weight-decay 0 spares norm layers only)."""
    if cfg.decay_norm_and_bias:
        return ()
    if cfg.decay_bias:
        return tuple(part for part in NO_DECAY if part != "bias")
    return NO_DECAY
TORCHVISION_EMA_STEPS = 32   # torchvision's --model-ema-steps default


@keras.saving.register_keras_serializable(package="tfdp")
class LARS(keras.optimizers.Optimizer):
    """SGD with momentum and a layer-wise trust ratio (You et al., 2017), as MLPerf's ResNet-50 uses it.

    Per variable: g' = g + wd * w; ratio = eta * ||w|| / ||g'|| (1 when either
    norm is 0, and for excluded variables, which also get no decay);
    m = momentum * m + lr * ratio * g'; w = w - m. Weight decay is part of the
    adapted gradient here, not Keras' decoupled decay.
    """

    def __init__(self, learning_rate=0.1, momentum=0.9, weight_decay_rate=0.0, trust_coefficient=0.001,
                 exclude=NO_DECAY, name="lars", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum, self.weight_decay_rate = float(momentum), float(weight_decay_rate)
        self.trust_coefficient, self.exclude = float(trust_coefficient), tuple(exclude)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.momentums = self.add_optimizer_variables(var_list, "momentum")

    def adapted(self, variable) -> bool:
        return not any(part in variable.name for part in self.exclude)

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        m = self.momentums[self._get_variable_index(variable)]
        if self.adapted(variable):
            g = g + self.weight_decay_rate * variable
            w_norm, g_norm = ops.sqrt(ops.sum(ops.square(variable))), ops.sqrt(ops.sum(ops.square(g)))
            ratio = ops.where((w_norm > 0) & (g_norm > 0), self.trust_coefficient * w_norm / g_norm, 1.0)
            g = g * ratio
        self.assign(m, self.momentum * m + lr * g)
        self.assign_sub(variable, m)

    def get_config(self):
        return {**super().get_config(), "momentum": self.momentum, "weight_decay_rate": self.weight_decay_rate,
                "trust_coefficient": self.trust_coefficient, "exclude": self.exclude}


@keras.saving.register_keras_serializable(package="tfdp")
class SGD(keras.optimizers.SGD):
    """SGD with momentum whose weight decay is L2, added to the gradient: what ImageNet recipes mean by it.

    torch.optim.SGD and Model Garden's L2 regulariser decay through the
    gradient, so the decay runs through the momentum too; Keras' own SGD
    shrinks the weights directly (decoupled, as AdamW does), which at momentum
    0.9 is about ten times weaker for the same number. Variables excluded from
    decay (`exclude_from_weight_decay`) get none.
    """

    def __init__(self, l2: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.l2 = float(l2)

    def update_step(self, gradient, variable, learning_rate):
        if self.l2 and self._use_weight_decay(variable):
            gradient = ops.cast(gradient, variable.dtype) + ops.cast(self.l2, variable.dtype) * variable
        super().update_step(gradient, variable, learning_rate)

    def get_config(self):
        return {**super().get_config(), "l2": self.l2}


@keras.saving.register_keras_serializable(package="tfdp")
class RMSPropTF(keras.optimizers.Optimizer):
    """RMSProp as TensorFlow 1's `RMSPropOptimizer`, which the EfficientNet(V2) recipes were tuned with.

    ms = rho * ms + (1 - rho) * g^2 (ms starts at 1, not 0); mom = momentum * mom + lr * g / sqrt(ms + eps);
    w = w - mom. Keras' RMSprop starts ms at 0 and adds eps outside the square root, which at the recipes'
    eps 1e-3 takes much larger first steps. Weight decay is L2 through the gradient (the reference adds
    wd * l2_loss to its loss); variables excluded from decay get none.
    """

    def __init__(self, learning_rate=0.01, rho=0.9, momentum=0.9, epsilon=1e-3, l2=0.0, name="rmsprop_tf", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.rho, self.momentum, self.epsilon, self.l2 = float(rho), float(momentum), float(epsilon), float(l2)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.mean_squares = self.add_optimizer_variables(var_list, "mean_square", initializer="ones")
        self.momentums = self.add_optimizer_variables(var_list, "momentum")

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        if self.l2 and self._use_weight_decay(variable):
            g = g + ops.cast(self.l2, variable.dtype) * variable
        index = self._get_variable_index(variable)
        ms, mom = self.mean_squares[index], self.momentums[index]
        self.assign(ms, self.rho * ms + (1.0 - self.rho) * ops.square(g))
        self.assign(mom, self.momentum * mom + lr * g / ops.sqrt(ms + self.epsilon))
        self.assign_sub(variable, mom)

    def get_config(self):
        return {**super().get_config(), "rho": self.rho, "momentum": self.momentum, "epsilon": self.epsilon,
                "l2": self.l2}


class EmaWarmup:
    """Mixed into an optimizer class: the weights' moving average with TensorFlow's warm-up.

    Keras' own EMA uses the full decay from step 2, so the average of a
    short run stays near the initial weights; here the decay grows as
    (1 + t) / (10 + t) until it reaches `ema_momentum`.
    """

    def _update_model_variables_moving_average(self, trainable_variables):
        if not self.use_ema:
            return
        t = ops.cast(self.iterations, "float32")
        # The first update copies the weights (the average starts at zero), as Keras' own EMA does.
        decay = ops.where(t > 0, ops.minimum(self.ema_momentum, (1.0 + t) / (10.0 + t)), 0.0)
        for var, average in zip(trainable_variables, self._model_variables_moving_average):
            if average is not None:
                d = ops.cast(decay, var.dtype)
                average.assign(d * average + (1 - d) * var)

    def finalize_variable_values(self, var_list):
        """Leaves the trained weights in the model: Keras would swap in their averages at the end of every `fit`.

        tfdp runs one `fit` per segment (a progressive-resizing size, a freeze phase, a resumed remainder),
        so Keras' swap would make the next segment train on from the average, which a run resumed from a
        checkpoint (holding the trained weights) would not: the two would part. The average stays where
        timm keeps its `model_ema`, beside the weights: evaluated each epoch (`val_ema_*`), saved in every
        checkpoint with the optimizer, and the best checkpoint's weights when `train.best_metric` is a
        `val_ema_*` metric (tfdp/train/callbacks.py).
        """


def _sgd(cfg: OptimizerConfig, torch_form: bool) -> tuple[type, dict]:
    return (TorchSGD if torch_form else SGD), {"momentum": cfg.momentum, "nesterov": cfg.nesterov,
                                                "l2": cfg.weight_decay}


def _adamw(cfg: OptimizerConfig, torch_form: bool) -> tuple[type, dict]:
    return (TorchAdamW if torch_form else keras.optimizers.AdamW), {
        "beta_1": cfg.beta1, "beta_2": cfg.beta2, "epsilon": cfg.epsilon, "weight_decay": cfg.weight_decay}


def _lamb(cfg: OptimizerConfig, torch_form: bool) -> tuple[type, dict]:
    if torch_form:
        return TimmLamb, {"beta_1": cfg.beta1, "beta_2": cfg.beta2, "epsilon": cfg.epsilon,
                          "lamb_weight_decay": cfg.weight_decay}
    return keras.optimizers.Lamb, {"beta_1": cfg.beta1, "beta_2": cfg.beta2, "epsilon": cfg.epsilon,
                                   "weight_decay": cfg.weight_decay or None}


def _rmsprop(cfg: OptimizerConfig, torch_form: bool) -> tuple[type, dict]:
    # timm's `rmsproptf` is this optimizer under every rule set.
    return RMSPropTF, {"rho": cfg.rho, "momentum": cfg.momentum, "epsilon": cfg.epsilon, "l2": cfg.weight_decay}


def _lars(cfg: OptimizerConfig, torch_form: bool) -> tuple[type, dict]:
    return LARS, {"momentum": cfg.momentum, "weight_decay_rate": cfg.weight_decay, "exclude": spared_from_decay(cfg)}


def _muon(cfg: OptimizerConfig, torch_form: bool) -> tuple[type, dict]:
    """Keras' Muon: the orthogonalised momentum step (5 Newton-Schulz iterations, the update scaled by
    0.2 * sqrt(max(rows, columns))) for 2-D variables only: every variable that is not 2-D (conv kernels,
    biases, norms) and every one whose path holds "embedding" takes Keras' AdamW step instead (beta1, beta2,
    epsilon, Keras' epsilon form) at the same learning rate. Decoupled weight decay on both (the one value)."""
    return keras.optimizers.Muon, {"adam_beta_1": cfg.beta1, "adam_beta_2": cfg.beta2, "epsilon": cfg.epsilon,
                                   "momentum": cfg.momentum, "nesterov": cfg.nesterov,
                                   "weight_decay": cfg.weight_decay or None,
                                   "adam_weight_decay": cfg.weight_decay or None}


def _lion(cfg: OptimizerConfig, torch_form: bool) -> tuple[type, dict]:
    """Keras' Lion (Chen et al., 2023): w -= lr * sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g."""
    return keras.optimizers.Lion, {"beta_1": cfg.beta1, "beta_2": cfg.beta2, "weight_decay": cfg.weight_decay or None}


def _schedule_free_adamw(cfg: OptimizerConfig, torch_form: bool) -> tuple[type, dict]:
    """Keras' ScheduleFreeAdamW (Defazio et al., 2024). The model holds its gradient point y, which is what
    tfdp evaluates and saves (the averaged point x is not swapped in); `schedule.name: constant` is its use."""
    return keras.optimizers.ScheduleFreeAdamW, {"beta_1": cfg.beta1, "beta_2": cfg.beta2, "epsilon": cfg.epsilon,
                                                "weight_decay": cfg.weight_decay or None}


def _adafactor(cfg: OptimizerConfig, torch_form: bool) -> tuple[type, dict]:
    """Keras' Adafactor (factored second moments for variables of 2 or more dimensions, updates clipped to
    RMS 1, step size scaled by the weights' RMS); with a schedule the learning rate is the schedule's."""
    return keras.optimizers.Adafactor, {"weight_decay": cfg.weight_decay or None}


OPTIMIZERS: dict[str, Callable[[OptimizerConfig, bool], tuple[type, dict]]] = {
    "sgd": _sgd, "adamw": _adamw, "lamb": _lamb, "lars": _lars, "rmsprop": _rmsprop,
    "muon": _muon, "lion": _lion, "schedule_free_adamw": _schedule_free_adamw, "adafactor": _adafactor,
}

# Whose moving average each rule set keeps (tfdp/optim/ema.py); whether it takes torch's update rules.
EMA_FORMS: dict[str, type] = {"keras": EmaWarmup, "timm": TimmEma, "torchvision": TorchvisionEma}
TORCH_RULES = ("timm", "torchvision")


def build_optimizer(cfg: OptimizerConfig, schedule, rules: str = "keras",
                    timing: EmaTiming | None = None) -> keras.optimizers.Optimizer:
    """The configured optimizer on `schedule`, in the update rules of `rules` (Config.rules), with its EMA
    (`timing`: what torchvision's EMA reads from the run); LARS handles its exclusions itself."""
    common = {"learning_rate": schedule, "global_clipnorm": cfg.clip_norm or None,
              "use_ema": bool(cfg.ema_decay), "ema_momentum": cfg.ema_decay or 0.99}
    cls, kwargs = OPTIMIZERS[cfg.name](cfg, rules in TORCH_RULES)
    optimizer = _with_ema(cls, EMA_FORMS[rules])(**kwargs, **common)
    optimizer.tfdp_ema_warmup = cfg.ema_warmup
    optimizer.tfdp_ema_every = cfg.ema_every_steps or TORCHVISION_EMA_STEPS
    optimizer.tfdp_ema_timing = timing or EmaTiming()
    if cfg.weight_decay and spared_from_decay(cfg) and cfg.name != "lars":
        optimizer.exclude_from_weight_decay(var_names=list(spared_from_decay(cfg)))
    return optimizer


def track_buffers(optimizer: keras.optimizers.Optimizer, model: keras.Model) -> None:
    """Under timm's and torchvision's EMA, also averages the model's float non-trainable variables (batch-norm
    statistics). Call after `optimizer.build`, before the model is frozen or a checkpoint restored."""
    if optimizer.use_ema and isinstance(optimizer, TorchEma):
        optimizer.track_buffers([v for v in model.non_trainable_variables if "float" in str(v.dtype)])


_EMA_CLASSES: dict[tuple[type, type], type] = {}


def _with_ema(cls: type, ema: type) -> type:
    """`cls` with the moving average `ema` mixed in (one class per pair, made once)."""
    if (cls, ema) not in _EMA_CLASSES:
        _EMA_CLASSES[cls, ema] = type(cls.__name__, (ema, cls), {})
    return _EMA_CLASSES[cls, ema]
