"""`tfdp benchmark`: a scaling analysis, measured rather than guessed.

For 1..N replicas (GPUs, or logical CPU devices on a GPU-less host) each count
runs in a fresh process (devices can be configured once per process) and
measures, in steady state (windows of `--steps` steps until two agree within
3%, after `--warmup_steps`):
  - training images/s on synthetic data already on the device (compute only),
  - training images/s on the configured data (compute + input), unless the
    config's data is synthetic,
  - and, once, the input pipeline's images/s alone and beside training (the
    same process training on synthetic batches meanwhile).
The real data is decoded as `tfdp train` decodes it: `data.decoder` resolved on
the probe's replicas, so with DALI the real-data rows and the input's rates are
DALI's (tfdp's stream, decoded on the replica's device).
Scaling efficiency is rate(n) / (n x rate(1)) with a fixed per-replica batch.
The verdict comes from what training achieved at the largest replica count:
real-data training below 0.95x synthetic is input-bound, and the pipeline's
rate alone then says whether decoding itself is too slow or only too slow
beside the training step.
"""

from __future__ import annotations

import bisect
import dataclasses
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
# What to try when the input alone is slower than the model, by decoder (`data.decoder`).
REMEDIES = {
    "tf": "more CPU cores per accelerator, downscaled shards, the tf.data service, or data.decoder: dali on GPUs",
    "dali": "data.dali_threads, data.dali_hw_decoder_load, or downscaled shards",
}


