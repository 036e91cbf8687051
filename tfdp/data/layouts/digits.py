"""Writes scikit-learn's handwritten digits as an ImageNet-style JPEG tree.

The 1,797 digits ship inside the scikit-learn wheel, so the demo needs no
download. Each 8x8 digit is upsampled to 32x32 RGB (the originals were 32x32
bitmaps, averaged down by the UCI authors) and written as
`<split>/<class>/digits_<index>.JPEG`, the class-folder layout every loader
understands. The validation split is a fixed, stratified 20% so numbers from
different runs and machines compare.

Run directly: `python -m tfdp.data.layouts.digits --out DIR`.
"""

from __future__ import annotations

import argparse
import os
import shutil

import numpy as np
from tfdp.startup.console import say

IMAGE_SIDE = 32
VAL_FRACTION = 0.2
SPLIT_SEED = 0
CLASS_NAMES = tuple(str(d) for d in range(10))


def split_indices(labels: np.ndarray) -> dict[str, np.ndarray]:
    """Stratified, seeded train/val split of the digit indices."""
    from sklearn.model_selection import train_test_split
    idx = np.arange(len(labels))
    train, val = train_test_split(idx, test_size=VAL_FRACTION, random_state=SPLIT_SEED, stratify=labels)
    return {"train": np.sort(train), "val": np.sort(val)}


def to_rgb_image(digit: np.ndarray):
    """0..16 ink counts on an 8x8 grid → a 32x32 RGB PIL image."""
    from PIL import Image
    grey = Image.fromarray(np.round(digit * (255.0 / 16.0)).astype(np.uint8), mode="L")
    return grey.resize((IMAGE_SIDE, IMAGE_SIDE), Image.BICUBIC).convert("RGB")


def write_digits(out_dir: str, progress: bool = True) -> dict[str, int]:
    """Writes the tree atomically: it appears under `out_dir` only when complete."""
    from sklearn.datasets import load_digits
    from tqdm import tqdm

    digits = load_digits()
    splits = split_indices(digits.target)
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    tmp_dir = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    total = sum(len(v) for v in splits.values())
    with tqdm(total=total, desc="writing digits", unit="img", disable=not progress) as bar:
        for split, indices in splits.items():
            for name in CLASS_NAMES:
                os.makedirs(os.path.join(tmp_dir, split, name), exist_ok=True)
            for i in indices:
                label = CLASS_NAMES[digits.target[i]]
                path = os.path.join(tmp_dir, split, label, f"digits_{i:04d}.JPEG")
                to_rgb_image(digits.images[i]).save(path, format="JPEG", quality=95)
                bar.update(1)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    try:
        os.rename(tmp_dir, out_dir)
    except OSError:
        if not os.path.isdir(out_dir):
            raise
        shutil.rmtree(tmp_dir)  # another process (a second worker) finished the same tree first
    return {split: len(v) for split, v in splits.items()}


def ensure_digits(out_dir: str, progress: bool = True) -> str:
    """Creates the demo tree on first use; later calls find it and return at once."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    if not os.path.isdir(out_dir):
        write_digits(out_dir, progress=progress)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to create")
    args = parser.parse_args()
    if os.path.exists(args.out):
        parser.error(f"{args.out} already exists")
    counts = write_digits(args.out)
    say(" ".join(f"{k}={v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
