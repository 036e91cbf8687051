"""Checks the model families' tests run on a model of their own builder: one eager 2-replica step, and the
transformers' training, saving and compiling."""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np


def steps_on_replicas(strategy, build: Callable[[], keras.Model], images: np.ndarray, classes: int) -> keras.Model:
    """`build()` in `strategy`'s scope, one eager SGD step on `images` (the replicated step and all-reduce, without
    minutes of graph tracing for the big models): the loss is finite, the weights move, the logits come out for
    every image.

    The initial weights are seeded: an unseeded draw makes this check flaky, not stricter. SqueezeNet ends in a ReLU
    before its pooling (as torchvision's does), and about 1 draw in 40 makes every logit of these images zero, so no
    gradient reaches any weight and nothing can move. Keras' seeded initialisers are stateless, so the same draw
    comes out on any host."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    labels = np.arange(len(images)) % classes
    before = [w.numpy().copy() for w in model.trainable_weights]
    history = model.fit(images, labels, batch_size=len(images), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert any(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights))
    assert model.predict(images, verbose=0).shape == (len(images), classes)
    return model


def trains_saves_and_compiles(backbone: Callable[[], keras.Model], size: int, path, classes: int = 5) -> None:
    """`backbone()` (float images in, `classes` logits out, built at `size` px) behind a uint8 input and tfdp's
    Standardize, under tfdp's 2-replica strategy: an AdamW step (eager: the same replicated step and all-reduce,
    without tracing the backward pass, as test_models.py steps the zoo) moves every weight and stays finite; a
    .keras round trip (to `path`) gives the same outputs; XLA-compiled inference equals eager; mixed_bfloat16 stays
    within 10 % of float32's largest logit."""
    import tensorflow as tf
    from tfdp.config import validate
    from tfdp.distribute.strategy import make_runtime
    from tfdp.models import Standardize
    strategy = make_runtime(validate({"distribute": {"strategy": "mirrored", "cpu_replicas": 2}}).distribute).strategy

    def wrapped():
        inputs = keras.Input((size, size, 3), dtype="uint8")
        logits = backbone()(Standardize((127.5,) * 3, (127.5,) * 3)(inputs))
        return keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(logits))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = wrapped()
        model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    images = np.random.default_rng(0).integers(0, 256, (8, size, size, 3), dtype=np.uint8)
    before = [w.numpy().copy() for w in model.trainable_weights]
    history = model.fit(images, np.arange(8) % classes, batch_size=8, epochs=1, verbose=0).history["loss"]
    assert np.all(np.isfinite(history))
    assert all(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights))
    eager = model.predict(images, verbose=0)
    model.save(path)
    np.testing.assert_allclose(keras.models.load_model(path).predict(images, verbose=0), eager, rtol=0, atol=1e-5)
    plain = wrapped()
    plain.set_weights(model.get_weights())
    xla = tf.function(lambda x: plain(x, training=False), jit_compile=True)(images).numpy()
    np.testing.assert_allclose(xla, eager, rtol=0, atol=1e-4)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        half = wrapped()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    assert np.abs(half.predict(images, verbose=0) - eager).max() / np.abs(eager).max() < 0.1
