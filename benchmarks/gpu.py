"""Every row of the GPU speed table, measured side by side in one run, naming the device and the CPU count.

Each row is its own process (devices, precision and XLA are set once per
process), on the same model, per-device batch and precision:

  plain Keras          what a user would write instead: the same model, `compile(jit_compile=True)`,
                       `fit` on one device, one synthetic batch repeated
  tfdp train ...       `tfdp train` on synthetic data (XLA auto = on for a GPU; off; mixed_float16),
                       on ImageNet-sized JPEG files, on TFRecord shards full-size and downscaled
                       (median images/s of the epochs after the first, each epoch's time
                       including its per-epoch costs: validation, checkpoint, callbacks)
  tfdp benchmark       `tfdp benchmark` on the same shards: synthetic and real training rates,
                       the input pipeline alone and beside training, and its verdict
  full JPEG decode     tf.io.decode_jpeg of the whole image, every core, as fast as tf.data goes

The JPEGs are cut from the real photos in the scikit-image/scikit-learn
wheels at ImageNet's size (~500x375); see benchmarks/input_pipeline.py.

  python benchmarks/gpu.py                      # ResNet-50, batch 256, bf16, 224 px: the GPU table
  python benchmarks/gpu.py --model=resnet18_small --size=32 --batch=32 --images=512 --epochs=3 \
      --precision=float32 --max_side=64 --steps=5 --skip_fp16       # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))   # support.photos


def tfdp(*args: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfdp", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def train_rate(args, model_dir: str, data: list[str], *extra: str) -> str:
    """Median images/s of epochs 2.. of a `tfdp train` run (the first epoch compiles)."""
    run = tfdp("train", f"--model={args.model}", f"--model_dir={model_dir}", f"--epochs={args.epochs}",
               f"--batch_size_per_replica={args.batch}", f"--set=data.image_size={args.size}",
               f"--set=train.precision={args.precision}", "--set=train.checkpoint_every_steps=0",
               "--strategy=mirrored", *data, *extra)
    if run.returncode != 0:
        return "failed: " + (run.stderr.strip().splitlines() or ["?"])[-1][:120]
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rates = [json.loads(line)["images_per_sec"] for line in f if line.strip()]
    later = rates[1:] or rates
    return f"{statistics.median(later):,.0f} (epochs: {', '.join(f'{r:,.0f}' for r in rates)})"


def plain_keras_rate(args) -> str:
    """The same model compiled by plain Keras with whole-step XLA, in its own process."""
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--plain_keras_probe", f"--model={args.model}",
                          f"--batch={args.batch}", f"--size={args.size}", f"--precision={args.precision}",
                          f"--steps={args.steps}"], capture_output=True, text=True, timeout=3600)
    lines = run.stdout.strip().splitlines()
    return f"{float(lines[-1]):,.0f}" if run.returncode == 0 and lines else "failed: " + run.stderr[-200:]


def plain_keras_probe(args) -> None:
    import keras
    import tfdp  # noqa: F401  (TensorFlow environment defaults)

    from tfdp.commands.benchmark import fit_rate
    from tfdp.config import validate
    from tfdp.data.pipeline import synthetic_dataset
    from tfdp.models import build_model
    cfg = validate({"model": {"name": args.model, "num_classes": 1000}, "data": {"image_size": args.size}})
    if args.precision != "float32":
        keras.mixed_precision.set_global_policy(args.precision)
    model = build_model(cfg.model, cfg.data)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rate, _ = fit_rate(model, synthetic_dataset(cfg.data, 1000, args.batch), args.batch, args.steps, 5)
    print(rate)


def benchmark_rows(args, model_dir: str, data: list[str]) -> list[tuple[str, str]]:
    out = os.path.join(model_dir, "bench")
    run = tfdp("benchmark", f"--model={args.model}", f"--model_dir={model_dir}", f"--batch_size_per_replica={args.batch}",
               f"--set=data.image_size={args.size}", f"--set=train.precision={args.precision}", "--max_replicas=1", f"--steps={args.steps}", "--warmup_steps=5",
               f"--benchmark_dir={out}", *data)
    if run.returncode != 0:
        return [("tfdp benchmark", "failed: " + (run.stderr.strip().splitlines() or ["?"])[-1][:120])]
    with open(os.path.join(out, "benchmark.json"), encoding="utf-8") as f:
        result = json.load(f)
    row = result["rows"][0]
    return [("tfdp benchmark, synthetic (steady-state steps)", f"{row['synthetic_images_per_sec']:,.0f}"),
            ("tfdp benchmark, real data (shards)", f"{row['real_data_images_per_sec']:,.0f}"),
            ("tfdp benchmark, input pipeline alone / beside training",
             f"{result['input_pipeline_images_per_sec']:,.0f} / {result['input_beside_training_images_per_sec']:,.0f}"),
            ("tfdp benchmark, verdict", f"{result['verdict']}: {result['verdict_reason']}")]


def full_decode_rate(files: list[str], batch: int) -> str:
    from input_pipeline import full_decode, rate
    return f"{rate(full_decode(files, batch), batch, 40):,.0f}"


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return f"no GPU ({platform.processor() or platform.machine()})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=256, help="per device")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--images", type=int, default=11_800, help="ImageNet-sized JPEGs written for the real-data rows")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="benchmark window, in steps")
    parser.add_argument("--max_side", type=int, default=256, help="downscaled shards: longer side")
    parser.add_argument("--skip_fp16", action="store_true", help="leave out the mixed_float16 row (emulated on CPUs)")
    parser.add_argument("--plain_keras_probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_keras_probe:
        return plain_keras_probe(args)

    from input_pipeline import make_data
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        data = make_data(work, args.images, args.max_side)
        files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(data["tree"], "train")) for f in fs]
        classes = f"--set=model.num_classes={len(os.listdir(os.path.join(data['tree'], 'train')))}"
        synthetic = ["--data_format=synthetic", f"--set=data.synthetic_examples={args.batch * 60}",
                     "--set=model.num_classes=1000"]
        tree = [f"--data_dir={data['tree']}", "--data_format=imagenet", classes]
        shards = [f"--data_dir={data['shards']}", "--data_format=tfrecord", classes]
        small = [f"--data_dir={data['small']}", "--data_format=tfrecord", classes]
        rows.append(("plain Keras fit, jit_compile=True, one device, synthetic", plain_keras_rate(args)))
        run = lambda name, *extra: train_rate(args, os.path.join(work, name), *extra)  # noqa: E731
        rows.append(("tfdp train, synthetic, XLA auto", run("syn", synthetic)))
        rows.append(("tfdp train, synthetic, train.jit_compile false", run("syn-nojit", synthetic,
                                                                           "--set=train.jit_compile=false")))
        if not args.skip_fp16:
            rows.append(("tfdp train, synthetic, XLA, mixed_float16", run("syn-fp16", synthetic,
                                                                           "--set=train.precision=mixed_float16")))
        rows.append((f"tfdp train, {len(files):,} JPEG files (first process after writing them)", run("files", tree)))
        rows.append(("tfdp train, TFRecord shards, full size", run("shards", shards)))
        rows.append((f"tfdp train, TFRecord shards, longer side {args.max_side}", run("small", small)))
        rows.extend(benchmark_rows(args, os.path.join(work, "bench"), shards))
        rows.append(("full JPEG decode alone, same files", full_decode_rate(files, args.batch)))
        took = time.perf_counter() - start
    print(f"# {device_name()}, {os.cpu_count()} CPUs; {args.model}, batch {args.batch} per device, {args.size} px, "
          f"{args.precision}; {took / 60:.0f} min\n")
    print("| run | images/s |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
