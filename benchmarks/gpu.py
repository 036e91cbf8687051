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
  scaling              the input alone, GPU hidden, on 1, 4, 16, ... cores: the stream DALI is fed from, from
                       the shards and from memory (data.cache), beside the tf training pipeline
  dali_alone           each dali entry of --decoder as DALI alone on the GPU, its input batches held in memory:
                       images/s and host CPU per image, by thread (DALI's own cost, apart from the stream);
                       dali:decode=false: DALI's feed alone, each image cut out and its header read
  decoders             `tfdp train` per model of --decoder_models (ResNet-50 and ResNet-18 by default),
                       synthetic and on the full-size shards with each `data.decoder` of --decoder
                       (tf: the host's CPUs decode; dali: DALI on the GPU): images/s, its ratio to the
                       model's synthetic rate, and the host CPU seconds per image (the process's user +
                       system time over the images it trained, and that minus the synthetic run's:
                       the input's own cost, start-up and compilation cancelled out), and that CPU time
                       by thread name (the busiest five: tf.data's pools, DALI's workers, Python, XLA),
                       read from /proc while the run goes

The JPEGs are cut from the real photos in the scikit-image/scikit-learn
wheels at ImageNet's size (~500x375); see benchmarks/input_pipeline.py.

  python benchmarks/gpu.py                      # ResNet-50, batch 256, bf16, 224 px: the GPU table
  python benchmarks/gpu.py --rows=syn,keras,demo,split --epochs=3     # the short set, for a short lease
  python benchmarks/gpu.py --model=resnet18_small --size=32 --batch=32 --images=512 --epochs=3 \
      --precision=float32 --max_side=64 --steps=5 --skip_fp16       # a CPU smoke run
  python benchmarks/gpu.py --model=vit_base_patch16_224 --optimizer=adamw --rows=keras,syn,nojit,split
  python benchmarks/gpu.py --model=convnext_tiny --optimizer=adamw --rows=keras,syn,nojit,split
  python benchmarks/gpu.py --rows=decoders                      # tf vs DALI, ResNet-50 and ResNet-18, 224 px, bf16
  python benchmarks/gpu.py --rows=decoders --decoder_models=resnet18_small --size=32 --batch=32 --images=512 \
      --epochs=2 --precision=float32 --max_side=64              # its CPU smoke run (DALI's CPU operators)
  python benchmarks/gpu.py --rows=decoders --decoder_models=resnet18 \
      --decoder=dali,dali:dali_threads=16,dali:dali_hw_decoder_load=0.95   # DALI's settings side by side
  python benchmarks/gpu.py --rows=scaling        # the input alone on 1, 4, 16, ... cores (GPU hidden)
  python benchmarks/gpu.py --rows=dali_alone --decoder=dali:dali_threads=4,dali:dali_hw_decoder_load=0.65
                                                 # DALI alone with each setting, its input in memory
  python benchmarks/gpu.py --rows=decoders --gpu_schedule=blocking_sync   # every process's CUDA waits blocking

The real data (--images JPEGs, and each set of shards a row reads) is made once, on first use: the JPEGs by
one process per core, each set of shards converted by a converter that imports no TensorFlow
(benchmarks/input_pipeline.py, make_data); --data_only makes the JPEGs and the full-size shards (all the
decoders, scaling and dali_alone rows read; the downscaled set only for the `small` row).
With --workdir the data (and the decoders row's synthetic runs) stay there for later invocations, so a
short lease can make the data while its packages are still arriving (--data_only) and measure after;
each `tfdp train` run's output is kept beside its model_dir as DIR.log.

Any registry model runs (a ViT takes image sizes its patch divides). `--optimizer=adamw` trains both sides
with AdamW (weight decay 0.05; the transformers' and ConvNeXt's optimizer) instead of SGD with momentum. Every
`tfdp train` row after the plain Keras row (first in the default order) prints its ratio to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))   # support.photos


def tfdp(*args: str, split: int = 0, timeout: int = 3600, threads: dict | None = None) -> subprocess.CompletedProcess:
    """`tfdp ARGS` in its own process; `split`: on the first GPU split into that many logical GPUs; `threads`, if
    given, is filled with the process's CPU seconds by thread name (`thread_cpu`)."""
    command = [os.path.abspath(__file__), f"--split_gpu={split}", "--"] if split else ["-m", "tfdp"]
    if threads is None:
        return subprocess.run([sys.executable, *command, *args], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
    return run_sampled([sys.executable, *command, *args], timeout, threads)


def run_sampled(command: list[str], timeout: int, threads: dict) -> subprocess.CompletedProcess:
    """`command` in its own process (from the repository root), `threads` filled with its CPU seconds by thread
    name (`thread_cpu`)."""
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        sampled = {}
        sampler = threading.Thread(target=sample_threads, args=(proc, sampled), daemon=True)
        sampler.start()
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        sampler.join()
    threads.update(thread_cpu(sampled, proc.pid))
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def sample_threads(proc: subprocess.Popen, sampled: dict, every: float = 0.25) -> None:
    """Until `proc` ends, reads each of its threads' name and CPU ticks (user + system, /proc/PID/task/TID/stat)
    into `sampled` (tid → (name, ticks)): a thread's last reading stands for it, so a thread that ends between
    two readings loses at most `every` seconds of its time."""
    root = f"/proc/{proc.pid}/task"
    while proc.poll() is None:
        try:
            tids = os.listdir(root)
        except OSError:
            break
        for tid in tids:
            try:
                with open(f"{root}/{tid}/stat", encoding="utf-8", errors="replace") as f:
                    stat = f.read()
            except OSError:
                continue
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            sampled[tid] = (name, int(fields[11]) + int(fields[12]))   # utime, stime: fields 14 and 15 of stat
        time.sleep(every)


def busiest(threads: dict[str, float], number: str, scale: float = 1.0) -> str:
    """The five busiest thread names of `thread_cpu`'s answer (busiest first), each with its value x `scale`."""
    return ", ".join(f"{name} {number.format(scale * value)}" for name, value in list(threads.items())[:5])


def thread_cpu(sampled: dict, pid: int) -> dict[str, float]:
    """CPU seconds by thread name, numbers dropped (TensorFlow's and DALI's pools number their threads). The
    process's first thread is "main"; threads that kept its name (nobody named them: Eigen's and some of
    TensorFlow's pools) are "unnamed"."""
    tick, main = os.sysconf("SC_CLK_TCK"), sampled.get(str(pid), ("", 0))[0]
    groups: dict[str, float] = {}
    for tid, (name, ticks) in sampled.items():
        key = re.sub(r"[\d_#:.-]+$", "", re.sub(r"\d+", "", name)) or name
        if name == main:
            key = "main" if tid == str(pid) else "unnamed"
        groups[key] = groups.get(key, 0.0) + ticks / tick
    return dict(sorted(groups.items(), key=lambda item: -item[1]))


def failure(run: subprocess.CompletedProcess) -> str:
    return "failed: " + (run.stderr.strip().splitlines() or ["?"])[-1][:160]


# --optimizer → tfdp's config flags, and the plain Keras probe's optimizer from the same numbers (both scale the
# learning rate per 256 images)
OPTIMIZERS = {
    "sgd": {"flags": (), "lr": 0.1},   # tfdp's default: SGD, momentum 0.9
    "adamw": {"flags": ("--set=optimizer.name=adamw", "--set=optimizer.lr=0.001",
                        "--set=optimizer.weight_decay=0.05"), "lr": 0.001},
}


def train_rate(args, model_dir: str, data: list[str], *extra: str, split: int = 0,
               versus: dict | None = None) -> str:
    """Median images/s of epochs 2.. of a `tfdp train` run (the first epoch compiles); with `split`, on that
    many logical GPUs of one card at the same global batch; with `versus` holding the plain Keras row's rate,
    the ratio to it."""
    run = tfdp("train", f"--model={args.model}", f"--model_dir={model_dir}", f"--epochs={args.epochs}",
               f"--batch_size_per_replica={args.batch // (split or 1)}", f"--set=data.image_size={args.size}",
               f"--set=train.precision={args.precision}", "--set=train.checkpoint_every_steps=0",
               "--strategy=mirrored", *OPTIMIZERS[args.optimizer]["flags"], *data, *extra, split=split)
    if run.returncode != 0:
        return failure(run)
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rates = [json.loads(line)["images_per_sec"] for line in f if line.strip()]
    later = rates[1:] or rates
    median = statistics.median(later)
    ratio = f"{median / versus['keras']:.2f}x plain Keras; " if versus and versus.get("keras") else ""
    return f"{median:,.0f} ({ratio}epochs: {', '.join(f'{r:,.0f}' for r in rates)})"


def plain_keras_rate(args, measured: dict) -> str:
    """The same model compiled by plain Keras with whole-step XLA, in its own process; its rate goes into
    `measured["keras"]` for the ratios of the tfdp rows."""
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--plain_keras_probe", f"--model={args.model}",
                          f"--batch={args.batch}", f"--size={args.size}", f"--precision={args.precision}",
                          f"--steps={args.steps}", f"--optimizer={args.optimizer}"],
                         capture_output=True, text=True, timeout=3600)
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or not lines:
        return "failed: " + run.stderr[-200:]
    measured["keras"] = float(lines[-1])
    return f"{measured['keras']:,.0f}"


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
    lr = OPTIMIZERS[args.optimizer]["lr"] * args.batch / 256   # as tfdp scales it
    optimizer = (keras.optimizers.AdamW(lr, weight_decay=0.05) if args.optimizer == "adamw"
                 else keras.optimizers.SGD(lr, momentum=0.9))
    model.compile(optimizer=optimizer, jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rate, _ = fit_rate(model, synthetic_dataset(cfg.data, 1000, args.batch), args.batch, args.steps, 5)
    print(rate)


def decoder_rows(args, work: str, shards: list[str], images: int) -> list[tuple[str, str]]:
    """Per model of --decoder_models: synthetic, then the full-size shards with each decoder of --decoder, on
    as many images per epoch (so the runs' steps, start-up and compilation match). A model's synthetic run is
    kept in --workdir and reused by a later invocation with the same settings (a lease split into calls)."""
    rows = []
    for model in [m for m in args.decoder_models.split(",") if m]:
        margs = argparse.Namespace(**{**vars(args), "model": model})
        synthetic = ["--data_format=synthetic", f"--set=data.synthetic_examples={images}",
                     "--set=model.num_classes=1000"]
        wait = f"-{args.gpu_schedule}" if args.gpu_schedule else ""   # the runs of each schedule apart
        kept = os.path.join(work, f"dec-{model}-syn{wait}-{images}-{args.batch}-{args.size}-{args.precision}-"
                                  f"{args.optimizer}-{args.epochs}.json")   # every setting the run depends on
        if os.path.exists(kept):
            with open(kept, encoding="utf-8") as f:
                syn = Timed(**json.load(f))
        else:
            syn = timed_train(margs, os.path.join(work, f"dec-{model}-syn{wait}"), synthetic)
            if not syn.error:
                with open(kept, "w", encoding="utf-8") as f:
                    json.dump(vars(syn), f)
        rows.append((f"{model}: tfdp train, synthetic", syn.line()))
        for entry in [d for d in args.decoder.split(",") if d]:
            decoder, *settings = entry.split(":")   # dali:dali_threads=16 → data.dali_threads=16 on that row
            name = "-".join([decoder, *(v.replace("=", "") for v in settings)])
            run = timed_train(margs, os.path.join(work, f"dec-{model}-{name}{wait}"),
                              [*shards, f"--set=data.decoder={decoder}", *(f"--set=data.{v}" for v in settings)])
            rows.append((f"{model}: tfdp train, shards, data.decoder {' '.join([decoder, *settings])}",
                         run.line(syn)))
    return rows


class Timed:
    """One `tfdp train` run's median images/s (epochs 2..) and host CPU seconds per image trained."""

    def __init__(self, error: str = "", rate: float = 0.0, cpu_per_image: float = 0.0,
                 threads: dict[str, float] | None = None):
        self.error, self.rate, self.cpu_per_image = error, rate, cpu_per_image
        self.threads = threads or {}   # CPU seconds per image trained, by thread name (`thread_cpu`)

    def line(self, synthetic: "Timed | None" = None) -> str:
        if self.error:
            return self.error
        text = f"{self.rate:,.0f} images/s, host CPU {1e3 * self.cpu_per_image:.2f} ms/image"
        if synthetic is not None and not synthetic.error and synthetic.rate:
            text += (f" ({self.rate / synthetic.rate:.2f}x synthetic; input "
                     f"{1e3 * (self.cpu_per_image - synthetic.cpu_per_image):.2f} ms/image above it)")
        if self.threads:   # where the host's time went: the busiest thread names, ms/image
            text += "; by thread: " + busiest(self.threads, "{:.2f}", scale=1e3)
        return text


def timed_train(args, model_dir: str, data: list[str]) -> Timed:
    """`tfdp train` as `train_rate` runs it, with its CPU time (user + system, from the kernel's accounting of
    the finished child) over the images it trained."""
    before, threads = resource.getrusage(resource.RUSAGE_CHILDREN), {}
    run = tfdp("train", f"--model={args.model}", f"--model_dir={model_dir}", f"--epochs={args.epochs}",
               f"--batch_size_per_replica={args.batch}", f"--set=data.image_size={args.size}",
               f"--set=train.precision={args.precision}", "--set=train.checkpoint_every_steps=0",
               "--strategy=mirrored", *OPTIMIZERS[args.optimizer]["flags"], *data, threads=threads)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(model_dir.rstrip("/") + ".log", "w", encoding="utf-8") as f:   # the run's own words, beside it
        f.write(run.stdout + run.stderr)
    if run.returncode != 0:
        return Timed(failure(run))
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    trained = sum(r["images_per_sec"] * r["seconds"] for r in rows)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timed(rate=statistics.median([r["images_per_sec"] for r in rows[1:] or rows]),
                 cpu_per_image=cpu / max(trained, 1),
                 threads={name: seconds / max(trained, 1) for name, seconds in threads.items()})


def benchmark_rows(args, model_dir: str, data: list[str]) -> list[tuple[str, str]]:
    out = os.path.join(model_dir, "bench")
    run = tfdp("benchmark", f"--model={args.model}", f"--model_dir={model_dir}", f"--batch_size_per_replica={args.batch}",
               f"--set=data.image_size={args.size}", f"--set=train.precision={args.precision}", "--max_replicas=1", f"--steps={args.steps}", "--warmup_steps=5",
               f"--benchmark_dir={out}", *data)
    if run.returncode != 0:
        return [("tfdp benchmark", failure(run))]
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
    return f"{rate(full_decode(files, batch), batch, 40)[0]:,.0f}"


def split_gpu_run(n: int, memory_mb: int, argv: list[str]) -> None:
    """`tfdp ARGV` with the first GPU split into `n` logical GPUs, so `mirrored` runs n replicas on one card.

    Multi-replica code (all-reduce, per-replica batch norm, the divided global
    batch) then runs on a GPU host with one card; the replicas share the card,
    so it is a check, not a speed-up.
    """
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_logical_device_configuration(gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)] * n)
    else:  # a CPU smoke run: n logical CPUs, as tfdp splits a GPU-less host
        argv = [*argv, f"--cpu_replicas={n}"]
    sys.argv = ["tfdp", *argv]
    from tfdp.cli import run
    run()