def verdict(real_rate: float | None, synthetic_rate: float, input_rate: float,
            beside_rate: float | None = None, decoder: str = "tf") -> tuple[str, str]:
    """What limits training, from what training itself achieved on real and on synthetic data.

    The pipeline's rate alone does not decide it: a pipeline that keeps up
    alone can still starve the model when it shares the CPU with the training
    step. Real-data training below 0.95x synthetic is input-bound; the
    pipeline's rates alone and beside training then name the likely cause.
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
                 f"is the limit ({REMEDIES[decoder]})")
    else:
        beside = f" ({beside_rate:.0f} beside training)" if beside_rate else ""
        cause = (f"the input pipeline alone delivers {input_rate:.0f} images/s{beside}, enough alone but not beside "
                 f"training: decoding and the training step compete for the host's CPUs")
    return "input-bound", f"{rates}; {cause}"


def analyse(cfg: Config, probes: list[dict], input_rate: float, beside_rate: float | None = None) -> dict:
    base = probes[0]["synthetic_images_per_sec"]
    rows = []
    for p in probes:
        n = p["replicas"]
        rows.append({**p, "per_replica_images_per_sec": p["synthetic_images_per_sec"] / n,
                     "scaling_efficiency": p["synthetic_images_per_sec"] / (n * base)})
    last, decoder = rows[-1], probes[0].get("decoder", "tf")
    name, reason = verdict(last.get("real_data_images_per_sec"), last["synthetic_images_per_sec"], input_rate,
                           beside_rate, decoder)
    return {"model": cfg.model.name, "image_size": cfg.data.image_size, "data_format": cfg.data.format,
            "decoder": decoder,
            "batch_size_per_replica": cfg.train.batch_size_per_replica, "rows": rows,
            "input_pipeline_images_per_sec": input_rate, "input_beside_training_images_per_sec": beside_rate,
            "verdict": name, "verdict_reason": reason}


def benchmark(cfg: Config, max_replicas: int, steps: int, warmup_steps: int, out_dir: str) -> dict:
    if max_replicas < 1 or steps < 1 or warmup_steps < 1:
        raise UserError("benchmark needs --max_replicas, --steps and --warmup_steps of at least 1")
    # Windows of `steps` steps are timed until two agree (see `probe`): `steps` is the window.
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(config_lib.dump_yaml(cfg))
        probes = [_run_probe(path, n, steps, warmup_steps, measure_input=(n == 1)) for n in range(1, max_replicas + 1)]
    first = probes[0]
    result = analyse(cfg, probes, first.pop("input_images_per_sec"), first.pop("input_beside_training_images_per_sec"))
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
    lines.append(f"input pipeline alone (data.decoder {result.get('decoder', 'tf')}): "
                 f"{result['input_pipeline_images_per_sec']:.1f} images/s; beside training "
                 f"(1 replica, synthetic batches): {result['input_beside_training_images_per_sec'] or 0:.1f} images/s")
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
    cmd = [sys.executable, "-m", "tfdp.commands.benchmark", config_path, str(replicas), str(steps), str(warmup),
           "1" if measure_input else "0"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["(no output)"]
        raise UserError(f"benchmark with {replicas} replica(s) failed: {tail[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the probe: one replica count, in its own process ---------------------------------------

STEADY = 0.03      # two successive windows within 3% of each other: steady state
MAX_WINDOWS = 12   # ... or give up waiting and report the last window


def probe(cfg: Config, replicas: int, steps: int, warmup: int, measure_input: bool) -> dict:
    """Training rates on synthetic and real data, and (once) the input pipeline alone and beside training.

    Every rate is a steady-state rate: windows of `steps` steps are timed
    until two successive ones agree within 3%, so autotuning, page-cache
    warm-up and compilation are not averaged in (a short probe read well below
    what training then achieved on one H100).
    """
    from tfdp.distribute.strategy import local_replicas, make_runtime
    runtime = make_runtime(local_replicas(replicas))

    from tfdp.data import build_source, dali
    from tfdp.data.preprocess import DECODERS
    from tfdp.data.counting import CorruptCounter
    from tfdp.data.pipeline import synthetic_dataset, train_dataset
    from tfdp.train.task import ClassificationTask, Plan

    global_batch = cfg.train.batch_size_per_replica * runtime.num_replicas
    decoder = dali.choose(cfg.data, list(runtime.devices))   # as `tfdp train` decodes on these replicas
    plan = Plan(global_batch, warmup + steps, 0, 0, cfg.model.num_classes, decoder=decoder)
    source = build_source(cfg.data)
    task = ClassificationTask(cfg, runtime, source)
    with runtime.strategy.scope():
        model = task.build_model("train", plan)
    result = {"replicas": runtime.num_replicas, "global_batch": global_batch, "decoder": decoder}
    synthetic = runtime.strategy.distribute_datasets_from_function(
        lambda ctx: synthetic_dataset(cfg.data, cfg.model.num_classes, global_batch, ctx))
    split = source.split(cfg.data.train_split)
    if DECODERS[decoder].dealt:   # the input alone: tfdp's stream and the replica's DALI pipeline after it
        local_pipeline = lambda: task.build_train_inputs(plan, CorruptCounter()).dataset((0, 0))  # noqa: E731
    else:
        data = dataclasses.replace(cfg.data, decoder=decoder)
        local_pipeline = lambda: train_dataset(split, data, global_batch, cfg.train.seed)  # noqa: E731
    result["synthetic_images_per_sec"], _ = fit_rate(model, synthetic, global_batch, steps, warmup)
    if measure_input:
        with Drain(local_pipeline()) as beside:  # the pipeline decoding while the model trains (a second run:
            _, windows = fit_rate(model, synthetic, global_batch, steps, warmup)  # it slows the training down)
        result["input_beside_training_images_per_sec"] = beside.rate(global_batch, *windows)
        result["input_images_per_sec"] = pipeline_rate(local_pipeline(), global_batch, steps, warmup)
    if cfg.data.format != "synthetic":   # the pipeline `tfdp train` reads, corrupt-image counting included
        real = task.build_train_inputs(plan, CorruptCounter()).dataset((0, 0))
        if DECODERS[decoder].dealt:   # a dataset per replica is another iterator type than the synthetic
            model.train_function = None    # batches' the step was traced for: rebuilt by the next fit
        result["real_data_images_per_sec"], _ = fit_rate(model, real, global_batch, steps, warmup)
    return result


def steady(stamps: list[float], steps: int) -> bool:
    """Whether the last two windows of `steps` steps (from step-end times `stamps`) ran within STEADY."""
    if len(stamps) < 2 * steps + 1:
        return False
    last, before = stamps[-1] - stamps[-1 - steps], stamps[-1 - steps] - stamps[-1 - 2 * steps]
    return abs(last - before) <= STEADY * max(last, before)


def fit_rate(model, dataset, global_batch: int, steps: int, warmup: int) -> tuple[float, tuple[float, float]]:
    """Steady-state training images/s over the last window of `steps` steps, and that window's (start, end).

    One `fit` call (a new call would rebuild the input pipeline), stopped as
    soon as two successive windows agree.
    """
    import keras
    stamps: list[float] = []

    class Windows(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 >= warmup:
                stamps.append(time.perf_counter())
                timed = len(stamps) - 1
                if timed and timed % steps == 0 and steady(stamps, steps):
                    self.model.stop_training = True

    model.fit(dataset, steps_per_epoch=warmup + steps * MAX_WINDOWS, epochs=1, verbose=0, callbacks=[Windows()],
              shuffle=False)
    window = (stamps[-1 - steps], stamps[-1])
    return steps * global_batch / (window[1] - window[0]), window


def pipeline_rate(dataset, global_batch: int, steps: int, warmup: int) -> float:
    """Steady-state images/s of a (local) training pipeline with nothing else running."""
    it = iter(dataset)
    for _ in range(warmup):
        next(it)
    stamps = [time.perf_counter()]
    while len(stamps) < steps * MAX_WINDOWS + 1:
        next(it)
        stamps.append(time.perf_counter())
        if (len(stamps) - 1) % steps == 0 and steady(stamps, steps):
            break
    return steps * global_batch / (stamps[-1] - stamps[-1 - steps])


class Drain:
    """Reads a pipeline as fast as it delivers, in a thread, while the caller trains: the input rate under load."""

    FIRST_BATCH_S = 120  # how long entering waits for the pipeline's first batch (start-up is not its rate)

    def __init__(self, dataset):
        import threading
        self.dataset, self.stamps, self.stop = dataset, [], threading.Event()
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="tfdp-benchmark-drain")

    def _run(self):
        for _ in self.dataset:
            self.stamps.append(time.perf_counter())
            self.first.set()
            if self.stop.is_set():
                return

    def __enter__(self):
        self.thread.start()
        self.first.wait(self.FIRST_BATCH_S)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=60)

    def rate(self, global_batch: int, start: float, end: float) -> float:
        """Images/s delivered over the timed training window (`start`, `end`).

        Measured from the last batch before the window to the first after it,
        so the span holds whole batch intervals: a pipeline slower than one
        batch per window (a short window on a loaded host) still reads as its
        rate, not as 0.
        """
        stamps = self.stamps  # in arrival order, so sorted
        first_in, first_after = bisect.bisect_right(stamps, start), bisect.bisect_left(stamps, end)
        lo = stamps[first_in - 1] if first_in else start
        hi = stamps[first_after] if first_after < len(stamps) else end
        batches = first_after - first_in + (first_after < len(stamps))
        return global_batch * batches / (hi - lo) if hi > lo else 0.0


if __name__ == "__main__":
    import tfdp  # noqa: F401  (TensorFlow environment defaults)
    path, n, steps_, warmup_, measure = sys.argv[1:6]
    out = probe(config_lib.load_config(path), int(n), int(steps_), int(warmup_), measure == "1")
    print(json.dumps(out))
