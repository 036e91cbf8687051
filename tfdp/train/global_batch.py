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

A resumed run keeps its checkpoint's global batch (`resumed_layout`): its
schedule, steps per epoch and stream position are counted in it, so a job
requeued on other hardware goes on exactly where it stopped. Only an explicit
`train.global_batch` of another size is refused; the checkpoint's batch is
cut on the replicas found as an explicit `global_batch` would be.
"""

from __future__ import annotations

import dataclasses
import os

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

    def cut(self) -> str:
        """'2 replicas x 32 x 1 micro-batch': how the global batch is cut, in a resume line."""
        return (f"{self.replicas} replica{'s' * (self.replicas != 1)} x {self.per_replica} x {self.accum_steps} "
                f"micro-batch{'es' * (self.accum_steps != 1)}")


@dataclasses.dataclass(frozen=True)
class CheckpointBatch:
    """What a checkpoint's state.json records about the batch that trained it (`tfdp.train.input_streams.run_facts`)."""
    name: str                       # the checkpoint's folder, as error lines name it
    global_batch: int
    layout: BatchLayout | None      # None where the checkpoint does not record it

    @classmethod
    def of(cls, state: dict | None) -> "CheckpointBatch | None":
        """The batch facts of a checkpoint's state (None: a fresh run, or a checkpoint that predates them)."""
        if not state or not state.get("global_batch"):
            return None
        was = state.get("layout") or {}
        layout = (BatchLayout(state["global_batch"], was["per_replica"], was["replicas"], was["accum_steps"])
                  if {"per_replica", "replicas", "accum_steps"} <= was.keys() else None)
        return cls(os.path.basename(state.get("path", "")) or "found", state["global_batch"], layout)

    def described(self) -> str:
        """'global batch 64 (32 per replica x 2 replica(s) x 1 accumulation step(s))'."""
        was = self.layout
        return f"global batch {self.global_batch}" + (
            f" ({was.per_replica} per replica x {was.replicas} replica(s) x {was.accum_steps} accumulation step(s))"
            if was else "")


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


def resumed_layout(train: TrainConfig, replicas: int, checkpoint: CheckpointBatch | None) -> tuple[BatchLayout, str]:
    """The layout of a run that resumes `checkpoint` on `replicas` replicas, and the line saying how its global
    batch is now cut ('' where the cut is the checkpoint's, or for a fresh run).

    The global batch is the checkpoint's: the learning-rate schedule, steps per
    epoch and the input streams' positions are counted in it, so keeping it is
    what makes the resume exact on any hardware. Only a `train.global_batch`
    set to another size contradicts it, and is refused. Where the config leaves
    the global batch to the hardware (0), the checkpoint's is cut as an
    explicit `train.global_batch` would be: `batch_size_per_replica` stays the
    largest micro-batch (what fits in memory) and the accumulation makes up
    for fewer replicas.
    """
    if checkpoint is None:
        return batch_layout(train, replicas), ""
    total = checkpoint.global_batch
    if train.global_batch and train.global_batch != total:
        raise UserError(f"the checkpoint {checkpoint.name} was trained at {checkpoint.described()}, but "
                        f"train.global_batch is {train.global_batch}; resume it with train.global_batch={total} or 0 "
                        f"(the checkpoint's), or use a new model_dir to train at {train.global_batch}")
    if not train.global_batch:
        own = batch_layout(train, replicas)
        if own.global_batch == total:
            return own, _resume_line(own, checkpoint, adopted=False)
    if total % replicas:
        fits = [n for n in range(1, total + 1) if total % n == 0][:8]
        raise UserError(f"the checkpoint {checkpoint.name} was trained at global batch {total}, which the "
                        f"{replicas} replicas found cannot split evenly; resume it on a number of replicas that "
                        f"divides {total} ({', '.join(map(str, fits))}{', ...' if fits[-1] < total else ''}), "
                        f"or use a new model_dir for another global batch")
    adopted = not train.global_batch
    layout = batch_layout(dataclasses.replace(train, global_batch=total, grad_accum_steps=1) if adopted else train,
                          replicas)
    return layout, _resume_line(layout, checkpoint, adopted)


def _resume_line(layout: BatchLayout, checkpoint: CheckpointBatch, adopted: bool) -> str:
    """The one line of a resume whose global batch is cut differently from the checkpoint's, or is the
    checkpoint's rather than the config's (`adopted`); '' for neither."""
    was = checkpoint.layout
    same = was is None or (was.replicas, was.per_replica, was.accum_steps) == \
        (layout.replicas, layout.per_replica, layout.accum_steps)
    if same and not adopted:
        return ""
    return (f"tfdp: resuming at the checkpoint's global batch {layout.global_batch}: {layout.cut()}"
            + (f" (the checkpoint's: {was.cut()})" if not same else ""))
