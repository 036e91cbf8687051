"""Training images/s with each device-side augmentation switch against none, measured side by side in one run.

Rows: each switch alone, then each recipe in configs/ with its own `augment`
section. Synthetic uint8 batches already in memory (no input pipeline: the host's
share is nothing), one replica, the same model and batch for every row; each
row is a steady-state rate (`tfdp.commands.benchmark.fit_rate`). The augmentations run
on the device as the first program of each step, so their cost shows here and
nowhere in the input pipeline (which `benchmarks/input_pipeline.py` measures,
switches or not: they do not touch it).

  python benchmarks/augment.py [--model=resnet18_small --size=32 --batch=64 --jit]
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SWITCHES = {
    "none": {},
    "RandAugment rand-m9-mstd0.5-inc1": {"rand_augment": "rand-m9-mstd0.5-inc1"},
    "TrivialAugment-wide": {"trivial_augment": True},
    "Mixup 0.8 + CutMix 1.0": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0},
    "random erasing 0.25": {"erasing_prob": 0.25},
    "colour jitter 0.4": {"color_jitter": 0.4},
    "all of the above but TrivialAugment": {"rand_augment": "rand-m9-mstd0.5-inc1", "mixup_alpha": 0.8,
                                            "cutmix_alpha": 1.0, "erasing_prob": 0.25, "color_jitter": 0.4},
}


def recipe_switches() -> dict[str, dict]:
    """Each recipe in configs/ with augmentations: its `augment` section, as the recipe sets it."""
    import glob

    import yaml
    found = {}
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            section = (yaml.safe_load(f) or {}).get("augment") or {}
        if section:
            found[f"recipe {os.path.basename(path)[:-5]}"] = section
    return found


def measure(section: dict, args) -> float:
    import keras

    from tfdp.commands.benchmark import fit_rate
    from tfdp.config import validate
    from tfdp.data.pipeline import synthetic_dataset
    from tfdp.train.task import Plan, compile_model
    keras.backend.clear_session()
    cfg = validate({"model": {"name": args.model, "num_classes": 100}, "data": {"image_size": args.size},
                    "augment": section, "train": {"batch_size_per_replica": args.batch, "jit_compile": args.jit}})
    model = compile_model(cfg, Plan(args.batch, 100, 0, 0, 100))
    rate, _ = fit_rate(model, synthetic_dataset(cfg.data, 100, args.batch), args.batch, args.steps, 3)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_small")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed window")
    parser.add_argument("--jit", action="store_true", help="whole-step XLA (the default on GPUs)")
    args = parser.parse_args()
    import tfdp  # noqa: F401  (TensorFlow environment defaults)
    rates = {name: measure(section, args) for name, section in {**SWITCHES, **recipe_switches()}.items()}
    rates["none, again (the run's noise)"] = measure({}, args)
    base = rates["none"]
    print(f"{args.model}, {args.size} px, batch {args.batch}, XLA {'on' if args.jit else 'off'}, {os.cpu_count()} CPUs")
    print(f"{'switch':<42} {'images/s':>9} {'vs none':>8}")
    for name, rate in rates.items():
        print(f"{name:<42} {rate:>9.1f} {rate / base:>7.2f}x")


if __name__ == "__main__":
    main()
