"""The global batch, and how it is cut on the hardware found: replicas x per-replica batch x accumulation.

A recipe is defined by its global batch (`train.global_batch`); the devices
a run finds decide how it is reached. The rules (docs/global-batch.md):

- `global_batch` 0: the global batch is what the hardware gives,
  batch_size_per_replica x replicas x grad_accum_steps (tfdp's old meaning);
- `global_batch` and `grad_accum_steps` above 1: the accumulation is fixed and
  the per-replica batch derived, global / (replicas x accumulation);
- `global_batch` alone: `batch_size_per_replica` is the largest micro-batch
  that fits, and the accumulation is the fewest micro-batches that keep the
  per-replica batch within it. The same config then reproduces the same
  global batch, and the same learning rate, on 1 GPU or 16.
"""

from __future__ import annotations

import dataclasses

from tfdp.config import TrainConfig
from tfdp.errors import UserError


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """One optimizer step's images: `global_batch` = `replicas` x `per_replica` x `accum_steps`."""
    global_batch: int
    per_replica: int     # images per replica per micro-batch
    replicas: int
    accum_steps: int

    def line(self) -> str:
        """What the trainer prints once about it."""
        return (f"tfdp: batch: global {self.global_batch} = {self.per_replica} per replica x {self.replicas} "
                f"replica(s) x {self.accum_steps} accumulation step(s)")


def batch_layout(train: TrainConfig, replicas: int) -> BatchLayout:
    """The layout `train` asks for on `replicas` replicas; a one-line UserError where it cannot divide."""
    if not train.global_batch:
        return BatchLayout(train.batch_size_per_replica * replicas * train.grad_accum_steps,
                           train.batch_size_per_replica, replicas, train.grad_accum_steps)
    total = train.global_batch
    if total % replicas:
        raise UserError(f"train.global_batch {total} cannot be split evenly over the {replicas} replicas found; "
                        f"use a multiple of {replicas}")
    if train.grad_accum_steps > 1:
        k = train.grad_accum_steps
        if total % (replicas * k):
            raise UserError(f"train.global_batch {total} cannot be split into {replicas} replicas x "
                            f"{k} accumulation steps (train.grad_accum_steps); use a multiple of {replicas * k}")
        return BatchLayout(total, total // (replicas * k), replicas, k)
    per_replica_step = total // replicas
    for k in range(1, per_replica_step + 1):
        if per_replica_step % k == 0 and per_replica_step // k <= train.batch_size_per_replica:
            return BatchLayout(total, per_replica_step // k, replicas, k)
    raise AssertionError("unreachable: k = per_replica_step always fits")  # batch_size_per_replica >= 1
