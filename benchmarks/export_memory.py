"""Peak memory of `tfdp export`, per format, against the model's size.

Each (model, format) runs in a fresh process: the registry model, randomly
initialised (nothing to download, no training), at a small image size and
10 classes, is written in that one format by `tfdp.commands.export.export`, as
`tfdp export --format=...` writes it. The process reports its resident
memory before the export (TensorFlow and the Keras model) and its peak
(`ru_maxrss`), so the table shows what the export itself adds, next to the
float32 weights' bytes and the bound `tfdp.commands.export.onnx_memory_bound` states
for ONNX. A watchdog kills a process whose resident memory passes
`--limit_gb`, so a runaway conversion cannot take a shared machine down; it
is reported as "killed". The figures go to docs/benchmarks.md.

  python benchmarks/export_memory.py [--models=vgg11_bn,vgg16,efficientnetv2_l] [--formats=onnx,litert]
                                     [--size=32] [--limit_gb=16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LARGE = ("vgg11_bn", "vgg16", "vgg19_bn", "efficientnetv2_l", "resnet152", "resnext50_32x4d")
FORMATS = ("saved_model", "keras", "onnx", "litert")


def child(model: str, fmt: str, size: int, out: str) -> None:
    """Runs in the measured process: build, export one format, print one JSON line."""
    import resource

    import tfdp  # noqa: F401  (TensorFlow's environment defaults)
    from tfdp.startup.console import import_tensorflow
    import_tensorflow()
    import keras

    from tfdp.config import validate
    from tfdp.commands.export import export, inference_network, onnx_memory_bound, weight_bytes
    from tfdp.train.task import serving_model

    cfg = validate({"model_dir": out, "model": {"name": model, "num_classes": 10},
                    "data": {"format": "synthetic", "image_size": size, "eval_crop_fraction": 1.0}})
    keras.utils.set_random_seed(0)
    network = serving_model(cfg)
    weights = weight_bytes(inference_network(network, portable=False))
    before = _rss()
    start = time.perf_counter()
    written = export(network, cfg, tuple(map(str, range(10))), out, (fmt,))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    files = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(json.dumps({"params": network.count_params(), "weights": weights, "before": before, "peak": peak,
                      "seconds": seconds, "bound": onnx_memory_bound(weights), "bytes_written": files,
                      "failed": written.failed.get(fmt)}), flush=True)


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def measure(model: str, fmt: str, size: int, limit: float) -> dict:
    """One fresh process under the watchdog; its JSON line, or {"killed": peak seen}."""
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.Popen([sys.executable, __file__, "--child", model, fmt, str(size), out],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                                start_new_session=True)
        seen, killed = [0], [False]

        def watch():
            while proc.poll() is None:
                try:
                    with open(f"/proc/{proc.pid}/status", encoding="ascii") as f:
                        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
                except (OSError, StopIteration):
                    break
                seen[0] = max(seen[0], rss)
                if rss > limit:
                    killed[0] = True
                    os.killpg(proc.pid, signal.SIGKILL)
                time.sleep(0.1)
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        stdout, _ = proc.communicate()
        thread.join()
    if killed[0]:
        return {"killed": seen[0]}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(LARGE[:4]))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--limit_gb", type=float, default=16.0)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, fmt, size, out = args.child
        child(model, fmt, int(size), out)
        return
    gib = 2 ** 30
    print(f"| model | params | weights (GiB) | format | before export (GiB) | peak (GiB) | added (GiB) | "
          f"added / weights | ONNX bound (GiB) | seconds |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        for fmt in args.formats.split(","):
            r = measure(model, fmt, args.size, args.limit_gb * gib)
            if "killed" in r:
                print(f"| {model} | | | {fmt} | | > {r['killed'] / gib:.2f} (killed) | | | | |", flush=True)
                continue
            if "error" in r:
                print(f"| {model} | | | {fmt} | | exit {r['error']} | | | | |", flush=True)
                continue
            added = r["peak"] - r["before"]
            status = f" (failed: {r['failed']})" if r["failed"] else ""
            print(f"| {model} | {r['params']:,} | {r['weights'] / gib:.3f} | {fmt}{status} | {r['before'] / gib:.2f} | "
                  f"{r['peak'] / gib:.2f} | {added / gib:.2f} | {added / r['weights']:.1f} | "
                  f"{r['bound'] / gib:.2f} | {r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
