"""The one place that chooses and builds the tf.distribute strategy.

Everything else receives a `Runtime` and uses `runtime.strategy` through the
generic Strategy API (`scope`, `distribute_datasets_from_function`), plus the
replica/worker counts it reports; nothing outside this module asks which
strategy it is.

On a host without GPUs, `cpu_replicas=N` splits the CPU into N logical devices
before TensorFlow initialises them, so MirroredStrategy really runs N replicas
(with their own variables and an all-reduce) on a laptop or CI machine;
`cpu_replicas_per_worker=N` does the same for each worker of a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable

import tensorflow as tf
from absl import logging

from tfdp.distribute import cluster as cluster_lib
from tfdp.distribute import watchdog
from tfdp.config import DistributeConfig
from tfdp.errors import UserError
from tfdp.startup.console import say

COMMUNICATION = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A built strategy and the facts about it the rest of tfdp needs."""
    strategy: tf.distribute.Strategy
    kind: str
    devices: tuple[str, ...]
    num_workers: int = 1
    worker_index: int = 0
    workers_on_host: int = 1   # this worker and the others sharing its machine (and its memory)

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    def datasets_per_replica(self, dataset_fn: Callable, options: tf.distribute.InputOptions):
        """The distributed dataset of `dataset_fn(input_context)` called once per local replica, each dataset
        iterated where `options` place it (InputReplicationMode.PER_REPLICA), as a decoder per device needs
        (`tfdp.data.dali`), on every strategy."""
        return _dataset_per_device(self, dataset_fn, options)

    @property
    def is_chief(self) -> bool:
        """The one process that writes checkpoints, logs and the final model."""
        return self.worker_index == 0


