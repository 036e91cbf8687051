"""Training images/s per model at 224x224 on this machine: float32 vs mixed_bfloat16, XLA off vs on.

Synthetic on-device data, one replica, per-model batch `--batch`; each cell is
the rate over `--steps` steps after `--warmup` untimed ones (tracing, XLA
compilation). All cells are measured in this one run, so the ratios compare
like with like.

  python benchmarks/models.py [--models=resnet18,resnet50,mobilenet_v2,efficientnetv2_b0] [--batch=16]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(name: str, precision: str, jit: bool, args) -> float:
    import keras

    from tfdp.commands.benchmark import fit_rate
    from tfdp.config import validate
    from tfdp.data.pipeline import synthetic_dataset
    from tfdp.train.task import Plan, compile_model
    keras.backend.clear_session()
    cfg = validate({"model": {"name": name, "num_classes": 1000}, "data": {"image_size": 224},
                    "train": {"precision": precision, "jit_compile": jit, "batch_size_per_replica": args.batch}})
    model = compile_model(cfg, Plan(args.batch, args.warmup + args.steps, 0, 0, 1000))
    rate, _ = fit_rate(model, synthetic_dataset(cfg.data, 1000, args.batch), args.batch, args.steps, args.warmup)
    keras.mixed_precision.set_global_policy("float32")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50,mobilenet_v2,efficientnetv2_b0")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    import tfdp  # noqa: F401
    cells = [("float32", False), ("float32", True), ("mixed_bfloat16", False), ("mixed_bfloat16", True)]
    print(f"224 px, batch {args.batch}, 1 replica, images/s (ratio to float32 without XLA)")
    print(f"{'model':<20}" + "".join(f"{p + (' +XLA' if j else ''):>24}" for p, j in cells))
    for name in args.models.split(","):
        rates = [measure(name, p, j, args) for p, j in cells]
        print(f"{name:<20}" + "".join(f"{r:>15.1f} ({r / rates[0]:.2f}x)" for r in rates), flush=True)


if __name__ == "__main__":
    main()