def split_demo(model_dir: str) -> str:
    """The digits demo (configs/digits.yaml) on 2 logical GPUs of one card: its time and top-1."""
    start = time.perf_counter()
    run = tfdp("train", "--config=configs/digits.yaml", f"--model_dir={model_dir}", split=2)
    took = time.perf_counter() - start
    if run.returncode != 0:
        return failure(run)
    strategy = next((line.strip() for line in (run.stdout + run.stderr).splitlines() if "replica" in line), "?")
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    top1 = next((v for k, v in last.items() if k.startswith("val") and ("top1" in k or "accuracy" in k)), None)
    return f"{took:.0f} s, val top-1 {top1:.2%} ({strategy[:120]})" if top1 is not None else f"{took:.0f} s, no val top-1"


def scaling_rows(args, shards: str) -> list[tuple[str, str]]:
    """The input alone with the GPU hidden, pinned to 1, 4, 16, ... of the host's cores, each count in a process
    of its own (benchmarks/input_pipeline.py --streams): does the stream DALI is fed from scale with the cores,
    and does what does not scale lie in the reads or between them."""
    cores = sorted(os.sched_getaffinity(0))
    counts = sorted({n for n in (1, 4, 16, 64, len(cores)) if n <= len(cores)})
    rows = []
    for n in counts:
        run = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "input_pipeline.py"), f"--streams={shards}",
                              f"--size={args.size}", f"--batch={args.batch}", "--batches=20", "--rounds=2"],
                             cwd=REPO, capture_output=True, text=True, timeout=1800,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                             preexec_fn=lambda n=n: os.sched_setaffinity(0, cores[:n]))
        line = next((x for x in run.stdout.splitlines() if x.startswith("streams: ")), "")
        if not line:
            rows.append((f"input alone on {n} core(s)", failure(run)))
            continue
        for name, (images_per_sec, cpu_us) in json.loads(line.removeprefix("streams: ")).items():
            rows.append((f"input alone on {n} core(s): {name}", f"{images_per_sec:,} ({cpu_us} us CPU/image)"))
    return rows


