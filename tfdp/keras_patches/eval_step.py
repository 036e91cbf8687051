"""An evaluation step whose loss is the exact mean over the real images.

Evaluation pads each replica's share with weight-0 images so every replica
runs the same number of full steps (see `tfdp.data.pipeline.eval_dataset`).
Keras' own `test_step` divides each batch's weighted loss sum by the batch
size *including* the padding and weights the running mean by that size too,
so `val_loss` came out too low, and lower the more replicas there were (0.47
on 2 replicas, 0.55 on 1, true 0.59 on the demo). Here each batch's loss is
re-normalised by its weight sum and the running mean is weighted by it, so
the loss tracker's sums over all replicas and workers are exactly
(sum of w * loss) / (sum of w): the mean over the split's real images, for any
batch size, replica count or worker count. Accuracy metrics are already
weighted (`weighted_metrics`) and unchanged.

It relies on Keras 3's private `_compute_loss` and `_loss_tracker`, as its
own `test_step` does; `tests/keras_patches/test_compat.py` fails when they change.
"""

from __future__ import annotations

import types

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils


def install_exact_eval_loss(model: keras.Model) -> None:
    """Replaces `model.test_step` with one whose loss is the mean over weight > 0 examples."""

    def test_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        loss = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
        batch = tf.cast(tf.shape(next(i for i in tree.flatten(x) if i is not None))[0], tf.float32)
        weight = batch if sample_weight is None else tf.reduce_sum(tf.cast(sample_weight, tf.float32))
        mean = tf.math.divide_no_nan(tf.cast(loss_module.unscale_loss_for_distribution(loss), tf.float32) * batch,
                                     weight)
        self._loss_tracker.update_state(mean, sample_weight=weight)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    model.test_step = types.MethodType(test_step, model)
