"""Inference time of the exported files, float32 against quantized, each in its own runtime, side by side.

Each model of the registry, randomly initialised at `--size` px (nothing to download, no training: the timing
does not depend on the weights' values), is written by `tfdp.commands.export.export` in the pixel formats, as
`tfdp export --format=onnx,onnx_int8,litert,litert_float16,litert_int8` writes them; the int8 files are
calibrated on the synthetic split's images (noise: their agreement here means nothing, their speed does). Then
each file runs the same uint8 batch, the formats of a runtime taking turns for `--rounds` rounds of
`--seconds` each: LiteRT's interpreter (XNNPACK, its default delegate) and ONNX Runtime's CPU provider, both
on `--threads` threads. The table gives the best round's milliseconds per image and the speed-up over the
runtime's float32 file. The figures go to docs/export.md.

  python benchmarks/export_speed.py [--models=resnet50_v1_5,mobilenet_v2] [--size=224] [--batches=1,8]
                                    [--threads=2] [--seconds=3] [--rounds=2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# runtime → its formats, the float32 one first (the reference of the speed-up)
RUNTIMES = {"LiteRT": ("litert", "litert_float16", "litert_int8"), "ONNX Runtime": ("onnx", "onnx_int8")}


def exported_files(model: str, size: int, out: str) -> dict[str, str]:
    """format → the file `tfdp export` writes for `model` with random weights."""
    import keras

    from tfdp.commands.export import FORMATS, export
    from tfdp.config import validate
    from tfdp.train.task import serving_model
    cfg = validate({"model_dir": out, "model": {"name": model, "num_classes": 1000},
                    "data": {"format": "synthetic", "image_size": size, "eval_crop_fraction": 1.0,
                             "synthetic_examples": 512}})
    keras.utils.set_random_seed(0)
    formats = tuple(f for group in RUNTIMES.values() for f in group)
    written = export(serving_model(cfg), cfg, tuple(map(str, range(1000))), out, formats)
    if written.failed:
        raise SystemExit(written.failure_line())
    return {f: os.path.join(out, FORMATS[f].filename) for f in formats}


def litert_runner(path: str, images, threads: int):
    from ai_edge_litert.interpreter import Interpreter
    interpreter = Interpreter(model_path=path, num_threads=threads)
    index = interpreter.get_input_details()[0]["index"]
    interpreter.resize_tensor_input(index, images.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(index, images)
    return interpreter.invoke


def onnx_runner(path: str, images, threads: int):
    import onnxruntime
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, {"image": images})


RUNNERS = {"LiteRT": litert_runner, "ONNX Runtime": onnx_runner}


def ms_per_image(run, batch: int, seconds: float) -> float:
    run(), run()   # warm: the first calls plan and allocate
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run()
        calls += 1
    return (time.perf_counter() - start) / calls / batch * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50_v1_5,mobilenet_v2")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import numpy as np

    import tfdp  # noqa: F401  (TensorFlow's environment defaults)
    from tfdp.startup.console import import_tensorflow
    import_tensorflow()
    print(f"{os.cpu_count()} cores, {args.threads} threads per runtime, {args.size} px, best of {args.rounds} "
          f"rounds of {args.seconds:g} s")
    print("| model | runtime | file | MB | " + " | ".join(f"batch {b}: ms/image (x float32)"
                                                     for b in args.batches.split(",")) + " |")
    print("| --- | --- | --- | ---: | " + " | ".join("---:" for _ in args.batches.split(",")) + " |")
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as out:
            files = exported_files(model, args.size, out)
            for runtime, formats in RUNTIMES.items():
                best = {f: {} for f in formats}
                for batch in map(int, args.batches.split(",")):
                    images = np.random.default_rng(0).integers(0, 256, (batch, args.size, args.size, 3), np.uint8)
                    runs = {f: RUNNERS[runtime](files[f], images, args.threads) for f in formats}
                    for _ in range(args.rounds):   # the formats take turns, so a slower spell of the host hits all
                        for f in formats:
                            ms = ms_per_image(runs[f], batch, args.seconds)
                            best[f][batch] = min(best[f].get(batch, ms), ms)
                for f in formats:
                    cells = [f"{ms:.1f} ({best[formats[0]][b] / ms:.2f}x)" for b, ms in best[f].items()]
                    print(f"| {model} | {runtime} | {os.path.basename(files[f])} | "
                          f"{os.path.getsize(files[f]) / 1e6:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