def dali_alone_rows(args, shards: str) -> list[tuple[str, str]]:
    """Each dali entry of --decoder as DALI alone, on the GPU, fed from memory (benchmarks/input_pipeline.py
    --dali_alone), each in its own process: its images/s and host CPU per image, by thread. What DALI's own
    threads cost apart from tfdp's stream and from training."""
    rows = []
    for entry in [d for d in args.decoder.split(",") if d.split(":")[0] == "dali"]:
        settings = ":".join(entry.split(":")[1:])
        command = [sys.executable, os.path.join(REPO, "benchmarks", "input_pipeline.py"), f"--dali_alone={shards}",
                   f"--dali_settings={settings}", f"--size={args.size}", f"--batch={args.batch}", "--batches=20",
                   "--rounds=2"]
        threads = {}
        run = run_sampled(command, 1800, threads)
        name = f"DALI alone, rows in memory, {settings or 'defaults'}"
        line = next((x for x in run.stdout.splitlines() if x.startswith("dali_alone: ")), "")
        if not line:
            rows.append((name, failure(run)))
            continue
        images_per_sec, cpu_us = json.loads(line.removeprefix("dali_alone: "))
        rows.append((name, f"{images_per_sec:,} ({cpu_us} us CPU/image over the timed batches); the whole "
                           f"process's CPU s by thread, start-up included: " + busiest(threads, "{:.1f}")))
    return rows


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return f"no GPU ({platform.processor() or platform.machine()})"


