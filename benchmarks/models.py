"""Training images/s per model on this machine: float32 vs mixed_bfloat16 and XLA off vs on, or (`--vs_keras`)
tfdp's training step against plain Keras `fit(jit_compile=True)` on the same model.

Synthetic on-device data, one replica, per-model batch `--batch`; each cell is
the steady-state rate of `tfdp.commands.benchmark.fit_rate` (windows of
`--steps` steps after `--warmup` untimed ones, until two windows agree). All
cells of a run are measured in it, one after the other in one process, so the
ratios compare like with like. Any registry name works (`--models`).

The default grid: float32 and mixed_bfloat16, each with XLA off and on
(`train.jit_compile`), tfdp's compiled model (`compile_model`).

`--vs_keras`: two cells per model, the pair of benchmarks/gpu.py's "keras" and
"syn" rows without a process per row: plain Keras (the registry's model,
`compile(jit_compile=True)`, Keras' own AdamW or SGD with momentum, sparse
cross-entropy from logits, no metrics) and tfdp (`compile_model`: the same
model and optimizer settings through tfdp's config, its whole-step XLA
`train.jit_compile: true`, label smoothing, top-1/top-5 metrics), at
`--precision`, each after a fresh `keras.backend.clear_session()`.

  python benchmarks/models.py [--models=resnet18,resnet50,mobilenet_v2,efficientnetv2_b0] [--batch=16]
  python benchmarks/models.py --vs_keras --models=vit_base_patch16_224,convnext_tiny --batch=8 --steps=2 --warmup=2
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# --optimizer → its settings in tfdp's config; the plain Keras cell builds Keras' own optimizer from the same numbers
OPTIMIZERS = {
    "adamw": {"name": "adamw", "lr": 0.001, "weight_decay": 0.05},
    "sgd": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
}


def config(name: str, precision: str, jit: bool, args):
    from tfdp.config import validate
    return validate({"model": {"name": name, "num_classes": 1000}, "data": {"image_size": args.size},
                     "optimizer": OPTIMIZERS[args.optimizer],
                     "train": {"precision": precision, "jit_compile": jit, "batch_size_per_replica": args.batch}})


def tfdp_rate(name: str, precision: str, jit: bool, args) -> float:
    """tfdp's training step (`compile_model`, as `tfdp train` compiles it)."""
    import keras

    from tfdp.commands.benchmark import fit_rate
    from tfdp.data.pipeline import synthetic_dataset
    from tfdp.train.task import Plan, compile_model
    keras.backend.clear_session()
    cfg = config(name, precision, jit, args)
    model = compile_model(cfg, Plan(args.batch, args.warmup + args.steps, 0, 0, 1000))
    rate, _ = fit_rate(model, synthetic_dataset(cfg.data, 1000, args.batch), args.batch, args.steps, args.warmup)
    keras.mixed_precision.set_global_policy("float32")
    return rate


def keras_optimizer(args):
    """Keras' own optimizer with the numbers of `OPTIMIZERS[args.optimizer]`, the learning rate scaled to the batch
    as tfdp scales its own (per 256 images)."""
    import keras
    settings = OPTIMIZERS[args.optimizer]
    lr = settings["lr"] * args.batch / 256
    if settings["name"] == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=settings["weight_decay"])
    return keras.optimizers.SGD(lr, momentum=settings["momentum"])


def keras_rate(name: str, precision: str, args) -> float:
    """What a user would write instead: the same network, `compile(jit_compile=True)`, `fit`."""
    import keras

    from tfdp.commands.benchmark import fit_rate
    from tfdp.data.pipeline import synthetic_dataset
    from tfdp.models import build_model
    keras.backend.clear_session()
    cfg = config(name, precision, True, args)
    keras.mixed_precision.set_global_policy(precision)
    model = build_model(cfg.model, cfg.data)
    model.compile(optimizer=keras_optimizer(args), jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rate, _ = fit_rate(model, synthetic_dataset(cfg.data, 1000, args.batch), args.batch, args.steps, args.warmup)
    keras.mixed_precision.set_global_policy("float32")
    return rate


def grid(args) -> None:
    cells = [("float32", False), ("float32", True), ("mixed_bfloat16", False), ("mixed_bfloat16", True)]
    print(f"{args.size} px, batch {args.batch}, 1 replica, {args.optimizer}, images/s (ratio to float32 without XLA)")
    print(f"{'model':<24}" + "".join(f"{p + (' +XLA' if j else ''):>24}" for p, j in cells))
    for name in args.models.split(","):
        rates = [tfdp_rate(name, p, j, args) for p, j in cells]
        print(f"{name:<24}" + "".join(f"{r:>15.1f} ({r / rates[0]:.2f}x)" for r in rates), flush=True)


def vs_keras(args) -> None:
    print(f"{args.size} px, batch {args.batch}, 1 replica, {args.precision}, {args.optimizer}, images/s "
          f"(windows of {args.steps} steps after {args.warmup})")
    print(f"{'model':<24}{'plain Keras, XLA':>20}{'tfdp, whole-step XLA':>24}{'tfdp / Keras':>14}")
    for name in args.models.split(","):
        plain = keras_rate(name, args.precision, args)
        ours = tfdp_rate(name, args.precision, True, args)
        print(f"{name:<24}{plain:>20.2f}{ours:>24.2f}{ours / plain:>13.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50,mobilenet_v2,efficientnetv2_b0")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--vs_keras", action="store_true", help="plain Keras fit(jit_compile=True) against tfdp")
    parser.add_argument("--precision", default="float32", help="--vs_keras: float32, mixed_bfloat16, mixed_float16")
    args = parser.parse_args()
    import tfdp  # noqa: F401
    from tfdp.models import check_model_name
    for name in args.models.split(","):
        check_model_name(name)
    (vs_keras if args.vs_keras else grid)(args)


if __name__ == "__main__":
    main()
