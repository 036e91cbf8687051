"""State that lives on every replica and must read the same everywhere.

Keras 3 creates batch-norm moving statistics with aggregation NONE, so under
a tf.distribute strategy each replica (and each worker) updates its own copy
from its own share of the batch, and reading them in cross-replica context
(saving, exporting, evaluating, fingerprinting) returns replica 0's. tf.keras
averaged them over replicas on read. tfdp does the same at the points where
they are read, not at every step: `average_non_trained_state` sets every
replica's copy of each float non-trained variable to the mean over all
replicas of all workers, with one batched all-reduce. The trainer calls it
before validation and before every checkpoint, at the same steps in every run,
so an interrupted and resumed run sees exactly the statistics of one that was
never stopped. Integer state (random-number generator counters) is left alone:
it advances identically on every replica and must not be averaged.

Metric accumulators (sync-on-read sums) are read and restored here too, so a
run resumed mid-epoch reports the metrics of the whole epoch.
"""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tfdp.rundir.checkpoints import RANDOM_STREAMS, seed_generator_states


def float_non_trained(model: keras.Model) -> list:
    return [v for v in model.non_trainable_variables if "float" in str(v.dtype)]


def state_averager(model: keras.Model) -> Callable[[], None]:
    """A function that averages the model's float non-trained state over all replicas, in place.

    Every worker must call it at the same point (it is a collective).
    """
    strategy = model.distribute_strategy
    variables = float_non_trained(model)

    tf_variables = [v.value for v in variables]  # the tf.distribute variables behind the Keras ones

    @tf.function
    def average():
        local = strategy.run(lambda: [tf.identity(v) for v in tf_variables])
        means = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, list(zip(local, tf_variables)))
        for variable, mean in zip(tf_variables, means):
            variable.assign(mean)  # cross-replica: every replica's copy

    return average if variables else (lambda: None)


class ReplicaSnapshot:
    """Every replica's own copy of the float non-trained state, gathered from all workers, and put back.

    A mid-epoch checkpoint must not change the run it is taken from: the
    trainer averages the replicas' statistics for the saved weights (what
    evaluation and export read), then puts each replica's own values back,
    and stores them beside the weights, so a run resumed there continues
    with exactly the per-replica state of one never stopped, wherever and
    however often it was checkpointed. The state is small (about 50,000
    floats a replica for ResNet-50); gathering it is one all-reduce.
    """

    def __init__(self, model: keras.Model):
        strategy = model.distribute_strategy
        variables = [v.value for v in float_non_trained(model)]
        sizes = [int(np.prod(v.shape)) for v in variables]
        replicas = strategy.num_replicas_in_sync
        self.width = sum(sizes)

        def own_row():
            context = tf.distribute.get_replica_context()
            flat = tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in variables], axis=0)
            return tf.scatter_nd([[context.replica_id_in_sync_group]], [flat], [replicas, self.width])

        @tf.function
        def gather():
            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(own_row), axis=None)

        @tf.function
        def put_back(rows):
            def on_replica(rows):
                row = rows[tf.distribute.get_replica_context().replica_id_in_sync_group]
                for v, part in zip(variables, tf.split(row, sizes)):
                    v.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))
            strategy.run(on_replica, args=(rows,))

        self._gather, self._put_back, self.replicas = gather, put_back, replicas

    def take(self) -> np.ndarray:
        """[replicas, floats]: each replica's state (a collective: all workers call it)."""
        return self._gather().numpy() if self.width else np.zeros([self.replicas, 0], np.float32)

    def put_back(self, rows: np.ndarray) -> None:
        if self.width:
            self._put_back(tf.constant(rows, tf.float32))


def replica_copies(variable) -> list[np.ndarray]:
    """This process's per-replica values of a (Keras) variable: one per local replica."""
    value = variable.value
    copies = getattr(value, "values", None) or (value,)
    return [c.numpy() for c in copies]


def metric_totals(model: keras.Model) -> dict[str, list[float]]:
    """Each metric's accumulators summed over all replicas (a collective under multi-worker)."""
    return {m.name: [float(np.sum(keras.ops.convert_to_numpy(v))) for v in m.variables] for m in model.metrics}