def allocator() -> str:
    """The malloc every `tfdp` process of this run gets (tfdp.startup.allocator preloads TCMalloc if installed)."""
    from input_pipeline import allocator as of_environment
    from tfdp.startup.allocator import with_tcmalloc
    return of_environment(with_tcmalloc(os.environ) or os.environ)


SCHEDULE = "TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE"   # read by TensorFlow as it makes each GPU's CUDA context
ROWS = ("keras", "syn", "split", "demo", "nojit", "fp16", "files", "shards", "small", "benchmark", "decode", "decoders",
        "scaling", "dali_alone")


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
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which rows, in this order: {','.join(ROWS)}")
    parser.add_argument("--skip_fp16", action="store_true", help="leave out the mixed_float16 row (emulated on CPUs)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd",
                        help="both sides' optimizer: sgd (momentum 0.9) or adamw (weight decay 0.05)")
    parser.add_argument("--decoder", default="tf,dali", help="the decoders row's data.decoder values, in this order; "
                        "an entry may add data settings: dali:dali_threads=16:dali_hw_decoder_load=0.9")
    parser.add_argument("--decoder_models", default="resnet50,resnet18", help="the decoders row's models")
    parser.add_argument("--gpu_schedule", default="", choices=["", "spin", "yield", "blocking_sync"],
                        help="how every process's CUDA calls wait for the GPU (TensorFlow's "
                        "TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE; DALI shares the context): default CUDA's own choice, "
                        "which spins on a host with more cores than contexts")
    parser.add_argument("--plain_keras_probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--split_gpu", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--split_memory_mb", type=int, default=30_000, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="", help="keep the real data (and the decoders row's synthetic runs) here "
                        "and reuse them in later invocations; default: a temporary folder")
    parser.add_argument("--data_only", action="store_true", help="make the real data in --workdir, then stop")
    args, rest = parser.parse_known_args()
    if args.data_only and not args.workdir:
        parser.error("--data_only needs --workdir: without it the data goes into a temporary folder and is deleted")
    if args.plain_keras_probe:
        return plain_keras_probe(args)
    if args.split_gpu:
        return split_gpu_run(args.split_gpu, args.split_memory_mb, [a for a in rest if a != "--"])
    wanted = [r for r in args.rows.split(",") if r and not (r == "fp16" and args.skip_fp16)]
    unknown = set(wanted) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}: choose from {','.join(ROWS)}")

    if args.gpu_schedule:   # before any child starts: they inherit it
        os.environ[SCHEDULE] = args.gpu_schedule
    waits = os.environ.get(SCHEDULE, "CUDA auto")
    print(f"# {device_name()}, {os.cpu_count()} CPUs, {allocator()}, GPU waits: {waits}; {args.model}, "
          f"batch {args.batch} per device, "
          f"{args.size} px, {args.precision}, {args.optimizer}\n\n| run | images/s |\n|---|---|", flush=True)
    with (contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory()) as work:
        start = time.perf_counter()
        synthetic = ["--data_format=synthetic", f"--set=data.synthetic_examples={args.batch * 60}",
                     "--set=model.num_classes=1000"]
        measured: dict[str, float] = {}   # the plain Keras row's rate, once measured
        run = lambda name, *extra, split=0: train_rate(args, os.path.join(work, name), *extra, split=split,  # noqa: E731
                                                       versus=measured)
        real = {}

        def data(kind: str) -> list[str]:
            """The real-data flags; the JPEGs written, and a set of shards converted, on first use (in `work`, by
            an earlier invocation or now: `input_pipeline.make_data`)."""
            if kind not in real:
                from input_pipeline import SHARD_SETS, make_data
                made = make_data(work, args.images, args.max_side, sets=(kind,) if kind in SHARD_SETS else ())
                classes = f"--set=model.num_classes={len(os.listdir(os.path.join(made['tree'], 'train')))}"
                real["files"] = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(made["tree"], "train")) for f in fs]
                real["tree"] = [f"--data_dir={made['tree']}", "--data_format=imagenet", classes]
                real.update({name: [f"--data_dir={made[name]}", "--data_format=tfrecord", classes]
                             for name in SHARD_SETS if name in made})
            return real[kind]

        def shard_dir() -> str:
            return data("shards")[0].removeprefix("--data_dir=")

        measure = {
            "keras": lambda: [("plain Keras fit, jit_compile=True, one device, synthetic",
                               plain_keras_rate(args, measured))],
            "syn": lambda: [("tfdp train, synthetic, XLA auto", run("syn", synthetic))],
            "split": lambda: [("tfdp train, synthetic, XLA auto, 2 logical GPUs on one card (mirrored, same global batch)",
                               run("split", synthetic, split=2))],
            "demo": lambda: [("digits demo (configs/digits.yaml), 2 logical GPUs on one card", split_demo(
                os.path.join(work, "demo")))],
            "nojit": lambda: [("tfdp train, synthetic, train.jit_compile false",
                               run("syn-nojit", synthetic, "--set=train.jit_compile=false"))],
            "fp16": lambda: [("tfdp train, synthetic, XLA, mixed_float16",
                              run("syn-fp16", synthetic, "--set=train.precision=mixed_float16"))],
            "files": lambda: [(f"tfdp train, {len(data('files')):,} JPEG files (first process after "
                               "writing them)", run("files", data("tree")))],
            "shards": lambda: [("tfdp train, TFRecord shards, full size", run("shards", data("shards")))],
            "small": lambda: [(f"tfdp train, TFRecord shards, longer side {args.max_side}", run("small", data("small")))],
            "benchmark": lambda: benchmark_rows(args, os.path.join(work, "bench"), data("shards")),
            "decode": lambda: [("full JPEG decode alone, same files", full_decode_rate(data("files"), args.batch))],
            "decoders": lambda: decoder_rows(args, work, data("shards"), len(data("files"))),
            "scaling": lambda: scaling_rows(args, shard_dir()),
            "dali_alone": lambda: dali_alone_rows(args, shard_dir()),
        }
        if args.data_only:
            data("shards")
            print(f"data in {work}: {len(real['files']):,} JPEG files and their shards, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
            return
        for row in wanted:
            for name, value in measure[row]():
                print(f"| {name} | {value} |", flush=True)
        print(f"\n{(time.perf_counter() - start) / 60:.1f} min", flush=True)

if __name__ == "__main__":
    main()
