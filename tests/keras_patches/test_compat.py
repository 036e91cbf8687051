"""The Keras patches (tfdp/keras_patches): still needed, still resting on what they rely on, harmless elsewhere."""

import inspect
import re

import numpy as np
import pytest
import tensorflow as tf

from tfdp.keras_patches import MODEL_ATTRIBUTES, RELIED_ON, VARIABLE_ATTRIBUTES, fit_fixes as compat
from tfdp.config import DistributeConfig
from tfdp.distribute.strategy import make_runtime


def test_upstream_still_has_the_bugs_the_workaround_patches():
    """Fails when a Keras upgrade changes the patched code: then re-check keras-team/keras#20585
    and delete tfdp/keras_patches/fit_fixes.py if upstream fixed it."""
    reduce_src = inspect.getsource(compat._upstream_reduce_per_replica)
    build_src = inspect.getsource(compat._upstream_maybe_symbolic_build)
    assert 'strategy.reduce("MEAN", v, axis=0)' in reduce_src
    assert "self.distribute_strategy.reduce(" in build_src and '"MEAN"' in build_src


def test_patched_reduction_reduces_replica_values_off_multi_worker():
    """Replica r contributes r: the patched reduction must give the true mean, sum and first value."""
    strategy = make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy
    values = strategy.run(lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32))
    expected = {"auto": 0.5, "mean": 0.5, "sum": 1.0, "first": 0.0}
    for reduction, value in expected.items():
        ours = compat.reduce_per_replica({"m": values}, strategy, reduction)["m"]
        np.testing.assert_allclose(ours.numpy(), value, err_msg=reduction)


def test_apply_is_idempotent_and_installs_both():
    from keras.src.backend.tensorflow import trainer
    compat.apply()
    compat.apply()
    assert trainer.reduce_per_replica is compat.reduce_per_replica
    assert trainer.TensorFlowTrainer._maybe_symbolic_build is compat._maybe_symbolic_build


def test_mirrored_evaluate_when_replicas_get_unequal_first_batches():
    """40 examples, global batch 64: replica 0 gets 32, replica 1 gets 8. Upstream Keras fails here."""
    import keras
    strategy = make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy  # installs the fixes
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype("float32"), rng.integers(0, 3, 40)
    ds = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(ctx.get_per_replica_batch_size(64)))
    result = model.evaluate(ds, verbose=0, return_dict=True)
    expected = np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y)
    assert result["accuracy"] == pytest.approx(expected)


def test_fit_and_its_validation_start_each_input_pipeline_once(tmp_path):
    """The build takes its shapes from the dataset's spec: a fit of 2 epochs with validation starts each input
    pipeline once per epoch (upstream Keras: twice, reading one batch and dropping it before each start)."""
    import keras
    strategy = make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy
    starts = {"train": 0, "val": 0}

    def pipeline(split, ctx):
        def examples():
            starts[split] += 1
            rng = np.random.default_rng(0)
            for _ in range(4 * 8):
                yield rng.normal(size=4).astype("float32"), rng.integers(0, 3)
        spec = (tf.TensorSpec((4,), tf.float32), tf.TensorSpec((), tf.int64))
        return tf.data.Dataset.from_generator(examples, output_signature=spec).batch(8, drop_remainder=True)

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    train = strategy.distribute_datasets_from_function(lambda ctx: pipeline("train", ctx))
    val = strategy.distribute_datasets_from_function(lambda ctx: pipeline("val", ctx))
    history = model.fit(train, epochs=2, validation_data=val, verbose=0, shuffle=False)
    assert len(history.history["val_accuracy"]) == 2
    assert starts == {"train": 2, "val": 2}, starts


def _built_ema_optimizer():
    """An optimizer as tfdp builds one with optimizer.ema_decay: some names exist only on such an instance."""
    import keras
    optimizer = keras.optimizers.SGD(use_ema=True)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    return optimizer


# Classes whose relied-on attributes are set on their instances: the instance to look them up on.
_INSTANCES = {"keras.src.optimizers.base_optimizer.BaseOptimizer": _built_ema_optimizer,
              "keras.src.layers.layer.Layer": lambda: __import__("keras").layers.Dense(1)}


def _resolve(dotted: str):
    import importlib
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, name in enumerate(parts[cut:], start=cut):
            owner = ".".join(parts[:i])
            if not hasattr(obj, name) and i == len(parts) - 1 and owner in _INSTANCES:
                obj = _INSTANCES[owner]()
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _module_of(patch: str) -> str:
    return f"tfdp/keras_patches/{patch}.py" if patch in ("fit_fixes", "train_step", "eval_step") else f"tfdp/{patch}.py"


@pytest.mark.parametrize("patch", sorted(RELIED_ON))
def test_every_keras_internal_a_patch_relies_on_is_still_there(patch):
    """Fails, naming the patch, when a Keras (or TensorFlow) upgrade moves what it uses."""
    for name in RELIED_ON[patch]:
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            pytest.fail(f"{_module_of(patch)} relies on {name}, which is gone: re-check the patch")


