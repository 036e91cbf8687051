"""The training step, compiled with XLA whole: forward, backward and the optimizer update, on every replica.

Keras 3 compiles `train_step` as a whole with `jit_compile=True`, but that
step ends in `optimizer.apply_gradients`, which all-reduces gradients across
replicas (a cross-replica `merge_call`) and updates mirrored variables one by
one: Keras' `jit_compile="auto"` turns XLA off under any tf.distribute strategy,
an explicit True fails there (keras-team/keras#19005), and compiling only the forward/backward pass leaves
the optimizer update running op by op (slower than plain Keras: docs/benchmarks.md, GPU).

tfdp's step is written the way Keras' JAX trainer works, as stateless
functions of the variables' values:

    one replica:   [forward, backward, optimizer update]                    one XLA program
    N replicas:    [forward, backward]  →  all-reduce(gradients)  →  [optimizer update]

The update is Keras' own optimizer maths (`stateless_apply`: schedule,
momentum, weight decay, clipping, EMA), run with the backend-neutral versions
of the few methods the TensorFlow backend overrides to call tf.distribute.
Every replica applies the same all-reduced gradients to its own copy of the
variables (Keras creates them with aggregation NONE, so a write in replica
context lands on the local copy), which keeps the copies identical without
a second collective. Nothing here knows the strategy: the replica count
decides whether there is an all-reduce between the two programs.

A mixed_float16 loss-scale optimizer skips steps whose gradients overflow, a
decision its TensorFlow version takes across replicas; with it the update
stays Keras' own (forward/backward still compiled).
"""

from __future__ import annotations

import threading
import types

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.losses import loss as loss_module
from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers.data_adapters import data_adapter_utils

from tfdp.optim.accumulation import accumulate, has_collectives
from tfdp.augment import step_seed
from tfdp.optim.finetune import expand_to_built


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


def compile_train_step(model: keras.Model, jit_compile: bool = True, accum_steps: int = 1) -> None:
    """Makes `model.fit` run the whole training step through XLA on every replica (`train.jit_compile`),
    over `accum_steps` micro-batches per optimizer step (`tfdp.optim.accumulation`).

    Without XLA and without accumulation Keras' own step runs op by op: the
    reference the compiled step is tested against. Accumulation without XLA
    runs these same functions op by op (inside Keras' tf.function).
    """
    model.jit_compile = False  # Keras must not wrap the cross-replica step itself
    optimizer = model.optimizer
    compiled_update = not isinstance(optimizer, LossScaleOptimizer)
    jit = tf.function(jit_compile=True, reduce_retracing=True) if jit_compile else (lambda f: f)
    unroll = has_collectives(model)  # synchronised batch norm: tf.distribute runs no collective in a loop

    def micro_forward_backward(trainable, non_trainable, x, y, sample_weight):
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            y_pred, new_non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            scaled = optimizer.scale_loss(loss)
        return loss, tape.gradient(scaled, trainable), y_pred, new_non_trainable

    # The update runs over every variable the optimizer was built with (`built`); frozen ones (train.freeze, not in
    # the model's trainable set) get a None gradient and come back unchanged (tfdp/optim/finetune.py).
    spread = lambda gradients: expand_to_built(optimizer, model.trainable_variables, gradients)  # noqa: E731

    def forward_backward(trainable, non_trainable, x, y, sample_weight):
        if accum_steps == 1:
            return micro_forward_backward(trainable, non_trainable, x, y, sample_weight)
        return accumulate(micro_forward_backward, accum_steps, trainable, non_trainable, x, y, sample_weight,
                          unroll=unroll)

    def whole_step(trainable, non_trainable, optimizer_values, built, x, y, sample_weight):
        loss, gradients, y_pred, new_non_trainable = forward_backward(trainable, non_trainable, x, y, sample_weight)
        new_built, new_optimizer = stateless_update(optimizer, optimizer_values, spread(gradients), built,
                                                    fresh_buffers(model, new_non_trainable))
        return loss, y_pred, new_non_trainable, new_built, new_optimizer

    def optimizer_update(built, optimizer_values, gradients, buffers):
        return stateless_update(optimizer, optimizer_values, spread(gradients), built, buffers)

    forward_backward_c, whole_step_c, update_c = jit(forward_backward), jit(whole_step), jit(optimizer_update)

    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        trainable, non_trainable = self.trainable_variables, self.non_trainable_variables
        built = optimizer._trainable_variables if compiled_update else trainable
        values = lambda variables: [v.value for v in variables]  # noqa: E731
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        if compiled_update and replicas == 1:
            loss, y_pred, new_non_trainable, new_trainable, new_optimizer = whole_step_c(
                values(trainable), values(non_trainable), values(optimizer.variables), values(built), x, y,
                sample_weight)
        else:
            loss, gradients, y_pred, new_non_trainable = forward_backward_c(
                values(trainable), values(non_trainable), x, y, sample_weight)
            if not compiled_update:
                optimizer.apply_gradients(zip(gradients, trainable))  # writes the variables itself
                new_trainable = new_optimizer = None
            else:
                gradients = all_reduce_sum(gradients)
                buffers = all_reduce_mean(fresh_buffers(model, new_non_trainable))
                new_trainable, new_optimizer = update_c(values(built), values(optimizer.variables), gradients, buffers)
        write_local(non_trainable, new_non_trainable)
        write_local(built, new_trainable)
        write_local(optimizer.variables, new_optimizer)
        batch = tf.shape(next(i for i in tree.flatten(x) if i is not None))[0]
        self._loss_tracker.update_state(loss_module.unscale_loss_for_distribution(loss), sample_weight=batch)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    model.train_step = types.MethodType(train_step, model)
    model.tfdp_step_functions = (forward_backward_c, whole_step_c, update_c)  # for tests: which ones ran


