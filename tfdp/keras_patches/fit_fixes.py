"""Workarounds for Keras 3 `fit()` under MultiWorkerMirroredStrategy (keras-team/keras#20585).

Two upstream bugs, both in `keras/src/backend/tensorflow/trainer.py`:

1. `_maybe_symbolic_build` takes the first distributed batch and reduces it
   with `strategy.reduce("MEAN", batch)` only to learn its shapes. Under
   MultiWorkerMirroredStrategy that is an eager cross-worker collective over
   the input images, run outside any step. Under MirroredStrategy it fails
   too whenever the replicas' first batches differ in size (a validation
   split smaller than one global batch: "Inputs to operation AddN must have
   the same size"). Fix: take the shapes from the distributed dataset's
   element spec (the first local replica's), which is all the build needs.
   No batch is read: upstream starts an iterator for that one batch and
   drops it (`epoch_iterator.reset()`), so every `fit` and every validation
   pass started its input pipeline twice (at ImageNet scale, a second
   start-up of the pipeline and a batch decoded for nothing).
2. `reduce_per_replica(..., "mean")` calls `strategy.reduce("MEAN", v, axis=0)`
   on scalar metric values, which fails ("axis 0 out of range" for a scalar).
   Fix: reduce across replicas with `axis=None`, the mean over all workers.

The reduction fix only changes the multi-worker path; the build fix applies
to every strategy, since reading one replica's batch is what the build needs. `tests/keras_patches/test_compat.py` fails as soon as
upstream's code no longer has the patched shape, so the workaround is
re-checked on every Keras upgrade.
"""

from __future__ import annotations

from keras.src.backend.tensorflow import trainer as tf_trainer
from tensorflow.python.distribute.values import PerReplicaSpec
from keras.src import tree

_upstream_reduce_per_replica = tf_trainer.reduce_per_replica
_upstream_maybe_symbolic_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build


def _is_multi_worker(strategy) -> bool:
    return tf_trainer._collective_all_reduce_multi_worker(strategy)


def reduce_per_replica(values, strategy, reduction):
    if reduction in ("auto", "mean") and _is_multi_worker(strategy):
        def mean(v):
            return strategy.reduce("MEAN", v, axis=None) if tf_trainer._is_per_replica_instance(v) else v
        return tree.map_structure(mean, values)
    return _upstream_reduce_per_replica(values, strategy, reduction)


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    if iterator is None or self._distribute_strategy is None:
        return _upstream_maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)
    specs = tree.map_structure(_one_replica, iterator._distributed_dataset.element_spec)   # a TFEpochIterator's
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=specs)


def _one_replica(spec):
    """A per-replica spec's first replica (every replica's element has the same shapes); others as they are."""
    return spec._value_specs[0] if isinstance(spec, PerReplicaSpec) else spec


def apply() -> None:
    """Installs both workarounds; idempotent."""
    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
