"""Preemption notices: SIGTERM → every worker saves at the same step and exits 143 (128 + SIGTERM).

Kubernetes, `docker stop`, Slurm (`--signal`) and spot-VM preemption send
SIGTERM some seconds before the kill. A notice may reach only one worker, but
a multi-worker save is a collective that all workers must enter at the same
step. So the handler only sets a flag, and after every training step the
workers agree on it with one all-reduce (SUM) of a 0/1 flag: from that step on
all of them know, save there, and stop.

TensorFlow's `tf.distribute.experimental.PreemptionCheckpointHandler` does the
same agreement through the coordination service, but it saves through a
`tf.train.Checkpoint` of its own, while tfdp's checkpoints are Keras weight
files plus the input position and partial-epoch metrics; it also only works
under MultiWorkerMirroredStrategy. One scalar all-reduce per step is the whole
cost here (measured in benchmarks/checkpoint_cost.py) and the same code serves
one device, mirrored replicas and multi-worker alike.
"""

from __future__ import annotations

import signal

import tensorflow as tf


class PreemptionWatch:
    """Catches SIGTERM and tells, at a step boundary, whether any worker has received one."""

    def __init__(self, strategy: tf.distribute.Strategy, workers: int = 1):
        self.strategy = strategy
        self.workers = workers
        self.noticed = False
        self._previous = None

        @tf.function
        def any_worker(flag):
            per_replica = strategy.run(lambda: tf.identity(flag))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        self._any_worker = any_worker

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum, frame) -> None:
        self.noticed = True

    def agreed(self) -> bool:
        """True on every worker once any of them has been told to stop (a collective: call on all).

        One process needs no agreement: its own flag is the answer, at no cost per step.
        """
        if self.workers == 1:
            return self.noticed
        return float(self._any_worker(tf.constant(float(self.noticed))).numpy()) > 0