def all_reduce_sum(gradients: list) -> list:
    """The sum over all replicas of all workers, in one batched collective (None gradients stay None)."""
    present = [i for i, g in enumerate(gradients) if g is not None]
    reduced = tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, [gradients[i] for i in present])
    out = list(gradients)
    for i, g in zip(present, reduced):
        out[i] = g
    return out


def fresh_buffers(model: keras.Model, new_non_trainable: list) -> dict:
    """{id(variable): value after this step's forward pass} for the buffers the optimizer's EMA averages
    (rules timm/torchvision, tfdp/optim/ema.py): the step has not written them yet when it updates the EMA."""
    tracked = {id(v) for v in getattr(model.optimizer, "tfdp_buffers", ())}
    return {id(v): value for v, value in zip(model.non_trainable_variables, new_non_trainable) if id(v) in tracked}


def all_reduce_mean(values: dict) -> dict:
    """`values` averaged over all replicas (one batched collective): the EMA of the replicas' mean statistics
    is the mean of their EMAs, so every replica keeps the same average."""
    if not values:
        return values
    keys = list(values)
    context = tf.distribute.get_replica_context()
    summed = context.all_reduce(tf.distribute.ReduceOp.MEAN, [values[k] for k in keys])
    return dict(zip(keys, summed))


def write_local(variables, new_values) -> None:
    """Writes each changed value to this replica's own copy of its variable.

    Values the step did not change come back as None (or as the variable
    itself) and are skipped. Writing the local copy directly also covers the
    optimizer's iteration counter, which tf.distribute would otherwise
    synchronise through a merge_call: every replica computes the same value.
    """
    if new_values is None:
        return
    for variable, value in zip(variables, new_values):
        target = variable.value
        if value is target or value is None:
            continue
        if isinstance(target, tf.distribute.DistributedValues):
            target = target._get_on_device_or_primary()
        target.assign(tf.cast(value, target.dtype))


# The TensorFlow backend overrides these to call tf.distribute (merge_call, replica all-reduce, in-place
# variable writes); the backend-neutral versions compute the same update on values, as JAX runs it.
_NEUTRAL = ("stateless_apply", "assign", "assign_add", "assign_sub", "_apply_weight_decay", "_backend_update_step",
            "_overwrite_model_variables_with_average_value", "_backend_increment_gradient_accumulators")
_neutral_lock = threading.Lock()


def _var_key_in_stateless_scope(optimizer, variable):
    """The TensorFlow optimizer's key for `variable` (its tf.Variable's id), found without reading the
    variable's value: inside a stateless scope `.value` is the mapped tensor, which has no id."""
    if isinstance(variable, keras.Variable):
        variable = variable._value
    return TFOptimizer._var_key(optimizer, variable)


def stateless_update(optimizer: keras.optimizers.Optimizer, optimizer_values: list, gradients: list,
                     trainable_values: list, buffers: dict | None = None) -> tuple[list, list]:
    """(new trainable values, new optimizer values): Keras' own `optimizer.apply`, on values only.

    Must run while tracing (inside a tf.function): the neutral methods are
    installed on the instance just for the trace. Replicas of a
    MirroredStrategy trace in threads, hence the lock.
    """
    with _neutral_lock:
        overridden = [name for name in _NEUTRAL if getattr(type(optimizer), name) is getattr(TFOptimizer, name)]
        for name in overridden:
            setattr(optimizer, name, types.MethodType(getattr(BaseOptimizer, name), optimizer))
        optimizer._var_key = types.MethodType(_var_key_in_stateless_scope, optimizer)
        optimizer.tfdp_fresh_buffers = buffers   # the EMA's batch-norm statistics, as this step's forward left them
        try:
            new_trainable, new_optimizer = optimizer.stateless_apply(optimizer_values, gradients, trainable_values)
        finally:
            for name in [*overridden, "_var_key", "tfdp_fresh_buffers"]:
                delattr(optimizer, name)
    # stateless_apply hands back the very input for a value it did not change: None says so to `write_local`.
    unchanged = lambda new, old: [None if n is o else n for n, o in zip(new, old)]  # noqa: E731
    return unchanged(new_trainable, trainable_values), unchanged(new_optimizer, optimizer_values)


def augment_before_step(model: keras.Model, augment, run_seed: int, jit_compile: bool) -> None:
    """Runs `augment(images, labels, seed) -> (images, soft labels)` on each replica's batch before the step.

    The batch augmentations (tfdp/augment/) are per-pixel work, so they run
    on the device, as the step's first program (compiled with XLA when the
    step is). Their seed comes from (train.seed, the optimizer's step,
    the global replica id): every replica and every step draws its own, and a
    resumed run draws what the uninterrupted one would have.
    """
    inner = model.train_step
    run = tf.function(augment, jit_compile=True, reduce_retracing=True) if jit_compile else augment

    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        x, y = run(x, y, step_seed(run_seed, self.optimizer.iterations, replica))
        return inner((x, y) if sample_weight is None else (x, y, sample_weight))

    model.train_step = types.MethodType(train_step, model)

