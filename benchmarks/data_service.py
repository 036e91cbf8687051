"""Training input through the tf.data service: what it takes off the trainer's CPU, and how it scales.

Writes ImageNet-sized JPEGs (about 500x375, cut from the real photos in the
scikit-image/scikit-learn wheels), starts a real dispatcher and service
workers (`python -m tfdp data-service ...` processes on loopback), and in this
process, which plays the trainer, reads --batches training batches:

  local pipeline       `tfdp.data.pipeline.train_dataset`: read, decode, crop here
  service, N workers   `tfdp.data.service.client.train_dataset` (distributed_epoch):
                       the same pipeline on the service's N workers; this
                       process only receives batches and counts them
  constant batch       one batch of the same size streamed by the service:
                       the trainer's cost of receiving the bytes, nothing else
  ..., for DALI        `data.decoder: dali`'s stream, locally and through the
                       service: each image read and checked, not decoded; the
                       batches of encoded images made into the arrays DALI
                       takes (`pad_batch`). What the trainer's CPU pays before
                       DALI, which decodes after either alike (on a GPU, or on
                       the CPU), so DALI itself is not run

For each it reports images/s and CPU seconds per 1,000 images: the trainer's
own (`time.process_time` of this process, every thread) and the service
workers' (their utime + stime from /proc). No model runs: the trainer's CPU
is only what its input costs it. The CPU is shared: on a machine with few
cores, more service workers compete with each other and with the trainer
for the same cores, so images/s of 1 vs 2 workers shows scaling only where
there are cores to spare (it is printed beside the core count).

  python benchmarks/data_service.py [--images=512] [--size=224] [--batch=64] [--batches=40] [--rounds=2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))   # support.photos

import tfdp  # noqa: E402,F401  (TensorFlow environment defaults)


def start(role: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """A `tfdp data-service` process and the line it prints once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "tfdp", "data-service", role, *flags], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line.startswith("tfdp: data-service:"):
        raise RuntimeError(f"{role} did not start: {line!r}")
    return proc, line


