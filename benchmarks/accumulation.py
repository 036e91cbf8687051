"""The cost and the saving of gradient accumulation: images/s and peak memory at k = 1, 2, 4, equal global batch.

One replica, synthetic on-device data (no input pipeline), `--model` at
`--size` px, global batch `--batch` cut into k micro-batches of batch / k.
Each k runs in a process of its own, so its peaks are its own: TensorFlow's
allocator peak on the training device (`tf.config.experimental.get_memory_info`,
the first GPU, else the CPU: the tensor bytes held at once, which is where the
activations saved show) and the process's peak resident set
(`resource.getrusage`, which also holds TensorFlow, graphs and caches). The
`baseline` row is the same process up to the compiled model, without training.

  python benchmarks/accumulation.py [--model=resnet18_small] [--size=32] [--batch=256] [--ks=1,2,4] [--xla]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def peak_bytes() -> dict:
    """TensorFlow's allocator peak on the device that trains (the first GPU, else the CPU: tensors only), and
    this process's peak resident set (everything: TensorFlow, graphs, Python)."""
    import tensorflow as tf
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    return {"device": device, "allocator": tf.config.experimental.get_memory_info(device)["peak"],
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(args) -> dict:
    """One k, in this process: images/s and peak memory."""
    import tfdp  # noqa: F401
    from tfdp.commands.benchmark import fit_rate
    from tfdp.config import validate
    from tfdp.data.pipeline import synthetic_dataset
    from tfdp.train.task import Plan, compile_model
    k = args.k
    cfg = validate({"model": {"name": args.model, "num_classes": 1000}, "data": {"image_size": args.size},
                    "train": {"jit_compile": args.xla, "batch_size_per_replica": args.batch // max(k, 1),
                              "grad_accum_steps": max(k, 1), "precision": args.precision}})
    if k == 0:  # the baseline: TensorFlow and the model, no step
        compile_model(cfg, Plan(args.batch, 1, 0, 0, 1000))
        return {"k": 0, "rate": 0.0, "peak": peak_bytes()}
    model = compile_model(cfg, Plan(args.batch, args.warmup + args.steps, 0, 0, 1000, accum_steps=k))
    rate, _ = fit_rate(model, synthetic_dataset(cfg.data, 1000, args.batch), args.batch, args.steps, args.warmup)
    return {"k": k, "rate": rate, "peak": peak_bytes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_small")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--xla", action="store_true", help="whole-step XLA (train.jit_compile: true)")
    parser.add_argument("--k", type=int, default=None, help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args()
    if args.k is not None:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    own = [a for a in sys.argv[1:] if not a.startswith("--ks")]
    print(f"{args.model}, {args.size} px, global batch {args.batch}, 1 replica, {args.precision}, "
          f"XLA {'on' if args.xla else 'off'}")
    print(f"{'k':>3} {'micro-batch':>12} {'images/s':>10} {'vs k=1':>8} {'tensors peak MiB':>17} {'RSS peak MiB':>13}")
    base = None
    for k in [0, *map(int, args.ks.split(","))]:
        child = subprocess.run([sys.executable, __file__, *own, f"--k={k}"], capture_output=True, text=True,
                               cwd=REPO)
        line = [x for x in child.stdout.splitlines() if x.startswith("RESULT ")]
        if child.returncode or not line:
            print(f"{k:>3} failed: {child.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(line[0][7:])
        peak = r["peak"]
        mib = f"{peak['allocator'] / 2**20:>17.0f} {peak['rss'] / 2**20:>13.0f}"
        if k == 0:
            print(f"{'baseline':>16} {'':>10} {'':>8} {mib}   (no training; tensors on {peak['device']})")
            continue
        base = base or r["rate"]
        print(f"{k:>3} {args.batch // k:>12} {r['rate']:>10.1f} {r['rate'] / base:>7.2f}x {mib}", flush=True)


if __name__ == "__main__":
    main()
