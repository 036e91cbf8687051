"""Images/s of the demo training with 1 and 2 replicas, side by side in one run.

Each replica count runs `tfdp train` in its own process (the CPU can be split
into logical devices only once per process), for `--epochs` epochs on the
same data and global batch; the rate is the training throughput of the last
epoch (the first includes graph tracing). On a CPU-only host both runs share
the same cores, so the ratio shows the cost of mirroring, not a speed-up; on a
multi-GPU host it shows the scaling.

  python benchmarks/replicas.py [--model=resnet18_small] [--global_batch=64] [--epochs=2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(replicas: int, args: argparse.Namespace, workdir: str) -> dict:
    model_dir = os.path.join(workdir, f"r{replicas}")
    cmd = [sys.executable, "-m", "tfdp", "train", "--config=configs/digits.yaml", f"--model_dir={model_dir}",
           f"--model={args.model}", f"--epochs={args.epochs}", f"--cpu_replicas={replicas}",
           f"--batch_size_per_replica={args.global_batch // replicas}", f"--set=data.image_size={args.image_size}",
           "--set=schedule.warmup_epochs=0"]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        last = [json.loads(line) for line in f][-1]
    return {"replicas": replicas, "images_per_sec": last["images_per_sec"], "seconds": last["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_small")
    parser.add_argument("--image_size", type=int, default=16)
    parser.add_argument("--global_batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        rows = [measure(n, args, workdir) for n in (1, 2)]
    print(f"model {args.model}, {args.image_size} px, global batch {args.global_batch}, epoch {args.epochs} timed")
    print(f"{'replicas':>8} {'images/s':>10} {'s/epoch':>8}")
    for r in rows:
        print(f"{r['replicas']:>8} {r['images_per_sec']:>10.1f} {r['seconds']:>8.1f}")
    print(f"ratio 2 replicas / 1 replica: {rows[1]['images_per_sec'] / rows[0]['images_per_sec']:.2f}x")


if __name__ == "__main__":
    main()