def restore_metric_totals(model: keras.Model, totals: dict[str, list[float]]) -> None:
    """Sets the metrics' accumulators so that their sum over all replicas equals `totals`.

    Each replica gets an equal share: sync-on-read sums add the replicas' copies on read.
    """
    strategy = model.distribute_strategy
    pairs = [(v, value) for m in model.metrics for v, value in zip(m.variables, totals.get(m.name, ()))]
    if not pairs:
        return
    values = tf.constant([value / strategy.num_replicas_in_sync for _, value in pairs], tf.float64)

    def on_replica():
        for (variable, _), value in zip(pairs, tf.unstack(values)):
            variable.assign(tf.cast(value, variable.dtype))
    strategy.run(tf.function(on_replica))


class WorkerGather:
    """Every worker's few integers, indexed by worker: one SUM all-reduce in which each worker fills its
    own row from its first local replica. A collective: all workers call it at the same point."""

    def __init__(self, strategy: tf.distribute.Strategy, worker: int, workers: int):
        self.strategy, self.worker, self.workers = strategy, worker, workers
        local_replicas = strategy.num_replicas_in_sync // workers

        def on_replica(rows):
            first_local = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group % local_replicas, 0)
            return tf.where(first_local, rows, tf.zeros_like(rows))

        @tf.function(reduce_retracing=True)
        def gather(rows):
            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(on_replica, args=(rows,)), axis=None)
        self._gather = gather

    def __call__(self, local: list[int]) -> list[list[int]]:
        rows = np.zeros([self.workers, len(local)], np.int64)
        rows[self.worker] = local
        return self._gather(tf.constant(rows)).numpy().tolist()


def start_random_streams(model: keras.Model, checkpoint: dict | None) -> str:
    """Puts the model's random layers where the run's streams stand: a fresh run's at their seeds, a resumed
    one's where the checkpoint left them, every replica's its own (`decorrelate_random_streams`).

    Keras' weights file leaves the seed generators out, so a checkpoint records
    replica 0's [seed, counter] of each (`tfdp.rundir.checkpoints`); every
    replica gets it back and then its offset, which is exactly the state of a
    run never stopped, on every replica of every worker: the offsets are fixed
    and the counters advance alike on every replica. Returns the line a resume
    prints where the checkpoint cannot say where the streams stood ('' otherwise).
    """
    generators = seed_generator_states(model)
    saved = checkpoint.get(RANDOM_STREAMS) if checkpoint else None
    line = ""
    if checkpoint and generators:
        if isinstance(saved, list) and [np.shape(s) for s in saved] == [tuple(v.shape) for v in generators]:
            for variable, state in zip(generators, saved):
                variable.value.assign(tf.constant(state, variable.value.dtype))  # cross-replica: every copy
        else:
            held = "no state of the random layers" if not isinstance(saved, list) else \
                f"the state of {len(saved)} random generators, the model has {len(generators)}"
            line = (f"tfdp: the checkpoint holds {held}: the random streams of flip, dropout and drop path "
                    f"restart, so this resume is not bit-identical to a run never stopped")
    decorrelate_random_streams(model)
    return line


def decorrelate_random_streams(model: keras.Model) -> int:
    """Gives every replica its own random stream for the model's random layers (flip, dropout, drop path).

    Keras seeds each random layer's generator once, so under a strategy every
    replica starts from the same state and the i-th image of every replica's
    batch is flipped (or dropped) alike. Here replica r's seed becomes
    seed + r * 7919, all workers counting replicas globally. It must run when
    all replicas hold the same state (after building, or after
    `start_random_streams` restored a checkpoint's). Returns how many
    generators it moved.
    """
    strategy = model.distribute_strategy
    states = [v.value for v in seed_generator_states(model)]
    if not states or strategy.num_replicas_in_sync == 1:
        return 0

    @tf.function
    def offset():
        def on_replica():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            for state in states:
                step = tf.cast(tf.stack([replica * 7919, 0]), state.dtype)
                state.assign(state + step)   # aggregation NONE: this replica's own copy
        strategy.run(on_replica)

    offset()
    return len(states)
