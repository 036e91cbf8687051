"""Small ImageNet-shaped datasets made from the real photos shipped in PyPI wheels.

No dataset can be downloaded here, yet the data layer must be exercised on
real JPEG files in the real ILSVRC2012 layouts. scikit-image and scikit-learn
ship a dozen real photographs; this module cuts ImageNet-sized images (about
500x375, JPEG quality 98, ~100 KB) out of them and writes:

- the image-net.org layout: `train/<wnid>/<wnid>_<n>.JPEG`, a flat `val/`,
  and the devkit's `ILSVRC2012_validation_ground_truth.txt` + `meta.mat`
  (with ILSVRC2012_IDs deliberately *not* in synset order, as in the real one);
- the Kaggle layout: `LOC_synset_mapping.txt`, `LOC_{train,val}_solution.csv`
  (with boxes), images under `ILSVRC/Data/CLS-LOC/`.

Class k is cut from photo k, so a model can really learn the task. The synset
ids are ImageNet's first ones in sorted order, so TFDS `imagenet2012` gives
them the same labels.

Run directly: `PYTHONPATH=tests python -m support.photos --out DIR --layout ilsvrc`.
"""

from __future__ import annotations

import argparse
import csv
import io
import os

import numpy as np

# ImageNet's first synsets in sorted order (labels 0..11 in every layout and in TFDS imagenet2012).
SYNSETS = (
    ("n01440764", "tench, Tinca tinca"), ("n01443537", "goldfish, Carassius auratus"),
    ("n01484850", "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias"),
    ("n01491361", "tiger shark, Galeocerdo cuvieri"), ("n01494475", "hammerhead, hammerhead shark"),
    ("n01496331", "electric ray, crampfish, numbfish, torpedo"), ("n01498041", "stingray"),
    ("n01514668", "cock"), ("n01514859", "hen"), ("n01518878", "ostrich, Struthio camelus"),
    ("n01530575", "brambling, Fringilla montifringilla"), ("n01531178", "goldfinch, Carduelis carduelis"),
)
SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "retina", "brick", "grass",
                  "gravel", "camera")
IMAGENET_SIZE = (500, 375)


def real_photos() -> list[np.ndarray]:
    """The real photographs in the scikit-image and scikit-learn wheels, as RGB uint8 arrays."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    photos = list(load_sample_images().images)
    for name in SKIMAGE_PHOTOS:
        image = getattr(skimage.data, name)()
        photos.append(np.stack([image] * 3, -1) if image.ndim == 2 else image[..., :3])
    return photos


def photo_jpeg(photo: np.ndarray, rng: np.random.Generator, size=IMAGENET_SIZE, quality: int = 98) -> bytes:
    """A random crop of `photo`, resized to `size` (or its transpose) and encoded as JPEG."""
    from PIL import Image

    h, w = photo.shape[:2]
    scale = rng.uniform(0.6, 1.0)
    ch, cw = int(h * scale), int(w * scale)
    y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
    target = size if rng.random() < 0.7 else size[::-1]
    image = Image.fromarray(photo[y:y + ch, x:x + cw]).resize(target, Image.BICUBIC)
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()


def write_imagenet_tree(out: str, num_classes: int = 3, train_per_class: int = 4, val_per_class: int = 2,
                        layout: str = "ilsvrc", size=IMAGENET_SIZE, seed: int = 0) -> dict[str, dict[str, str]]:
    """Writes a small raw ILSVRC2012 tree; returns {split: {file name: synset}} as ground truth."""
    if layout not in ("ilsvrc", "kaggle"):
        raise ValueError(f"layout must be ilsvrc or kaggle, not {layout}")
    if not 1 <= num_classes <= len(SYNSETS):
        raise ValueError(f"num_classes must be 1..{len(SYNSETS)}")
    rng = np.random.default_rng(seed)
    photos = real_photos()
    synsets = [s for s, _ in SYNSETS[:num_classes]]
    images = os.path.join(out, "ILSVRC/Data/CLS-LOC") if layout == "kaggle" else out
    truth: dict[str, dict[str, str]] = {"train": {}, "val": {}}
    for label, synset in enumerate(synsets):
        os.makedirs(os.path.join(images, "train", synset), exist_ok=True)
        for n in range(train_per_class):
            name = f"{synset}_{n + 1}.JPEG"
            _write(os.path.join(images, "train", synset, name), photo_jpeg(photos[label % len(photos)], rng, size))
            truth["train"][name] = synset
    os.makedirs(os.path.join(images, "val"), exist_ok=True)
    for number in range(1, num_classes * val_per_class + 1):
        label = (number * 7) % num_classes  # interleaved, not grouped by class
        name = f"ILSVRC2012_val_{number:08d}.JPEG"
        _write(os.path.join(images, "val", name), photo_jpeg(photos[label % len(photos)], rng, size))
        truth["val"][name] = synsets[label]
    if layout == "kaggle":
        _write_kaggle_labels(out, truth, rng, size)
    else:
        _write_devkit(os.path.join(out, "ILSVRC2012_devkit_t12", "data"), truth["val"])
    return truth


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _write_devkit(folder: str, val_truth: dict[str, str]) -> None:
    """meta.mat (leaf synsets with ILSVRC2012_IDs in reverse synset order, plus one non-leaf) and the ground truth."""
    import scipy.io

    os.makedirs(folder, exist_ok=True)
    dtype = [("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("gloss", "O"), ("num_children", "O"),
             ("children", "O"), ("wordnet_height", "O"), ("num_train_images", "O")]
    leaves = list(reversed(SYNSETS))
    rows = [(i + 1, wnid, words, "", 0, np.zeros(0), 0, 0) for i, (wnid, words) in enumerate(leaves)]
    rows.append((len(rows) + 1, "n00001740", "entity", "", len(leaves), np.arange(1, len(leaves) + 1), 19, 0))
    scipy.io.savemat(os.path.join(folder, "meta.mat"), {"synsets": np.array(rows, dtype=dtype)})
    ids = {wnid: i + 1 for i, (wnid, _) in enumerate(leaves)}
    lines = [str(ids[val_truth[name]]) for name in sorted(val_truth)]
    with open(os.path.join(folder, "ILSVRC2012_validation_ground_truth.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _write_kaggle_labels(out: str, truth: dict[str, dict[str, str]], rng: np.random.Generator, size) -> None:
    with open(os.path.join(out, "LOC_synset_mapping.txt"), "w") as f:
        f.writelines(f"{wnid} {words}\n" for wnid, words in SYNSETS)
    for split in ("train", "val"):
        with open(os.path.join(out, f"LOC_{split}_solution.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["ImageId", "PredictionString"])
            for name, synset in sorted(truth[split].items()):
                boxes = []
                for _ in range(int(rng.integers(1, 3))):
                    x0, y0 = rng.integers(0, size[0] // 2), rng.integers(0, size[1] // 2)
                    boxes.append(f"{synset} {x0} {y0} {x0 + size[0] // 3} {y0 + size[1] // 3}")
                writer.writerow([os.path.splitext(name)[0], " ".join(boxes)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layout", choices=("ilsvrc", "kaggle"), default="ilsvrc")
    parser.add_argument("--classes", type=int, default=len(SYNSETS))
    parser.add_argument("--train_per_class", type=int, default=40)
    parser.add_argument("--val_per_class", type=int, default=10)
    args = parser.parse_args()
    write_imagenet_tree(args.out, args.classes, args.train_per_class, args.val_per_class, args.layout)
    print(f"wrote a {args.layout} tree of {args.classes} classes to {args.out}")


if __name__ == "__main__":
    main()
