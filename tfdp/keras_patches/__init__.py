"""Every place tfdp changes how Keras 3 trains, in one package, each guarded by a canary.

Keras' `fit` is kept (callbacks, metrics, progress, distribution), and three
pieces of it are replaced:

- `fit_fixes`: two workarounds for `fit` under MultiWorkerMirroredStrategy
  (keras-team/keras#20585), installed once by `tfdp.distribute.strategy.make_runtime`
  (`install()`);
- `train_step`: the training step compiled with XLA, optimizer update
  included, per replica with the gradient all-reduce between;
- `eval_step`: the evaluation step whose loss is the mean over the real
  images, not over the evaluation padding.

Each relies on Keras internals. `RELIED_ON` names them all, and
`tests/keras_patches/test_compat.py` resolves every name and checks the upstream code each
patch exists for: when a Keras upgrade moves or changes one, that test fails
and says which patch to re-check.
"""

from __future__ import annotations

# Private Keras (and tf.distribute) names the patches use, by patch. The canary resolves each one.
RELIED_ON = {
    "fit_fixes": (
        "keras.src.backend.tensorflow.trainer.reduce_per_replica",
        "keras.src.backend.tensorflow.trainer.TensorFlowTrainer._maybe_symbolic_build",
        "keras.src.backend.tensorflow.trainer.TensorFlowTrainer._symbolic_build",
        "keras.src.backend.tensorflow.trainer._collective_all_reduce_multi_worker",
        "keras.src.backend.tensorflow.trainer._is_per_replica_instance",
        "keras.src.backend.tensorflow.trainer.TFEpochIterator",   # its `_distributed_dataset` (set in __init__)
        "tensorflow.python.distribute.values.PerReplicaSpec",
    ),
    "train_step": (
        "keras.src.trainers.trainer.Trainer._compute_loss",
        "keras.src.losses.loss.unscale_loss_for_distribution",
        "keras.src.trainers.data_adapters.data_adapter_utils.unpack_x_y_sample_weight",
        "keras.src.optimizers.base_optimizer.BaseOptimizer.stateless_apply",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._backend_update_step",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._apply_weight_decay",
        "keras.src.backend.tensorflow.optimizer.TFOptimizer.stateless_apply",
        "keras.src.backend.tensorflow.optimizer.TFOptimizer._var_key",
        "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer",
        "tensorflow.python.distribute.values.DistributedVariable._get_on_device_or_primary",
    ),
    "eval_step": (
        "keras.src.trainers.trainer.Trainer._compute_loss",
        "keras.src.losses.loss.unscale_loss_for_distribution",
        "keras.src.trainers.data_adapters.data_adapter_utils.unpack_x_y_sample_weight",
    ),
    # Outside this package (keys that are not a patch name a module of tfdp/): the EMA warm-up overrides the
    # hook Keras' apply calls after each update; LARS and RMSProp read an optimizer variable's slot and ask
    # whether it is decayed; `ema_weights` in tfdp/train/callbacks.py reads the averages an EMA optimizer builds.
    "optimizers": (
        "keras.src.optimizers.base_optimizer.BaseOptimizer._update_model_variables_moving_average",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._get_variable_index",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._use_weight_decay",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._model_variables_moving_average",
    ),
    # torch's and timm's update rules: timm's Lamb clips inside the optimizer, after Keras' own clipping.
    "optim/torch_forms": (
        "keras.src.optimizers.base_optimizer.BaseOptimizer._clip_gradients",
        "keras.src.optimizers.base_optimizer.global_norm",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._get_variable_index",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._use_weight_decay",
    ),
    # timm's and torchvision's EMA override the hook Keras' apply calls after each update, over its averages.
    "optim/ema": (
        "keras.src.optimizers.base_optimizer.BaseOptimizer._update_model_variables_moving_average",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._model_variables_moving_average",
    ),
    "callbacks": (
        "keras.src.optimizers.base_optimizer.BaseOptimizer._model_variables_moving_average",  # set by build()
        "keras.src.optimizers.base_optimizer.BaseOptimizer._trainable_variables",
    ),
    # Per-layer learning rates: the decay moves from the hook Keras' apply calls into `update_step`, which looks
    # up each variable's scale by Keras' index; frozen variables are laid out over what the optimizer was built on.
    "finetune": (
        "keras.src.optimizers.base_optimizer.BaseOptimizer._apply_weight_decay",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._get_variable_index",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._use_weight_decay",
        "keras.src.optimizers.base_optimizer.BaseOptimizer._trainable_variables",
    ),
    # Weight import reads and writes a layer's own variables in the order Keras saves them.
    "models/weights": (
        "keras.src.layers.layer.Layer._trainable_variables",  # set by __init__
        "keras.src.layers.layer.Layer._non_trainable_variables",
    ),
    # The ONNX export runs Keras' numpy-2 patch of tf2onnx (as Keras' own ONNX export does) and has tf2onnx write
    # each node into a fresh NodeProto on every optimizer pass (`_fresh_node_protos`: bounded memory).
    "export": (
        "keras.src.export.tf2onnx_lib.patch_tf2onnx",
        "tf2onnx.graph.Node.update_proto",
    ),
    # AutoGraph leaves tfdp's functions unconverted: one more rule in TensorFlow's list of packages it does not
    # convert (tests/startup/test_startup.py checks the effect).
    "tf_setup": (
        "tensorflow.python.autograph.core.config.CONVERSION_RULES",
        "tensorflow.python.autograph.core.config.DoNotConvert",
        "tensorflow.python.autograph.core.config_lib.Rule.matches",
    ),
    # A dataset per replica on every strategy, built from the parts of TensorFlow's input library MirroredStrategy
    # builds it from (`Runtime.datasets_per_replica`, for DALI).
    "distribute/strategy": (
        "tensorflow.python.distribute.input_lib.InputWorkers",
        "tensorflow.python.distribute.input_util.get_distributed_datasets_from_function",
        "tensorflow.python.distribute.device_util.canonicalize",
        "tensorflow.python.distribute.device_util.get_host_for_device",
        # distribute.cpu_replicas_per_worker: a CPU worker mirrors over logical CPUs (`_worker_cpus`)
        "tensorflow.python.distribute.collective_all_reduce_strategy.CollectiveAllReduceExtended"
        "._initialize_local_devices",
    ),
}
# ... and attributes of a compiled model and of a Keras variable they use (set at construction, so checked on one).
MODEL_ATTRIBUTES = ("_loss_tracker", "stateless_call", "compute_metrics")
VARIABLE_ATTRIBUTES = ("_value",)


def install() -> None:
    """Installs the `fit` workarounds every strategy needs; idempotent. The steps are installed per model."""
    from tfdp.keras_patches import fit_fixes
    fit_fixes.apply()