def cpu_seconds(pid: int) -> float:
    """utime + stime of a running process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(make, batch: int, batches: int, workers: list[subprocess.Popen]) -> dict[str, float]:
    """images/s, and CPU ms per image in this process and in `workers`, over `batches` batches after warm-up."""
    iterator = iter(make())
    for _ in range(4):
        next(iterator)
    wall, own, theirs = time.perf_counter(), time.process_time(), sum(cpu_seconds(p.pid) for p in workers)
    for _ in range(batches):
        next(iterator)
    images = batch * batches
    return {"images_per_sec": images / (time.perf_counter() - wall),
            "trainer_ms": 1000 * (time.process_time() - own) / images,
            "service_ms": 1000 * (sum(cpu_seconds(p.pid) for p in workers) - theirs) / images}


def constant(address: str, args):
    """One batch of the same shape and dtype, streamed uncompressed: what receiving the bytes alone costs."""
    import tensorflow as tf
    batch = (tf.zeros([args.batch, args.size, args.size, 3], tf.uint8), tf.zeros([args.batch], tf.int32))
    return tf.data.Dataset.from_tensors(batch).repeat().apply(tf.data.experimental.service.distribute(
        processing_mode="parallel_epochs", service=address, job_name=f"constant-{uuid.uuid4().hex}",
        compression=None))


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    """Highest images/s, lowest CPU: a noisy neighbour only ever makes a round worse."""
    return {"images_per_sec": max(r["images_per_sec"] for r in runs),
            "trainer_ms": min(r["trainer_ms"] for r in runs), "service_ms": min(r["service_ms"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=40, help="timed batches per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from support.photos import SYNSETS, write_imagenet_tree
    from tfdp.config import DataConfig
    from tfdp.data import build_source
    from tfdp.data.dali import padded
    from tfdp.data.service import client as service
    from tfdp.data.pipeline import Bookkeeping, CorruptCounter, train_dataset

    with tempfile.TemporaryDirectory() as workdir:
        tree = os.path.join(workdir, "tree")
        write_imagenet_tree(tree, len(SYNSETS), max(args.images // len(SYNSETS), 1), 1, "ilsvrc")
        dispatcher, line = start("dispatcher", "--port=0", f"--work_dir={workdir}/journal")
        port = re.search(r":(\d+) \(", line).group(1)
        address = f"grpc://127.0.0.1:{port}"
        workers = [start("worker", "--port=0", f"--dispatcher_address={address[7:]}")[0]]
        try:
            cfg = DataConfig(format="imagenet", dir=tree, image_size=args.size, shuffle_buffer=1024,
                             service_address=address)
            split = build_source(cfg).split("train")
            def books():
                return Bookkeeping(corrupt=CorruptCounter(), num_classes=len(SYNSETS))

            def local(data=cfg):
                return train_dataset(split, data, args.batch, seed=0, books=books())

            def served(data=cfg):   # a job of its own each time: a new iterator of a named job would join the old one
                return service.train_dataset(split, data, args.batch, seed=0, books=books(),
                                             job_name=f"bench-{uuid.uuid4().hex}")
            results = {}
            results["local pipeline"] = best([measure(local, args.batch, args.batches, []) for _ in range(args.rounds)])
            results["service, 1 worker"] = best([measure(served, args.batch, args.batches, workers)
                                                 for _ in range(args.rounds)])
            workers.append(start("worker", "--port=0", f"--dispatcher_address={address[7:]}")[0])
            time.sleep(3)   # its first heartbeat: registered before the next job is made
            results["service, 2 workers"] = best([measure(served, args.batch, args.batches, workers)
                                                  for _ in range(args.rounds)])
            results["service, 2, constant batch"] = best([measure(lambda: constant(address, args), args.batch,
                                                                  args.batches, workers) for _ in range(args.rounds)])
            packed = dataclasses.replace(cfg, service_compression="auto")
            results["service, 2, compressed"] = best([measure(lambda: served(packed), args.batch, args.batches,
                                                              workers) for _ in range(args.rounds)])
            checked = dataclasses.replace(cfg, decoder="dali")   # the checked bytes, as pad_batch arrays
            results["local, for DALI"] = best([measure(lambda: padded(local(checked)), args.batch, args.batches, [])
                                               for _ in range(args.rounds)])
            results["service, 2, for DALI"] = best([measure(lambda: padded(served(checked)), args.batch,
                                                            args.batches, workers) for _ in range(args.rounds)])
        finally:
            for proc in [*workers, dispatcher]:
                proc.terminate()
                proc.wait()
    report(results, len(split.files), args)


def report(results: dict[str, dict[str, float]], images: int, args) -> None:
    print(f"{images} JPEGs (ImageNet-sized); {args.size}x{args.size} crops, batch {args.batch}, {args.batches} timed "
          f"batches, best of {args.rounds} rounds; {os.cpu_count()} CPU cores shared by the trainer and the service")
    print(f"{'input':22s} {'images/s':>9s} {'trainer CPU ms/img':>19s} {'service CPU ms/img':>19s}")
    for name, r in results.items():
        print(f"{name:22s} {r['images_per_sec']:9.0f} {r['trainer_ms']:19.2f} {r['service_ms']:19.2f}")
    local, one = results["local pipeline"]["trainer_ms"], results["service, 1 worker"]["trainer_ms"]
    scaling = results["service, 2 workers"]["images_per_sec"] / results["service, 1 worker"]["images_per_sec"]
    packed = results["service, 2, compressed"]["trainer_ms"]
    print(f"trainer CPU per image through the service: {one / local:.2f}x the local pipeline's "
          f"({packed / local:.2f}x with data.service_compression: auto); "
          f"2 service workers deliver {scaling:.2f}x the images/s of 1")
    for_dali = results["service, 2, for DALI"]["trainer_ms"] / results["local, for DALI"]["trainer_ms"]
    print(f"data.decoder dali: the trainer's CPU per image before DALI through the service: {for_dali:.2f}x its "
          f"local stream's")


if __name__ == "__main__":
    main()
