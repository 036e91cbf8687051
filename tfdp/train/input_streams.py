"""Resuming a run on a different cluster: the global batch held, the input stream continued exactly.

A run's training input is a fixed number of *input streams*: as many as the
workers it started on, stream s reading file share s (files s, s + S, ...)
in its own seeded order, each giving global_batch / S examples per step.
The number of streams and each one's position are in every checkpoint, so a
run resumed on W' workers reads the same S streams, S / W' on each worker,
and every global batch holds the examples it would have held on the old
layout: none skipped, none repeated, in this epoch and every later one.
The replicas and the accumulation may change freely (the per-replica and
micro-batch cut of a worker's share of the step is the trainer's business);
the global batch may not: the checkpoint records it, and the resumed run
keeps it (`tfdp.train.global_batch.resumed_layout`, decided in the run's Plan).

Where this is impossible one line says what happens instead: S streams
cannot be dealt evenly to W' workers (more workers than streams, or not a
divisor), or the tf.data service reads the input (the service decides which
of its workers reads which file).
"""

from __future__ import annotations

import dataclasses
import os

from tfdp.train.global_batch import BatchLayout
from tfdp.errors import UserError


@dataclasses.dataclass(frozen=True)
class Streams:
    """The run's input streams and this worker's share of them."""
    count: int                              # S, fixed for the run's life once a checkpoint holds it
    mine: tuple[int, ...]                   # the streams this worker reads, in order
    starts: tuple[tuple[int, int], ...]     # (records consumed, corrupt so far) of each of them

    @property
    def single(self) -> bool:
        """One stream per worker: the layout the run started on (the plain pipeline)."""
        return len(self.mine) == 1


def run_facts(layout: BatchLayout, workers: int, streams: int) -> dict:
    """What a checkpoint records about the batch and the layout that wrote it."""
    return {"global_batch": layout.global_batch, "streams": streams,
            "layout": {"workers": workers, "replicas": layout.replicas, "per_replica": layout.per_replica,
                       "accum_steps": layout.accum_steps}}


def check_global_batch(state: dict | None, layout: BatchLayout) -> None:
    """The restored checkpoint must hold the global batch the run was sized by, the newest checkpoint's
    (`tfdp.train.global_batch.resumed_layout`): its schedule, learning rate and steps per epoch are counted in it. They
    differ only where the restore went back past a damaged checkpoint to one of another run in the same
    model_dir; a one-line UserError says so."""
    if not state or not state.get("global_batch") or state["global_batch"] == layout.global_batch:
        return
    raise UserError(f"the checkpoint {os.path.basename(state['path'])} was trained at global batch "
                    f"{state['global_batch']}, not the {layout.global_batch} of the newer checkpoint this run was "
                    f"sized by: its checkpoints are of two runs; use a new model_dir")


def plan_streams(state: dict | None, workers: int, worker: int, steps_done: int, global_batch: int,
                 service: bool) -> tuple[Streams, str]:
    """The streams this worker reads from the checkpoint's `state` (None: a fresh run), and the line to
    print about a layout change ('' when there is none)."""
    positions = [tuple(p) for p in state.get("input") or []] if state else []
    if not state or len(positions) == workers:
        start = positions[worker] if positions else (0, 0)
        return Streams(workers, (worker,), (start,)), ""
    streams = len(positions)
    if positions and not service and streams % workers == 0:
        m = streams // workers
        mine = tuple(range(worker * m, (worker + 1) * m))
        return Streams(streams, mine, tuple(positions[s] for s in mine)), (
            f"tfdp: resume: the checkpoint's {streams} input streams go on exactly on {workers} worker(s), "
            f"{m} each: every global batch holds the examples of the original layout")
    why = ("the tf.data service reads the input (it decides which worker reads which file)" if service else
           f"its {streams or 'unknown number of'} input stream(s) cannot be dealt evenly to {workers} worker(s)")
    start = (steps_done * (global_batch // workers), 0)
    return Streams(workers, (worker,), (start,)), (
        f"tfdp: resume: the input cannot continue exactly ({why}): each worker restarts its own share at the "
        f"same number of records per worker, so some examples of this epoch may repeat or be skipped")