def split_cpu(n: int) -> list[str]:
    """Splits the (first) CPU into `n` logical devices; must run before TF picks its devices."""
    _configure_logical_cpus(n)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def _configure_logical_cpus(n: int) -> None:
    """`split_cpu` without listing the devices, which would initialise TensorFlow's context:
    MultiWorkerMirroredStrategy configures its collectives before that."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise UserError(f"cannot split the CPU into {n} devices: TensorFlow already "
                            f"initialised {have}; set distribute.cpu_replicas (or cpu_replicas_per_worker) "
                            f"before any TF work") from None


def _local_devices(cfg: DistributeConfig) -> list[str]:
    """All local GPUs, else `cpu_replicas` logical CPUs (or the one CPU)."""
    if tf.config.list_physical_devices("GPU"):  # physical: listing logical devices would initialise them
        if cfg.cpu_replicas:
            logging.warning("GPUs found; ignoring distribute.cpu_replicas=%d", cfg.cpu_replicas)
        return [d.name for d in tf.config.list_logical_devices("GPU")]
    if cfg.cpu_replicas > 1:
        return split_cpu(cfg.cpu_replicas)
    return ["/device:CPU:0"]


def _one_device(cfg: DistributeConfig) -> Runtime:
    device = _local_devices(cfg)[0]
    return Runtime(tf.distribute.OneDeviceStrategy(device), "one_device", (device,))


def _mirrored(cfg: DistributeConfig) -> Runtime:
    devices = _local_devices(cfg)
    # GPUs keep TensorFlow's default (NCCL), one rank per card. Logical CPU devices share one memory,
    # so a plain reduce-and-broadcast is enough, and it avoids collective ops, whose instance keys
    # restart with every new strategy and clash when a process builds more than one (tests, notebooks).
    # Logical GPUs split from one card (testing multi-replica code on one GPU) share its memory too,
    # and NCCL refuses two ranks on one card.
    shared = "CPU" in devices[0].upper() or len(devices) > len(tf.config.list_physical_devices("GPU"))
    cross_device = tf.distribute.ReductionToOneDevice() if shared else None
    return Runtime(tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device), "mirrored", tuple(devices))


def _multi_worker(cfg: DistributeConfig) -> Runtime:
    """MultiWorkerMirroredStrategy over the cluster in TF_CONFIG (or Slurm).

    Each worker mirrors over its local GPUs; on a CPU-only host each worker is
    one replica (TensorFlow's collective strategy uses one CPU device), or
    `cpu_replicas_per_worker` logical CPUs.
    """
    cluster = cluster_lib.from_environment()
    cluster_lib.check_port_free(cluster)
    # What TensorFlow reads: the training members only, under its names (a TFJob's `master` is its `chief`;
    # an evaluator joins no collective), and for Slurm-derived clusters too.
    os.environ["TF_CONFIG"] = cluster_lib.training_tf_config(cluster)
    # distribute.cpu_replicas splits a host for `mirrored` only (a worker's is `cpu_replicas_per_worker`); the
    # strategy line says what ran, so a config shared with one-host runs (configs/digits.yaml) needs no warning.
    options = tf.distribute.experimental.CommunicationOptions(implementation=COMMUNICATION[cfg.communication])
    with watchdog.deadline(cfg.startup_timeout), _worker_cpus(cfg.cpu_replicas_per_worker):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        # The first collective blocks until every worker has joined. In a tf.function, as the
        # training steps run: strategy.run called eagerly is a slow path TensorFlow warns about.
        tf.function(lambda: strategy.reduce("SUM", strategy.run(lambda: tf.constant(1)), axis=None))()
    devices = tuple(strategy.extended.worker_devices)
    return Runtime(strategy, "multi_worker", devices, num_workers=cluster.num_workers, worker_index=cluster.rank,
                   workers_on_host=cluster.members_on_host)


@contextlib.contextmanager
def _worker_cpus(n: int):
    """While MultiWorkerMirroredStrategy is built, has it mirror each worker over `n` logical CPUs where the host
    has no GPU.

    TensorFlow gives a CPU worker one device (`_initialize_local_devices`
    counts GPUs, else 1), so a CPU cluster could not show what a cluster of
    multi-GPU hosts does: several replicas per worker, each worker's input
    dealt among them, the all-reduce within a host and across hosts. With the
    CPU split first, the same strategy mirrors over the logical CPUs as it
    would over the GPUs; nothing else of TensorFlow's is changed. A canary in
    tests/keras_patches/test_compat.py says when TensorFlow's count changes.
    """
    if n == 1 or tf.config.list_physical_devices("GPU"):
        if n > 1:
            logging.warning("GPUs found; ignoring distribute.cpu_replicas_per_worker=%d", n)
        yield
        return
    _configure_logical_cpus(n)
    from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceExtended
    tensorflow_own = CollectiveAllReduceExtended._initialize_local_devices

    def logical_cpus(extended, cluster_resolver, worker_device):
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(n)), "CPU"
    CollectiveAllReduceExtended._initialize_local_devices = logical_cpus
    try:
        yield
    finally:
        CollectiveAllReduceExtended._initialize_local_devices = tensorflow_own


def _dataset_per_device(runtime: Runtime, dataset_fn: Callable, options):
    """A dataset per local replica, on every strategy, built as MirroredStrategy builds them for
    InputReplicationMode.PER_REPLICA, from the same parts of TensorFlow's input library.

    MultiWorkerMirroredStrategy and OneDeviceStrategy refuse PER_REPLICA and
    make one dataset per worker, whose elements their `MultiDeviceIterator`
    hands to the replicas from a background thread. Over a DALI dataset that
    thread outlives the DALI iterator it reads: the process crashed when the
    iterator was deleted in 2 to 3 of 6 runs (2026-11-28, docs/data.md, DALI).
    MirroredStrategy's PER_REPLICA path has no such thread (each replica's
    dataset is iterated on its own device), but it keeps its per-replica input
    devices as the strategy's own: every later `distribute_datasets_from_function`
    of that strategy, a `tf` path's included, then calls its function once per
    replica instead of once per worker (TensorFlow 2.21,
    `MirroredExtended._input_workers_with_options`). So tfdp builds the
    datasets itself on every strategy, changing none. Each replica's input
    context numbers it among the cluster's replicas. The DALI tests of
    tests/data/test_dali.py keep this honest on each TensorFlow, and
    tests/keras_patches/test_compat.py says when TensorFlow changes either.
    """
    from tensorflow.python.distribute import device_util, input_lib, input_util
    devices, replicas = list(runtime.devices), runtime.num_replicas
    placed = options.experimental_place_dataset_on_device
    workers = input_lib.InputWorkers(tuple(
        (device_util.canonicalize(d if placed else device_util.get_host_for_device(d)), (d,)) for d in devices))
    contexts = [tf.distribute.InputContext(num_input_pipelines=replicas, input_pipeline_id=runtime.worker_index *
                                           len(devices) + i, num_replicas_in_sync=replicas)
                for i in range(len(devices))]
    return input_util.get_distributed_datasets_from_function(dataset_fn, workers, contexts, runtime.strategy, options)


STRATEGIES: dict[str, Callable[[DistributeConfig], Runtime]] = {
    "one_device": _one_device,
    "mirrored": _mirrored,
    "multi_worker": _multi_worker,
}


def local_replicas(n: int) -> DistributeConfig:
    """A mirrored config with exactly n local replicas: the first n GPUs, or n logical CPUs."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if n > len(gpus):
            raise UserError(f"asked for {n} replicas but this host has {len(gpus)} GPU(s)")
        tf.config.set_visible_devices(gpus[:n], "GPU")
    return DistributeConfig(strategy="mirrored", cpu_replicas=n)


def make_runtime(cfg: DistributeConfig) -> Runtime:
    """Builds the configured strategy, then installs the Keras fixes every strategy's fit needs (tfdp/keras_patches).

    They are installed here, once the devices exist (importing Keras earlier
    would initialise TensorFlow's devices before the CPU could be split), and
    not as a side effect of compiling a model.
    """
    runtime = STRATEGIES[cfg.strategy](cfg)
    from tfdp import keras_patches
    keras_patches.install()
    say(f"tfdp: strategy {runtime.kind}: {runtime.num_replicas} replica(s) on {', '.join(runtime.devices)}, "
        f"{runtime.num_workers} worker(s)")
    return runtime
