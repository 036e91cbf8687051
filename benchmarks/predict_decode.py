"""Images/s of two ways to keep a row for an image that cannot be decoded, on the same JPEG files.

- "per-image guard": each image decoded in a one-element dataset with
  `ignore_errors`, followed by a fallback element (a blank image and a
  py_function that records the reason) that only runs when the decode failed;
  the failure stays in the stream.
- "listing + map" (what `tfdp predict` does, `tfdp.data.pipeline.prediction_dataset`):
  one parallel map with `ignore_errors`, images carried with their numbers;
  the rows are made from the listing, and a number that does not come back is
  explained afterwards by decoding that file again.

Decode and central crop included, no model. Rounds alternate so both see the
same machine load.

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
    from tfdp.data.decoding import decode_calls
    from tfdp.data.preprocess import eval_transform
    from tfdp.data.pipeline import prediction_dataset

    cfg = DataConfig(image_size=args.size)
    transform = eval_transform(cfg)
    with tempfile.TemporaryDirectory() as folder:
        paths = write_jpegs(folder, args.images, args.width, args.height)
        blank = tf.zeros([args.size, args.size, 3], tf.uint8)

        def guard(number, path):
            decoded = tf.data.Dataset.from_tensors((number, path)).map(
                lambda k, p: (k, transform(tf.io.read_file(p), k))).ignore_errors()
            fallback = tf.data.Dataset.from_tensors((number, path)).map(
                lambda k, p: (tf.py_function(lambda *_: -1, [k, p], tf.int64), blank))
            return decoded.concatenate(fallback).take(1)
        calls = decode_calls()
        guarded = tf.data.Dataset.from_tensor_slices(paths).enumerate().interleave(
            guard, cycle_length=calls, block_length=1, num_parallel_calls=calls, deterministic=True).batch(32)
        listed = prediction_dataset(paths, cfg, 32, tf.distribute.InputContext())
        rates = {"per-image guard": [], "listing + map (tfdp predict)": []}
        for _ in range(args.rounds):
            for name, ds in zip(rates, (guarded, listed)):
                start = time.perf_counter()
                for _ in ds:
                    pass
                rates[name].append(args.images / (time.perf_counter() - start))
    print(f"{args.images} JPEGs {args.width}x{args.height} → {args.size} px, {os.cpu_count()} CPU(s), "
          f"{args.rounds} rounds (best, median)")
    for name, values in rates.items():
        values.sort()
        print(f"  {name:30s} {values[-1]:7.0f} {values[len(values) // 2]:7.0f} images/s")


if __name__ == "__main__":
    main()
