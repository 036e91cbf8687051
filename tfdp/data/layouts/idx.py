"""IDX files: MNIST, Fashion-MNIST, KMNIST and EMNIST as their authors ship them, read as pixels.

A split is a pair of files in `data.dir`, gzipped or not:
`<prefix>-images-idx3-ubyte[.gz]` (a big-endian header, then n x rows x
columns uint8 pixels) and `<prefix>-labels-idx1-ubyte[.gz]` (a header, then n
uint8 labels). The split `train` reads the prefix `train`; `val` and `test`
read `t10k` (MNIST's, Fashion-MNIST's and KMNIST's test files) or `test`; any
other split name is the prefix itself (EMNIST's `emnist-letters-train`). The
folder Keras' `fashion_mnist.load_data()` and `mnist.load_data()` cache their
downloads in (~/.keras/datasets/fashion-mnist, ...) and the one Debian's
`dataset-fashion-mnist` installs (/usr/share/datasets/fashion-mnist) are such
folders.

The pixels go into the pipeline as they are: no image is encoded and decoded
again. The source only lists the files, reads the labels (they are small,
and a bad one is found before TensorFlow starts) and the images' header; the
reader (`tfdp.data.readers`) loads the pixels into memory, the greyscale
channel replicated to the pipeline's three. Class names come from the folder's
name where the dataset is known (`DATASETS`), else they are the label numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import posixpath
import struct
import zlib

import numpy as np

from tfdp.data.layouts import Source, Split, file_names
from tfdp.data.storage import filesystem, localize, url
from tfdp.errors import UserError

# IDX's magic number: two zero bytes, the element type (0x08: unsigned byte), the number of dimensions.
UNSIGNED_BYTE = 0x08
IMAGE_DIMENSIONS = 3   # count, rows, columns
LABEL_DIMENSIONS = 1   # count

# split name → the file prefixes it reads, first found first; any other split name is its own prefix.
SPLIT_PREFIXES = {"train": ("train",), "val": ("t10k", "test"), "test": ("t10k", "test")}

FASHION_MNIST = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                 "Ankle boot")
# KMNIST's classmap.csv: the ten hiragana, romanised
KMNIST = ("o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo")
DIGITS = tuple(str(d) for d in range(10))
# a word in data.dir's last folder name → the dataset's class names, the first word found deciding (fashion-mnist
# before mnist). EMNIST's splits number their classes differently: their names are the label numbers.
DATASETS = {"fashion": FASHION_MNIST, "kmnist": KMNIST, "emnist": (), "mnist": DIGITS}


@dataclasses.dataclass(frozen=True)
class IdxPair:
    """One split's two files (as the user writes them: a local path or a bucket URL) and its image side."""
    images: str
    labels: str
    rows: int
    columns: int


def idx_source(data_dir: str, split_names: tuple[str, ...]) -> Source:
    """The splits' IDX file pairs in `data_dir`, each checked (magic numbers, counts, labels) before training."""
    fs, root = filesystem(data_dir)
    if not fs.isdir(root):
        raise UserError(f"data directory not found: {url(fs, root)}")
    present = file_names(fs, root)
    known = known_classes(root)
    splits, labels = {}, {}
    for name in split_names:
        pair, split_labels = split_pair(fs, root, name, present)
        splits[name] = Split(name=name, files=(pair.images,), counts=(len(split_labels),), idx=pair)
        labels[name] = split_labels
    class_names = known or tuple(str(c) for c in range(max(int(v.max(initial=0)) for v in labels.values()) + 1))
    for name, split_labels in labels.items():
        check_labels(split_labels, len(class_names), splits[name].idx.labels)
    return Source(class_names=class_names, splits=splits, class_text=class_names)


def known_classes(root: str) -> tuple[str, ...]:
    """The class names of the dataset `root`'s folder name says it is; () when it names none."""
    folder = posixpath.basename(root.rstrip("/")).lower()
    return next((names for word, names in DATASETS.items() if word in folder), ())