def test_keras_still_calls_the_ema_hook_tfdp_overrides():
    """tfdp/optim/optimizers.py's EMA warm-up overrides `_update_model_variables_moving_average`: it works only while
    Keras' apply calls that hook after each update. Fails, naming the module, when an upgrade stops calling it."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    assert "self._update_model_variables_moving_average(" in inspect.getsource(BaseOptimizer._backend_apply_gradients), \
        "tfdp/optim/optimizers.py's EmaWarmup is no longer called by Keras: re-check it"


def test_keras_still_decays_through_the_hook_the_per_layer_rates_override():
    """tfdp/optim/finetune.py moves weight decay from `_apply_weight_decay` (a no-op there) into `update_step`, scaled per
    layer: right only while Keras' apply decays through that hook and asks `_use_weight_decay` per variable."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    assert "self._apply_weight_decay(" in inspect.getsource(BaseOptimizer._backend_apply_gradients), \
        "tfdp/optim/finetune.py's ScaledLearningRates: Keras no longer decays through _apply_weight_decay; re-check it"
    assert "self._use_weight_decay(" in inspect.getsource(BaseOptimizer._apply_weight_decay)


def test_the_reasons_for_the_replaced_steps_still_hold():
    """Each replaced step exists because of something upstream does; when that changes, re-check the step."""
    import keras
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from tfdp.keras_patches.train_step import _NEUTRAL
    test_src = inspect.getsource(TensorFlowTrainer.test_step)
    train_src = inspect.getsource(TensorFlowTrainer.train_step)
    for src in (test_src, train_src):  # the steps call the same private pieces as Keras' own
        assert "self._compute_loss(" in src and "self._loss_tracker.update_state(" in src
        assert "loss_module.unscale_loss_for_distribution(loss)" in src
    # eval_step.py: Keras' own test step still weights the loss by the batch size, padding included.
    assert "sample_weight=tf.shape(" in test_src
    # train_step.py: the TensorFlow optimizer still refuses stateless updates and still overrides, to call
    # tf.distribute, only methods whose backend-neutral versions exist.
    with pytest.raises(ValueError, match="not supported with the TensorFlow backend"):
        TFOptimizer.stateless_apply(keras.optimizers.SGD(), [], [], [])
    assert all(name in vars(TFOptimizer) for name in _NEUTRAL)
    assert all(name in vars(BaseOptimizer) for name in _NEUTRAL)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    for name in MODEL_ATTRIBUTES:
        assert hasattr(model, name), name
    for name in VARIABLE_ATTRIBUTES:
        assert hasattr(keras.Variable(1.0), name), name


def test_tensorflow_still_refuses_a_dataset_per_replica_where_tfdp_builds_its_own():
    """tfdp/distribute/strategy.py builds the datasets per replica DALI needs under OneDeviceStrategy and
    MultiWorkerMirroredStrategy because TensorFlow refuses them there (InputReplicationMode.PER_REPLICA); when an
    upgrade accepts them, its own path can replace tfdp's (re-check `_dataset_per_device`)."""
    import tensorflow as tf
    from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceExtended
    options = tf.distribute.InputOptions(experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
                                         experimental_fetch_to_device=False)
    with pytest.raises(NotImplementedError, match="PER_REPLICA"):
        tf.distribute.OneDeviceStrategy("/cpu:0").distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.range(2), options=options)
    assert "PER_REPLICA" in inspect.getsource(CollectiveAllReduceExtended._distribute_datasets_from_function)


def test_tensorflow_mirrored_per_replica_input_still_changes_the_strategys_later_inputs():
    """tfdp builds DALI's datasets per replica itself under MirroredStrategy too (`_dataset_per_device`), because
    TensorFlow's own PER_REPLICA path keeps its per-replica input devices as the strategy's: a later
    `distribute_datasets_from_function` with default options calls its function once per replica, not once per
    worker. Fails when an upgrade stops doing so: then MirroredStrategy's own path would do."""
    import tensorflow as tf
    strategy = tf.distribute.MirroredStrategy(tf.config.list_logical_devices("CPU")[:2])
    calls = []

    def dataset_fn(ctx):
        calls.append(ctx.num_input_pipelines)
        return tf.data.Dataset.range(4).batch(1)
    strategy.distribute_datasets_from_function(dataset_fn)
    options = tf.distribute.InputOptions(experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
                                         experimental_fetch_to_device=False)
    strategy.distribute_datasets_from_function(dataset_fn, options=options)
    strategy.distribute_datasets_from_function(dataset_fn)
    assert calls == [1, 2, 2, 2, 2], calls   # per worker; per replica; per replica again, with default options


def test_tensorflow_still_gives_a_cpu_worker_one_device_where_tfdp_gives_it_several():
    """`distribute.cpu_replicas_per_worker` replaces, while MultiWorkerMirroredStrategy is built, the method that
    counts a worker's devices (tfdp/distribute/strategy.py, `_worker_cpus`), because TensorFlow's gives a worker
    without GPUs one CPU device however many logical CPUs the host is split into (this process: conftest's 2).
    Fails when an upgrade counts them otherwise or calls the method with other arguments: re-check `_worker_cpus`."""
    import tensorflow as tf
    from tensorflow.python.distribute.cluster_resolver.tfconfig_cluster_resolver import TFConfigClusterResolver
    from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceExtended
    assert len(tf.config.list_logical_devices("CPU")) == 2
    counted = CollectiveAllReduceExtended._initialize_local_devices(None, TFConfigClusterResolver(), "/job:worker/task:1")
    assert counted == (("/job:worker/task:1/device:CPU:0",), "CPU")
    assert re.search(r"self\._initialize_local_devices\(\s*cluster_resolver,\s*self\._worker_device\s*\)",
                     inspect.getsource(CollectiveAllReduceExtended._initialize_multi_worker))
