"""The Keras multi-worker workaround: still needed, and harmless elsewhere."""

import inspect

import numpy as np
import tensorflow as tf

from tfdp import compat


def test_upstream_still_has_the_bugs_the_workaround_patches():
    """Fails when a Keras upgrade changes the patched code: then re-check keras-team/keras#20585
    and delete tfdp/compat.py if upstream fixed it."""
    reduce_src = inspect.getsource(compat._upstream_reduce_per_replica)
    build_src = inspect.getsource(compat._upstream_maybe_symbolic_build)
    assert 'strategy.reduce("MEAN", v, axis=0)' in reduce_src
    assert "self.distribute_strategy.reduce(" in build_src and '"MEAN"' in build_src


def test_patched_reduction_matches_upstream_off_multi_worker():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    values = strategy.run(lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32))
    for reduction in ("auto", "mean", "sum", "first"):
        ours = compat.reduce_per_replica({"m": values}, strategy, reduction)["m"]
        theirs = compat._upstream_reduce_per_replica({"m": values}, strategy, reduction)["m"]
        np.testing.assert_allclose(ours.numpy(), theirs.numpy())


def test_apply_is_idempotent_and_installs_both():
    from keras.src.backend.tensorflow import trainer
    compat.apply()
    compat.apply()
    assert trainer.reduce_per_replica is compat.reduce_per_replica
    assert trainer.TensorFlowTrainer._maybe_symbolic_build is compat._maybe_symbolic_build


def test_mirrored_evaluate_when_replicas_get_unequal_first_batches(digits_dir):
    """40 images, global batch 64: replica 0 gets 32, replica 1 gets 8. Upstream Keras fails here."""
    import keras

    from tfdp.config import validate
    from tfdp.data import build_source
    from tfdp.data.pipeline import eval_dataset
    from tfdp.models import build_model
    compat.apply()
    cfg = validate({"data": {"format": "image_folder", "dir": digits_dir, "image_size": 16}, "model": {"name": "simple_cnn"}})
    split = build_source(cfg.data).split("val")
    split = type(split)(split.name, split.files[:40], split.labels[:40])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = build_model(cfg.model, cfg.data)
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    ds = strategy.distribute_datasets_from_function(lambda ctx: eval_dataset(split, cfg.data, 64, ctx))
    result = model.evaluate(ds, verbose=0, return_dict=True)
    assert 0.0 <= result["accuracy"] <= 1.0 and np.isfinite(result["loss"])
