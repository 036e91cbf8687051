"""The update rules of torch.optim and timm, for configs whose `rules` are timm or torchvision.

Keras and torch write the same optimizers differently, and the difference
shows as soon as the learning rate changes or gradients are small:

- SGD momentum: Keras keeps the learning rate inside the velocity
  (v = mu v - lr g; w = w + v), torch outside (v = mu v + g; w = w - lr v;
  nesterov: w = w - lr (g + mu v)). Equal at a constant rate, apart under
  warmup and decay (`TorchSGD`).
- Adam's epsilon: Keras adds it to sqrt(v) before the bias correction, so its
  effective epsilon is eps / sqrt(1 - beta2^t) (31.6x torch's at step 1 with
  beta2 0.999); torch divides sqrt(v) by sqrt(1 - beta2^t) and then adds eps
  (`TorchAdamW`; weight decay decoupled before the step, w = w - lr wd w,
  as torch.optim.AdamW).
- LAMB: timm's `Lamb` (timm/optim/lamb.py), the RSB recipes' optimizer, has
  its own form: the gradients divided by max(1, global norm) inside the
  optimizer, torch's epsilon, weight decay added to the update (not
  decoupled) and the trust ratio ||w|| / ||update|| only for decayed
  variables (`TimmLamb`).

Each runs inside Keras' `update_step`, so tfdp's whole-step XLA update and
MirroredStrategy run them as Keras' own; `global_clipnorm` clips first, as
timm's and torchvision's `--clip-grad` do before `optimizer.step()`.
"""

from __future__ import annotations

import keras
from keras import ops
from keras.src.optimizers.base_optimizer import global_norm



@keras.saving.register_keras_serializable(package="tfdp")
class TorchSGD(keras.optimizers.SGD):
    """torch.optim.SGD (dampening 0): g' = g + wd w; v = mu v + g'; w = w - lr v (nesterov: w - lr (g' + mu v)).

    The weight decay is L2 through the gradient (`l2`), none for variables
    excluded from decay. The velocity starts at 0, so the first step's v = g'
    is torch's buffer initialised to the gradient.
    """

    def __init__(self, l2: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.l2 = float(l2)

    def get_config(self):
        return {**super().get_config(), "l2": self.l2}

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        if self.l2 and self._use_weight_decay(variable):
            g = g + ops.cast(self.l2, variable.dtype) * variable
        if not self.momentum:
            self.assign_sub(variable, lr * g)
            return
        mu = ops.cast(self.momentum, variable.dtype)
        v = self.momentums[self._get_variable_index(variable)]
        self.assign(v, mu * v + g)
        step = g + mu * v if self.nesterov else v
        self.assign_sub(variable, lr * step)


@keras.saving.register_keras_serializable(package="tfdp")
class TorchAdamW(keras.optimizers.AdamW):
    """torch.optim.AdamW: w = w - lr wd w (Keras' decoupled decay, applied before the step as torch does);
    m, v as Adam's; w = w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). With weight decay 0
    it is torch.optim.Adam."""

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        t = ops.cast(self.iterations + 1, variable.dtype)
        b1, b2 = ops.cast(self.beta_1, variable.dtype), ops.cast(self.beta_2, variable.dtype)
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        self.assign(m, b1 * m + (1 - b1) * g)
        self.assign(v, b2 * v + (1 - b2) * ops.square(g))
        denom = ops.sqrt(v) / ops.sqrt(1 - ops.power(b2, t)) + ops.cast(self.epsilon, variable.dtype)
        self.assign_sub(variable, (lr / (1 - ops.power(b1, t))) * m / denom)


@keras.saving.register_keras_serializable(package="tfdp")
class TimmLamb(keras.optimizers.Optimizer):
    """timm's `Lamb` (timm/optim/lamb.py, bias correction and gradient averaging on, no trust clipping).

    Per step: the gradients divided by max(1, ||g||_global / max_grad_norm)
    (timm clips inside the optimizer, 1.0 by default); m = b1 m + (1 - b1) g;
    v = b2 v + (1 - b2) g^2; u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps);
    for a decayed variable u = u + wd w and u = u * ||w|| / ||u|| (1 where
    either norm is 0); w = w - lr u. A variable without decay (the no-decay
    set, or weight decay 0) gets no trust ratio: timm's `always_adapt` is off.
    """

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-6, lamb_weight_decay=0.0,
                 max_grad_norm=1.0, name="timm_lamb", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        self.lamb_weight_decay, self.max_grad_norm = float(lamb_weight_decay), float(max_grad_norm or 0.0)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums = self.add_optimizer_variables(var_list, "momentum")
        self._velocities = self.add_optimizer_variables(var_list, "velocity")

    def _clip_gradients(self, grads):
        grads = super()._clip_gradients(grads)   # global_clipnorm: train.py's --clip-grad, before step()
        if not self.max_grad_norm:
            return grads
        norm = global_norm(grads)
        divisor = ops.maximum(norm / self.max_grad_norm, 1.0)
        return [g / ops.cast(divisor, g.dtype) if g is not None else g for g in grads]

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        t = ops.cast(self.iterations + 1, variable.dtype)
        b1, b2 = ops.cast(self.beta_1, variable.dtype), ops.cast(self.beta_2, variable.dtype)
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        self.assign(m, m + (g - m) * (1 - b1))   # torch's lerp_(grad, 1 - b1)
        self.assign(v, b2 * v + (1 - b2) * ops.square(g))
        denom = ops.sqrt(v) / ops.sqrt(1 - ops.power(b2, t)) + ops.cast(self.epsilon, variable.dtype)
        update = (m / (1 - ops.power(b1, t))) / denom
        if self.lamb_weight_decay and self._use_weight_decay(variable):
            update = update + ops.cast(self.lamb_weight_decay, variable.dtype) * variable
            w_norm, u_norm = ops.sqrt(ops.sum(ops.square(variable))), ops.sqrt(ops.sum(ops.square(update)))
            ratio = ops.where(w_norm > 0, ops.where(u_norm > 0, w_norm / u_norm, 1.0), 1.0)
            update = update * ratio
        self.assign_sub(variable, lr * update)

    def get_config(self):
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon,
                "lamb_weight_decay": self.lamb_weight_decay, "max_grad_norm": self.max_grad_norm}
