"""XLA for the per-replica part of each training step, under any strategy.

Keras 3 compiles `train_step` as a whole with `jit_compile=True`, and that
step ends in `optimizer.apply_gradients`, which all-reduces gradients across
replicas (a cross-replica `merge_call`) and updates mirrored variables. XLA
cannot compile that part inside a replica, so Keras' own jit fails under
MirroredStrategy (and Keras turns `jit_compile="auto"` off there).

tfdp compiles the part that is pure computation instead: forward pass, loss
and gradients, written as a stateless function of the variable values
(`Model.stateless_call`, the way Keras' JAX trainer works), so it holds no
variable writes and no collectives. The step then, outside XLA, writes the new
non-trainable state (batch-norm statistics), lets the optimizer all-reduce and
apply the gradients, and updates the metrics, exactly as Keras' own step does.
The same code runs with one replica or many; nothing here knows the strategy.
"""

from __future__ import annotations

import types

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils


def use_xla(setting, devices, sync_bn: bool = False) -> tuple[bool, str]:
    """Resolves `train.jit_compile` (`auto`, true, false) for the strategy's devices, with the reason."""
    if setting != "auto":
        return bool(setting), "train.jit_compile: " + str(bool(setting)).lower()
    if sync_bn:
        return False, "auto: off with model.sync_bn"
    accelerators = [d for d in devices if any(kind in d.upper() for kind in ("GPU", "TPU"))]
    if accelerators:
        return True, f"auto: on for {len(accelerators)} accelerator device(s)"
    return False, "auto: off on CPU devices"


def compile_per_replica_step(model: keras.Model) -> None:
    """Makes `model.fit` run its forward/backward pass through XLA on every replica."""
    model.jit_compile = False  # Keras must not wrap the cross-replica step itself

    @tf.function(jit_compile=True, reduce_retracing=True)
    def forward_backward(trainable, non_trainable, x, y, sample_weight):
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            y_pred, new_non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            scaled = model.optimizer.scale_loss(loss)
        return loss, tape.gradient(scaled, trainable), y_pred, new_non_trainable

    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        trainable = self.trainable_variables
        non_trainable = self.non_trainable_variables
        loss, gradients, y_pred, new_non_trainable = forward_backward(
            [v.value for v in trainable], [v.value for v in non_trainable], x, y, sample_weight)
        for variable, value in zip(non_trainable, new_non_trainable):
            variable.assign(value)
        batch = tf.shape(next(i for i in tree.flatten(x) if i is not None))[0]
        self._loss_tracker.update_state(loss_module.unscale_loss_for_distribution(loss), sample_weight=batch)
        self.optimizer.apply_gradients(zip(gradients, trainable))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    model.train_step = types.MethodType(train_step, model)
    model.xla_forward_backward = forward_backward
