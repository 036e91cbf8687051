"""Batch norm as the weights' framework trains it: Keras' rule or torch's, and sync batch norm as torch merges it.

Both frameworks normalise a training batch with its biased variance (the
mean of squared deviations over the N·H·W values of a channel). They part on
the moving variance that evaluation reads: Keras' BatchNormalization moves it
towards that biased variance, torch's BatchNorm2d towards the unbiased one,
var · n / (n − 1). A model trained by torch's rule and evaluated by Keras'
(or the reverse) is evaluated with other statistics from the first step on.
`RUNNING_VARIANCE` holds the two rules; the registry says which one each model
family follows (`registry.BATCH_NORM`: torch's for the families built from
timm's and torchvision's layouts, Keras' for keras.applications), and
`build.build_model` gives every batch-norm layer of the model its family's
rule (`use_batch_norm_rule`).

The momentum is the same number in both: Keras keeps `momentum` of the old
statistic (0.9), torch mixes in `momentum` of the new one (0.1); `model.bn_momentum`
is in Keras' sense.

Sync batch norm (`model.sync_bn`) computes the statistics over the global
batch, as torch's SyncBatchNorm does: each replica's mean, sum of squared
deviations from it (M2) and count, merged by the parallel-variance formula
(Chan et al.; torch's `batch_norm_gather_stats_with_counts`): the global
mean is Σ nᵢmᵢ / n, the global M2 is Σ M2ᵢ + Σ nᵢ(mᵢ − m)², every term
non-negative. Keras' own synchronized mode takes E[x²] − E[x]² over the
all-reduced sums, which loses the variance's leading digits to cancellation
wherever a channel's mean is large beside its spread. Under torch's rule the
moving variance is made unbiased with the global count n, as torch's is.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf
from keras import ops


def biased(count):
    """Keras' rule: the moving variance follows the batch's biased variance as it is."""
    return 1.0


def unbiased(count):
    """torch's rule: the batch's variance times n / (n − 1), n the values per channel it was taken over (one value
    has no spread: its variance is 0 whatever the factor, so n = 1 keeps factor 1 rather than dividing by 0)."""
    return count / ops.maximum(count - 1.0, 1.0)


# rule → the factor that turns the batch's biased variance into the one the moving variance follows
RUNNING_VARIANCE: dict[str, Callable] = {"keras": biased, "torch": unbiased}


@keras.saving.register_keras_serializable(package="tfdp")
class BatchNormalization(keras.layers.BatchNormalization):
    """Keras' BatchNormalization whose moving variance follows `running_variance`'s rule (`RUNNING_VARIANCE`) and
    whose `synchronized` statistics are merged per replica (`global_moments`).

    It has Keras' variables (`gamma`, `beta`, `moving_mean`, `moving_variance`) and Keras' class name: a Keras
    weights file (tfdp's checkpoints, `.keras` files) keys each layer by its class's name in snake case, so a
    checkpoint written with either class loads into the other.

    The batch is normalised with its biased variance under either rule. Statistics are taken in float32 (or
    wider) whatever the compute dtype, as Keras takes them. Masks and batch renormalisation, which no tfdp
    model uses, stay Keras' own code path."""

    def __init__(self, running_variance: str = "keras", **kwargs):
        super().__init__(**kwargs)
        self.running_variance = running_variance

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable) or mask is not None or self.renorm or self.keeps_keras_step():
            return super().call(inputs, training=training, mask=mask)
        x = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        axes = [i for i in range(len(x.shape)) if i != self.axis % len(x.shape)]   # all but the channels'
        mean, variance, count = global_moments(x, axes, self.synchronized)
        factor = RUNNING_VARIANCE[self.running_variance](count)
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(
            self.moving_variance * self.momentum + variance * factor * (1.0 - self.momentum))
        gamma = ops.cast(self.gamma, x.dtype) if self.scale else None
        beta = ops.cast(self.beta, x.dtype) if self.center else None
        outputs = ops.batch_normalization(x, mean, variance, axis=self.axis, offset=beta, scale=gamma,
                                          epsilon=self.epsilon)
        return ops.cast(outputs, self.compute_dtype)

    def keeps_keras_step(self) -> bool:
        """Keras' rule on one replica's batch is Keras' own step, op for op: keras.applications models train as
        they did."""
        return self.running_variance == "keras" and not self.synchronized

    def get_config(self):
        return {**super().get_config(), "running_variance": self.running_variance}


def local_moments(x, axes):
    """This replica's per-channel mean, M2 (the sum of squared deviations from that mean: two passes, no
    cancellation) and count, as float tensors. An empty shard gives 0, 0, 0."""
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
    mean = tf.math.divide_no_nan(tf.reduce_sum(x, axis=axes, keepdims=True), count)
    m2 = tf.reduce_sum(tf.square(x - mean), axis=axes)
    return tf.squeeze(mean, axes), m2, count


def global_moments(x, axes, synchronized: bool):
    """The per-channel mean, biased variance and count the batch is normalised with: this replica's alone, or
    (`synchronized`, in a replica context) the global batch's, merged from every replica's (mean, M2, count) by
    the parallel-variance formula: n = Σ nᵢ, m = Σ nᵢmᵢ / n, M2 = Σ M2ᵢ + Σ nᵢ(mᵢ − m)². Two all-reduces, each
    differentiable, so gradients flow through the global statistics as torch's SyncBatchNorm's do."""
    mean, m2, count = local_moments(x, axes)
    context = tf.distribute.get_replica_context()
    if not synchronized or context is None:
        return mean, tf.math.divide_no_nan(m2, count), count
    totals = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat([mean * count, count[None]], axis=0))
    total = totals[-1]
    merged_mean = tf.math.divide_no_nan(totals[:-1], total)
    spread = context.all_reduce(tf.distribute.ReduceOp.SUM, m2 + count * tf.square(mean - merged_mean))
    return merged_mean, tf.math.divide_no_nan(spread, total), total


def batch_norm_layers(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    """Every BatchNormalization layer of `model`, however deeply nested (through the models' public `layers`)."""
    return [layer for layer in _all_layers(model) if isinstance(layer, keras.layers.BatchNormalization)]


def _all_layers(layer):
    for child in getattr(layer, "layers", ()):
        yield child
        yield from _all_layers(child)


def use_batch_norm_rule(model: keras.Model, rule: str, synchronized: bool = False) -> int:
    """Makes every batch-norm layer of `model` tfdp's `BatchNormalization` following `rule` (`RUNNING_VARIANCE`),
    its statistics over the global batch if `synchronized`; returns how many layers.

    keras.applications builds its own BatchNormalization layers, so the layer objects are re-typed in place
    (tfdp's class adds only methods and one setting to Keras'): each keeps its variables, name and place in the
    graph, and nothing is rebuilt. Keras reads these settings when the training step is traced."""
    if rule not in RUNNING_VARIANCE:
        raise ValueError(f"unknown batch-norm rule {rule!r} (known: {', '.join(RUNNING_VARIANCE)})")
    layers = batch_norm_layers(model)
    for layer in layers:
        if not isinstance(layer, BatchNormalization):
            layer.__class__ = BatchNormalization
        layer.running_variance = rule
        layer.synchronized = synchronized
    return len(layers)
