"""Gradient accumulation inside the compiled step (`train.grad_accum_steps`).

Each replica receives one batch of k x b images per optimizer step and the
step cuts it into k micro-batches of b: a loop runs forward and backward on
each, summing the gradients (and carrying the layers' non-trained state, the
batch-norm statistics, from one micro-batch to the next); the mean of the k
gradients is what one batch of k x b would have given (the loss is a mean
over the batch), and it is all-reduced and applied once. So:

- one step of `fit`, one optimizer step, one all-reduce and one update,
  whatever k is: the schedule, EMA, checkpoints, `checkpoint_every_steps`
  and the input stream's position all count optimizer steps;
- memory holds the activations of b images, not k x b (the loop is a
  `tf.while_loop`, each micro-batch's activations are freed before the next);
- metrics see every image: the predictions of the k micro-batches are
  gathered and the metrics updated once, over k x b.

Keras 3's own `gradient_accumulation_steps` is not used: its step is a
micro-batch (so `fit`'s steps, the checkpoints and the stream position would
count micro-batches), and its TensorFlow optimizer all-reduces the gradients
in `apply_gradients` before it accumulates them, once per micro-batch (see
docs/global-batch.md).

Batch norm normalises each micro-batch by its own statistics (b images, or
b x replicas with `model.sync_bn`, whose all-reduce then runs once per
micro-batch, in a loop unrolled for it): that is the one thing that differs from a
real batch of k x b.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf


def micro_batches(k: int, *tensors):
    """Each tensor [k * b, ...] (None stays None) as [k, b, ...]: micro-batch i is rows i*b .. (i+1)*b - 1."""
    def split(t):
        if t is None:
            return None
        return tf.reshape(t, tf.concat([[k, -1], tf.shape(t)[1:]], 0))
    return tuple(tf.nest.map_structure(split, t) if t is not None else None for t in tensors)


def accumulate(forward_backward: Callable, k: int, trainable: list, non_trainable: list, x, y, sample_weight,
               unroll: bool = False):
    """(mean loss, mean gradients, predictions of all k x b images, new non-trained values) over k micro-batches.

    `forward_backward(trainable, non_trainable, x, y, sample_weight)` returns
    (loss, gradients, y_pred, new non-trained values) of one micro-batch; its
    gradients may be loss-scaled (mixed_float16), the mean keeps the scale.
    A gradient that is None (a variable the loss does not reach) stays None.
    `unroll`: a Python loop instead of a `tf.while_loop`, for a forward pass
    with a collective in it (synchronised batch norm), which tf.distribute
    cannot run inside a loop; control dependencies keep its micro-batches one
    after the other.
    """
    xs, ys, ws = micro_batches(k, x, y, sample_weight)
    take = lambda t, i: None if t is None else tf.nest.map_structure(lambda a: a[i], t)  # noqa: E731

    # The first micro-batch outside the loop: it fixes which gradients exist and the predictions' shape.
    loss, gradients, y_pred, non_trainable_now = forward_backward(trainable, non_trainable, take(xs, 0),
                                                                  take(ys, 0), take(ws, 0))
    non_trainable_now = [n if n is not None else o for n, o in zip(non_trainable_now, non_trainable)]
    present = [i for i, g in enumerate(gradients) if g is not None]

    def body(i, loss_sum, sums, state, predictions):
        x_i = take(xs, i)
        if unroll:
            with tf.control_dependencies(sums):  # the previous micro-batch's backward pass first
                x_i = tf.nest.map_structure(tf.identity, x_i)
        loss_i, grads_i, y_pred_i, state_i = forward_backward(trainable, list(state), x_i, take(ys, i), take(ws, i))
        state_i = [n if n is not None else o for n, o in zip(state_i, state)]
        sums = [s + tf.cast(grads_i[j], s.dtype) for s, j in zip(sums, present)]
        return i + 1, loss_sum + tf.cast(loss_i, loss_sum.dtype), sums, state_i, predictions.write(i, y_pred_i)

    predictions = tf.TensorArray(y_pred.dtype, size=k, element_shape=y_pred.shape).write(0, y_pred)
    carry = (tf.constant(1), tf.cast(loss, tf.float32), [gradients[j] for j in present], non_trainable_now,
             predictions)
    if unroll:
        for _ in range(1, k):
            carry = body(*carry)
    else:  # one micro-batch at a time: that is the memory saved
        carry = tf.while_loop(lambda i, *_: i < k, body, carry, parallel_iterations=1)
    _, loss_sum, sums, non_trainable_now, predictions = carry
    mean = list(gradients)
    for j, s in zip(present, sums):
        mean[j] = s / tf.cast(k, s.dtype)
    y_pred_all = tf.reshape(predictions.stack(), tf.concat([[-1], tf.shape(y_pred)[1:]], 0))
    return tf.cast(loss_sum / k, loss.dtype), mean, y_pred_all, non_trainable_now


def has_collectives(model) -> bool:
    """Whether the forward pass all-reduces (synchronised batch norm): then the micro-batch loop is unrolled."""
    return any(getattr(layer, "synchronized", False) for layer in _all_layers(model))


def _all_layers(layer):
    for child in getattr(layer, "layers", ()):
        yield child
        yield from _all_layers(child)
