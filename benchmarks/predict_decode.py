"""Images/s of `tfdp predict`'s guarded decode against evaluation's plain decode, on the same JPEG files.

Evaluation decodes in one parallel map and drops an image that fails
(`ignore_errors`): its row would be lost. `tfdp predict` decodes each image in
its own one-element dataset (`tfdp.predict.prediction_dataset`) so a failure
becomes a row with its error; this measures what that costs per image, decode
and central crop included, no model. Rounds alternate so both see the same
machine load.

  python benchmarks/predict_decode.py [--images=256 --width=500 --height=375 --size=224 --rounds=3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def write_jpegs(folder: str, n: int, width: int, height: int) -> list[str]:
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    paths = []
    for i in range(n):
        phase = rng.uniform(0, 6.3, 3)
        image = np.stack([127 + 120 * np.sin(x / (20 + 7 * c) + y / (31 + 5 * c) + phase[c]) for c in range(3)], -1)
        path = os.path.join(folder, f"{i:05d}.jpg")
        Image.fromarray(image.astype(np.uint8)).save(path, quality=90)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import tensorflow as tf

    from tfdp.config import DataConfig
    from tfdp.data.pipeline import _decode_calls
    from tfdp.data.preprocess import eval_transform
    from tfdp.predict import prediction_dataset

    cfg = DataConfig(image_size=args.size)
    transform = eval_transform(cfg)
    with tempfile.TemporaryDirectory() as folder:
        paths = write_jpegs(folder, args.images, args.width, args.height)
        plain = tf.data.Dataset.from_tensor_slices(paths).enumerate().map(
            lambda i, p: (i, transform(tf.io.read_file(p), i)), num_parallel_calls=_decode_calls(),
            deterministic=True).ignore_errors().batch(32)
        guarded = prediction_dataset(paths, cfg, 32, tf.distribute.InputContext(), lambda k, p: -1)
        rates = {"evaluation (map, ignore_errors)": [], "predict (guarded, a row per image)": []}
        for _ in range(args.rounds):
            for name, ds in zip(rates, (plain, guarded)):
                start = time.perf_counter()
                for _ in ds:
                    pass
                rates[name].append(args.images / (time.perf_counter() - start))
    print(f"{args.images} JPEGs {args.width}x{args.height} → {args.size} px, {os.cpu_count()} CPU(s), "
          f"{args.rounds} rounds (best, median)")
    for name, values in rates.items():
        values.sort()
        print(f"  {name:38s} {values[-1]:7.0f} {values[len(values) // 2]:7.0f} images/s")


if __name__ == "__main__":
    main()