def split_pair(fs, root: str, name: str, present: set[str]) -> tuple[IdxPair, np.ndarray]:
    """Split `name`'s (files, labels): its image file's header and its label file read and checked."""
    prefixes = SPLIT_PREFIXES.get(name, (name,))
    for prefix in prefixes:
        images, labels = (idx_file(prefix, kind, present) for kind in ("images-idx3", "labels-idx1"))
        if images and labels:
            break
    else:
        wanted = " or ".join(f"{p}-images-idx3-ubyte[.gz] and {p}-labels-idx1-ubyte[.gz]" for p in prefixes)
        raise UserError(f"split '{name}': {url(fs, root)} has no {wanted}")
    images, labels = (url(fs, posixpath.join(root, f)) for f in (images, labels))
    label_values = read_labels(labels)
    count, rows, columns = image_header(images)
    if count != len(label_values):
        raise UserError(f"split '{name}': {images} holds {count} images but {labels} {len(label_values)} labels")
    return IdxPair(images, labels, rows, columns), label_values


def idx_file(prefix: str, kind: str, present: set[str]) -> str:
    """The name of `<prefix>-<kind>-ubyte`, gzipped or not, among `present` ('' when neither is)."""
    plain = f"{prefix}-{kind}-ubyte"
    return next((f for f in (plain, plain + ".gz") if f in present), "")


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    if len(labels) and int(labels.max()) >= num_classes:
        raise UserError(f"{where}: label {int(labels.max())} is outside the dataset's {num_classes} classes "
                        f"(0..{num_classes - 1})")


def read_labels(path: str) -> np.ndarray:
    """A label file's labels (uint8), its header and length checked."""
    shape, body = read_idx(path, LABEL_DIMENSIONS)
    return np.frombuffer(body, np.uint8, count=shape[0])


def image_header(path: str) -> tuple[int, int, int]:
    """(count, rows, columns) from an image file's header, the pixels left unread."""
    return parse_header(read_bytes(path, 4 + 4 * IMAGE_DIMENSIONS), IMAGE_DIMENSIONS, path)


@functools.lru_cache(maxsize=4)
def read_images(path: str, cache_dir: str) -> np.ndarray:
    """An image file's pixels, [count, rows, columns] uint8; a bucket's file copied into `cache_dir` first.
    Kept for the next call: every epoch's evaluation pipeline asks again."""
    shape, body = read_idx(localize([path], cache_dir)[0], IMAGE_DIMENSIONS, shown=path)
    return np.frombuffer(body, np.uint8, count=int(np.prod(shape))).reshape(shape)


def read_idx(path: str, dimensions: int, shown: str = "") -> tuple[tuple[int, ...], bytes]:
    """(shape, the data's bytes) of a whole IDX file; a cut-short one is one line naming it."""
    shown = shown or path
    data = read_bytes(path, shown=shown)
    shape = parse_header(data, dimensions, shown)
    header, size = 4 + 4 * dimensions, int(np.prod(shape))
    if len(data) < header + size:
        raise UserError(f"{shown} is truncated: its header promises {size} bytes of data, it holds "
                        f"{len(data) - header}")
    return shape, data[header:header + size]


def parse_header(data: bytes, dimensions: int, path: str) -> tuple[int, ...]:
    """The sizes in an IDX header of unsigned bytes in `dimensions` dimensions; anything else is one line."""
    if len(data) < 4 + 4 * dimensions:
        raise UserError(f"{path} is truncated: {len(data)} bytes, shorter than an IDX header")
    zeros, kind, found = struct.unpack(">HBB", data[:4])
    expected = (UNSIGNED_BYTE << 8) | dimensions
    if zeros or kind != UNSIGNED_BYTE or found != dimensions:
        raise UserError(f"{path}: magic number {struct.unpack('>I', data[:4])[0]:#010x}, not an IDX file of unsigned "
                        f"bytes in {dimensions} dimension(s) ({expected:#010x})")
    return struct.unpack(f">{dimensions}I", data[4:4 + 4 * dimensions])


def read_bytes(path: str, size: int = -1, shown: str = "") -> bytes:
    """The first `size` IDX bytes of `path` (all: -1), local or in a bucket, un-gzipped if it ends in .gz; a
    gzip stream cut short or damaged is one line naming the file."""
    fs, inside = filesystem(path)
    try:
        with fs.open(inside, "rb") as raw:
            if not path.endswith(".gz"):
                return raw.read(size)
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                return f.read(size)
    except FileNotFoundError:
        raise UserError(f"file not found: {shown or path}") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise UserError(f"{shown or path} is not a whole gzip file ({e}): a truncated or damaged copy") from None
