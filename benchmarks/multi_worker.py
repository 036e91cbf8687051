"""2 workers on loopback beside 1 process with 2 replicas: images/s and all-reduce time per step.

Same model, data, global batch and epochs in both layouts, measured in one
run. Training throughput is the last epoch's rate from `metrics.jsonl` (the
first epoch includes tracing). The all-reduce time is measured on its own: a
step that only all-reduces tensors shaped like the model's trainable
variables (what a training step sends), timed over `--reduce_steps` steps.

  python benchmarks/multi_worker.py [--model=simple_cnn] [--image_size=32] [--global_batch=64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def train_rate(args, workdir: str, multi_worker: bool) -> float:
    model_dir = os.path.join(workdir, "mw" if multi_worker else "mirrored")
    train = ["train", "--config=configs/digits.yaml", f"--model_dir={model_dir}", f"--model={args.model}",
             f"--epochs={args.epochs}", f"--set=data.image_size={args.image_size}", "--set=schedule.warmup_epochs=0",
             f"--batch_size_per_replica={args.global_batch // 2}"]
    cmd = (["launch", "--workers=2", f"--launch_logs={workdir}/logs", "--", *train] if multi_worker
           else [*train, "--strategy=mirrored", "--cpu_replicas=2"])
    subprocess.run([sys.executable, "-m", "tfdp", *cmd], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f][-1]["images_per_sec"]


def reduce_ms(args, multi_worker: bool) -> float:
    """Starts the probe (2 processes with TF_CONFIG, or 1 with 2 logical CPUs); returns ms per all-reduce."""
    probe = [sys.executable, os.path.abspath(__file__), "--probe", f"--model={args.model}",
             f"--image_size={args.image_size}", f"--reduce_steps={args.reduce_steps}"]
    if not multi_worker:
        out = subprocess.run(probe + ["--strategy=mirrored"], cwd=REPO, check=True, capture_output=True, text=True)
        return float(out.stdout.split()[-1])
    from tfdp.distribute.cluster import free_ports
    addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
    procs = [subprocess.Popen(probe + ["--strategy=multi_worker"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "TF_CONFIG": json.dumps(
                                  {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}})})
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return float(outs[0].split()[-1])


def probe(args) -> None:
    import tfdp  # noqa: F401
    from tfdp.config import DistributeConfig, validate
    from tfdp.distribute.strategy import make_runtime
    runtime = make_runtime(DistributeConfig(strategy=args.strategy, cpu_replicas=2))
    import tensorflow as tf

    from tfdp.models import build_model
    cfg = validate({"model": {"name": args.model}, "data": {"image_size": args.image_size}})
    with runtime.strategy.scope():
        shapes = [v.shape for v in build_model(cfg.model, cfg.data).trainable_weights]

    @tf.function
    def step():
        def reduce():
            grads = [tf.ones(s) for s in shapes]
            return tf.distribute.get_replica_context().all_reduce("SUM", grads)[0][..., :1]
        return runtime.strategy.run(reduce)

    step()
    start = time.perf_counter()
    for _ in range(args.reduce_steps):
        out = step()
    runtime.strategy.experimental_local_results(out)[0].numpy()
    print(f"{1000 * (time.perf_counter() - start) / args.reduce_steps:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="simple_cnn")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--global_batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--reduce_steps", type=int, default=50)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="mirrored", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        return probe(args)
    with tempfile.TemporaryDirectory() as workdir:
        rows = [(name, train_rate(args, workdir, mw), reduce_ms(args, mw))
                for name, mw in (("1 process x 2 replicas", False), ("2 workers x 1 replica", True))]
    print(f"model {args.model}, {args.image_size} px, global batch {args.global_batch}, epoch {args.epochs} timed")
    print(f"{'layout':<24} {'images/s':>9} {'all-reduce ms/step':>19}")
    for name, rate, ms in rows:
        print(f"{name:<24} {rate:>9.1f} {ms:>19.2f}")
    print(f"ratio 2 workers / 1 process: {rows[1][1] / rows[0][1]:.2f}x images/s, "
          f"{rows[1][2] / rows[0][2]:.1f}x all-reduce time")


if __name__ == "__main__":
    main()
