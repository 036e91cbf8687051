"""`tfdp benchmark`: a scaling analysis, measured rather than guessed.

For 1..N replicas (GPUs, or logical CPU devices on a GPU-less host) each count
runs in a fresh process (devices can be configured once per process) and
measures, after warm-up steps:
  - training images/s on synthetic data already on the device (compute only),
  - training images/s on the configured data (compute + input), unless the
    config's data is synthetic,
  - and, once, the input pipeline alone: images/s of the training tf.data
    pipeline with no model.
Scaling efficiency is rate(n) / (n x rate(1)) with a fixed per-replica batch.
The verdict comes from what training achieved at the largest replica count:
real-data training below 0.95x synthetic is input-bound, and the pipeline's
rate alone then says whether decoding itself is too slow or only too slow
beside the training step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from tfdp import config as config_lib
from tfdp.config import Config
from tfdp.errors import UserError


INPUT_BOUND_BELOW = 0.95  # real-data training slower than this fraction of synthetic: the input limits the run


def verdict(real_rate: float | None, synthetic_rate: float, input_rate: float) -> tuple[str, str]:
    """What limits training, from what training itself achieved on real and on synthetic data.

    The pipeline's rate alone does not decide it: a pipeline that keeps up
    alone can still starve the model when it shares the CPU with the training
    step. Real-data training below 0.95x synthetic is input-bound; the rate
    of the pipeline alone then names the likely cause.
    """
    if real_rate is None:
        return "compute-bound", f"synthetic data only: the model trains at {synthetic_rate:.0f} images/s"
    ratio = real_rate / synthetic_rate
    rates = (f"training on real data runs at {real_rate:.0f} images/s, {ratio:.2f}x the {synthetic_rate:.0f} "
             f"images/s on synthetic data")
    if ratio >= INPUT_BOUND_BELOW:
        return "compute-bound", f"{rates}: the input keeps up"
    if input_rate < synthetic_rate:
        cause = (f"the input pipeline alone delivers {input_rate:.0f} images/s, less than the model takes: decoding "
                 f"is the limit (more CPU cores per accelerator, downscaled shards, or the tf.data service)")
    else:
        cause = (f"the input pipeline alone delivers {input_rate:.0f} images/s, enough alone but not beside "
                 f"training: decoding and the training step compete for the host's CPUs")
    return "input-bound", f"{rates}; {cause}"


def analyse(cfg: Config, probes: list[dict], input_rate: float) -> dict:
    base = probes[0]["synthetic_images_per_sec"]
    rows = []
    for p in probes:
        n = p["replicas"]
        rows.append({**p, "per_replica_images_per_sec": p["synthetic_images_per_sec"] / n,
                     "scaling_efficiency": p["synthetic_images_per_sec"] / (n * base)})
    last = rows[-1]
    name, reason = verdict(last.get("real_data_images_per_sec"), last["synthetic_images_per_sec"], input_rate)
    return {"model": cfg.model.name, "image_size": cfg.data.image_size, "data_format": cfg.data.format,
            "batch_size_per_replica": cfg.train.batch_size_per_replica, "rows": rows,
            "input_pipeline_images_per_sec": input_rate, "verdict": name, "verdict_reason": reason}


def benchmark(cfg: Config, max_replicas: int, steps: int, warmup_steps: int, out_dir: str) -> dict:
    if max_replicas < 1 or steps < 1 or warmup_steps < 1:
        raise UserError("benchmark needs --max_replicas, --steps and --warmup_steps of at least 1")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(config_lib.dump_yaml(cfg))
        probes = [_run_probe(path, n, steps, warmup_steps, measure_input=(n == 1)) for n in range(1, max_replicas + 1)]
    result = analyse(cfg, probes, probes[0].pop("input_images_per_sec"))
    for p in result["rows"]:
        p.pop("input_images_per_sec", None)
    with open(os.path.join(out_dir, "benchmark.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out_dir, "scaling.png"))
    return result


def format_table(result: dict) -> str:
    lines = [f"{'replicas':>8} {'global batch':>12} {'synthetic img/s':>15} {'real img/s':>10} "
             f"{'per replica':>11} {'efficiency':>10}"]
    for r in result["rows"]:
        real = f"{r['real_data_images_per_sec']:.1f}" if r.get("real_data_images_per_sec") else "-"
        lines.append(f"{r['replicas']:>8} {r['global_batch']:>12} {r['synthetic_images_per_sec']:>15.1f} "
                     f"{real:>10} {r['per_replica_images_per_sec']:>11.1f} {r['scaling_efficiency']:>10.2f}")
    lines.append(f"input pipeline alone: {result['input_pipeline_images_per_sec']:.1f} images/s")
    lines.append(f"verdict: {result['verdict']}: {result['verdict_reason']}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    n = [r["replicas"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(n, [r["synthetic_images_per_sec"] for r in rows], marker="o", label="training, synthetic data")
    if all(r.get("real_data_images_per_sec") for r in rows):
        ax.plot(n, [r["real_data_images_per_sec"] for r in rows], marker="o", label="training, real data")
    ax.plot(n, [rows[0]["synthetic_images_per_sec"] * k for k in n], linestyle="--", label="ideal linear")
    ax.axhline(result["input_pipeline_images_per_sec"], color="grey", linestyle=":", label="input pipeline alone")
    ax.set(title=f"Scaling: {result['model']} at {result['image_size']} px", xlabel="replicas", ylabel="images/s",
           xticks=n)
    top = max(r["synthetic_images_per_sec"] for r in rows)
    if result["input_pipeline_images_per_sec"] > 5 * top:
        ax.set_yscale("log")  # a fast pipeline would flatten the training curves on a linear axis
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _run_probe(config_path: str, replicas: int, steps: int, warmup: int, measure_input: bool) -> dict:
    cmd = [sys.executable, "-m", "tfdp.benchmark", config_path, str(replicas), str(steps), str(warmup),
           "1" if measure_input else "0"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["(no output)"]
        raise UserError(f"benchmark with {replicas} replica(s) failed: {tail[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the probe: one replica count, in its own process ---------------------------------------

def probe(cfg: Config, replicas: int, steps: int, warmup: int, measure_input: bool) -> dict:
    from tfdp.strategy import local_replicas, make_runtime
    runtime = make_runtime(local_replicas(replicas))
    import tensorflow as tf

    from tfdp.data import build_source
    from tfdp.data.pipeline import synthetic_dataset, train_dataset
    from tfdp.task import Plan, compile_model

    global_batch = cfg.train.batch_size_per_replica * runtime.num_replicas
    plan = Plan(global_batch, warmup + steps, 0, 0, cfg.model.num_classes)
    with runtime.strategy.scope():
        model = compile_model(cfg, plan)
    result = {"replicas": runtime.num_replicas, "global_batch": global_batch}
    synthetic = runtime.strategy.distribute_datasets_from_function(
        lambda ctx: synthetic_dataset(cfg.data, cfg.model.num_classes, global_batch, ctx))
    result["synthetic_images_per_sec"] = fit_rate(model, synthetic, global_batch, steps, warmup)
    if cfg.data.format != "synthetic":
        split = build_source(cfg.data).split(cfg.data.train_split)
        real = runtime.strategy.distribute_datasets_from_function(
            lambda ctx: train_dataset(split, cfg.data, global_batch, cfg.train.seed, ctx))
        result["real_data_images_per_sec"] = fit_rate(model, real, global_batch, steps, warmup)
    if measure_input:
        if cfg.data.format == "synthetic":
            ds = synthetic_dataset(cfg.data, cfg.model.num_classes, global_batch)
        else:
            ds = train_dataset(build_source(cfg.data).split(cfg.data.train_split), cfg.data, global_batch, cfg.train.seed)
        result["input_images_per_sec"] = _pipeline_rate(ds, global_batch, steps, warmup, tf)
    return result


def fit_rate(model, dataset, global_batch: int, steps: int, warmup: int) -> float:
    """Training images/s over `steps` steps, timed from the end of the `warmup`-th step."""
    import keras
    stamps: dict[int, float] = {}

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps[batch] = time.perf_counter()

    model.fit(dataset, steps_per_epoch=warmup + steps, epochs=1, verbose=0, callbacks=[Stamp()], shuffle=False)
    return steps * global_batch / (stamps[warmup + steps - 1] - stamps[warmup - 1])


def _pipeline_rate(dataset, global_batch: int, steps: int, warmup: int, tf) -> float:
    it = iter(dataset)
    for _ in range(warmup):
        next(it)
    start = time.perf_counter()
    for _ in range(steps):
        images, _ = next(it)
    return steps * global_batch / (time.perf_counter() - start)


if __name__ == "__main__":
    import tfdp  # noqa: F401  (TensorFlow environment defaults)
    path, n, steps_, warmup_, measure = sys.argv[1:6]
    out = probe(config_lib.load_config(path), int(n), int(steps_), int(warmup_), measure == "1")
    print(json.dumps(out))
