"""Shared by tests/data/test_dali.py and the worker processes of its multi-worker test: training images that
name themselves (one flat colour each, so a decoded, cropped and resized image still says which file it came
from) and the per-replica batches a strategy's input gives, by the tf path or DALI.

Run as a script (`python tests/support/dali_batches.py DATA_DIR OUT.json [REPLICAS]`, TF_CONFIG set), it is one
worker of a real MultiWorkerMirroredStrategy cluster, of REPLICAS logical CPU replicas (1 if not given): it writes
both decoders' steps of its own share to OUT.json."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np

CLASSES, IMAGES, BROKEN = 4, 46, 13


def colour(i: int) -> tuple[int, int, int]:
    return 16 + 16 * (i % 14), 16 + 16 * (i // 14 % 14), 16 + 16 * (i // 196)


def image_ids(images: np.ndarray) -> list[int]:
    """The id each (cropped, resized) flat-colour image was written with."""
    q = np.round((np.median(images.reshape(len(images), -1, 3), axis=1) - 16) / 16).astype(int)
    return [int(i) for i in q[:, 0] + 14 * q[:, 1] + 196 * q[:, 2]]


def write_id_tree(root) -> None:
    """46 flat-colour JPEGs of 4 classes (image i in class i mod 4) of assorted sizes; image 13 cut short."""
    from PIL import Image
    for split, n in (("train", IMAGES), ("val", 8)):
        for i in range(n):
            folder = root / split / f"c{i % CLASSES}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{i:04d}.jpg"
            Image.fromarray(np.full((24 + i % 5, 30 - i % 3, 3), colour(i), np.uint8)).save(path, quality=95)
            if split == "train" and i == BROKEN:
                path.write_bytes(path.read_bytes()[:200])  # as an interrupted copy leaves it


def replica_batches(runtime, split, cfg, start: tuple[int, int], steps: int, global_batch: int = 8, stream=None):
    """`steps` steps of (ids, labels) per local replica of `runtime` (a `tfdp.distribute.strategy.Runtime`), the
    corrupt count and this worker's stream position after each step. `stream(ctx)`, if given, is the worker's
    dataset instead of its own stream from `start` (whose count and positions are then not kept)."""
    from tfdp.data import dali
    from tfdp.data.pipeline import Bookkeeping, CorruptCounter, StreamPosition, train_dataset
    strategy = runtime.strategy
    local = len(runtime.devices)
    position, corrupt = StreamPosition(), CorruptCounter()

    def worker(ctx):
        if stream is not None:
            return stream(ctx)
        return train_dataset(split, cfg, global_batch, 3, ctx, Bookkeeping(start, position, corrupt, CLASSES))
    ds = (strategy.distribute_datasets_from_function(worker) if cfg.decoder == "tf"
          else dali.distribute(runtime, worker, cfg, global_batch, 3))
    steps_seen, positions = [], []
    iterator = iter(ds)
    for step in range(steps):
        images, labels = (strategy.experimental_local_results(t) for t in next(iterator))
        steps_seen.append([(image_ids(i.numpy()), l.numpy().tolist()) for i, l in zip(images, labels)])
        positions.append(position.after(local * (step + 1)) if stream is None else None)
    del iterator
    return steps_seen, corrupt.value(), positions


def main(data_dir: str, out: str, per_worker: str = "1") -> None:
    """One worker of `per_worker` replicas: both decoders' first 6 steps of this worker's share, and a DALI stream
    resumed at step 2's position."""
    import tfdp  # noqa: F401  (TensorFlow's environment defaults, as tfdp's own processes)
    from tfdp.config import DataConfig, DistributeConfig
    from tfdp.data import build_source
    from tfdp.distribute.strategy import make_runtime
    runtime = make_runtime(DistributeConfig(strategy="multi_worker", cpu_replicas_per_worker=int(per_worker)))
    cfg = DataConfig(format="image_folder", dir=data_dir, image_size=8, shuffle_buffer=16, max_bad_fraction=0.2)
    split = build_source(cfg).split("train")
    found = {}
    for decoder in ("tf", "dali"):
        steps, _, positions = replica_batches(runtime, split, dataclasses.replace(cfg, decoder=decoder), (0, 0), 6)
        found[decoder] = {"steps": steps, "positions": positions}
    dali_cfg = dataclasses.replace(cfg, decoder="dali")
    found["resumed"] = replica_batches(runtime, split, dali_cfg, tuple(found["dali"]["positions"][1]), 3)[0]
    with open(out, "w", encoding="utf-8") as f:
        json.dump(found, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(*sys.argv[1:])
