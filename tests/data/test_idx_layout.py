"""data.format idx: MNIST-family IDX files read as pixels, checked against Keras' own loader on the real
Fashion-MNIST (Debian's dataset-fashion-mnist), and each kind of bad file refused in one line."""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import struct

import numpy as np
import pytest

from tfdp.config import DataConfig
from tfdp.data import build_source
from tfdp.data.dali import choose
from tfdp.data.layouts.idx import FASHION_MNIST, read_images, read_labels
from tfdp.data.pipeline import train_dataset
from tfdp.errors import UserError

DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"   # apt-get install dataset-fashion-mnist
FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
         "t10k-labels-idx1-ubyte.gz")
needs_fashion_mnist = pytest.mark.skipif(
    not all(os.path.exists(os.path.join(DEBIAN_FASHION_MNIST, f)) for f in FILES),
    reason="Fashion-MNIST's IDX files are not installed: apt-get install dataset-fashion-mnist")


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """An IDX file of uint8 `array`: magic 0x0000080N (N its dimensions), its sizes, its bytes."""
    magic = (0x08 << 8 | array.ndim) if magic is None else magic
    return struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()


def write_split(folder, prefix: str, images: np.ndarray, labels: np.ndarray, gz: bool = True, **bad) -> None:
    """`<prefix>-images-idx3-ubyte[.gz]` and its labels in `folder`; `bad` spoils one: image_magic=, cut= (bytes
    kept of the image file)."""
    opener = gzip.open if gz else open
    ending = ".gz" if gz else ""
    image_data = idx_bytes(images, bad.get("image_magic"))
    image_data = image_data[:bad["cut"]] if "cut" in bad else image_data
    os.makedirs(folder, exist_ok=True)
    with opener(os.path.join(folder, f"{prefix}-images-idx3-ubyte{ending}"), "wb") as f:
        f.write(image_data)
    with opener(os.path.join(folder, f"{prefix}-labels-idx1-ubyte{ending}"), "wb") as f:
        f.write(idx_bytes(labels))


def small_dataset(folder, n: int = 12, classes: int = 10, **bad):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = np.arange(n, dtype=np.uint8) % classes
    write_split(folder, "train", images, labels, **bad)
    write_split(folder, "t10k", images[:4], labels[:4])
    return images, labels


def config(folder) -> DataConfig:
    return DataConfig(format="idx", dir=str(folder), image_size=28, min_crop_area=1.0, eval_crop_fraction=1.0,
                      hflip=False)


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: Keras must find its cache and download nothing."""
    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to reach the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)


@needs_fashion_mnist
def test_reads_every_image_and_label_as_keras_load_data(tmp_path, monkeypatch, no_network):
    """Debian's files laid out as Keras' cache (KERAS_HOME/datasets/fashion-mnist): `load_data()` reads them
    from there, and tfdp, pointed at the same folder, gives every image and label equal."""
    import keras
    import keras.src.backend.config as keras_config

    cache = tmp_path / "keras" / "datasets" / "fashion-mnist"
    cache.mkdir(parents=True)
    for name in FILES:
        shutil.copy(os.path.join(DEBIAN_FASHION_MNIST, name), cache / name)
    monkeypatch.setattr(keras_config, "_KERAS_DIR", str(tmp_path / "keras"))   # where get_file looks
    (x_train, y_train), (x_test, y_test) = keras.datasets.fashion_mnist.load_data()

    source = build_source(config(cache))
    assert source.class_names == FASHION_MNIST
    for split, x, y in (("train", x_train, y_train), ("val", x_test, y_test)):
        pair = source.split(split).idx
        assert source.split(split).num_examples == len(y)
        np.testing.assert_array_equal(read_images(pair.images, str(tmp_path / "cache")), x)
        np.testing.assert_array_equal(read_labels(pair.labels), y)
    assert (len(y_train), len(y_test)) == (60000, 10000)


def test_pipeline_yields_the_files_pixels(tmp_path):
    """The training stream's images are the IDX pixels themselves (no encoding round trip), greyscale
    replicated to three channels, each with its own label."""
    images, labels = small_dataset(tmp_path / "mnist")
    cfg = config(tmp_path / "mnist")
    source = build_source(cfg)
    assert source.class_names == tuple(str(d) for d in range(10))
    batch, batch_labels = next(iter(train_dataset(source.split("train"), cfg, 12, seed=0)))
    seen = []
    for image, label in zip(batch.numpy(), batch_labels.numpy()):
        assert (image[..., 0] == image[..., 1]).all() and (image[..., 0] == image[..., 2]).all()
        match = np.flatnonzero((images == image[..., 0]).all(axis=(1, 2)))
        assert len(match) == 1 and labels[match[0]] == label
        seen.append(int(match[0]))
    assert sorted(seen) == list(range(12))   # one epoch: every image once


def test_uncompressed_files_and_other_prefixes(tmp_path):
    """Plain (not gzipped) files read alike; a split named for its prefix (EMNIST's) finds its files, and an
    unknown dataset's classes are its label numbers."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    write_split(tmp_path / "emnist", "emnist-letters-train", images, np.array([1, 26, 3, 4, 5], np.uint8), gz=False)
    source = build_source(DataConfig(format="idx", dir=str(tmp_path / "emnist")), ("emnist-letters-train",))
    assert source.num_classes == 27
    np.testing.assert_array_equal(read_images(source.split("emnist-letters-train").idx.images, ""), images)


@pytest.mark.parametrize("spoil, message", [
    (dict(cut=16 + 28 * 28 * 5), r"is truncated: its header promises 9408 bytes of data, it holds 3920"),
    (dict(cut=10), r"is truncated: 10 bytes, shorter than an IDX header"),
    (dict(image_magic=0x00000801), r"magic number 0x00000801, not an IDX file of unsigned bytes in 3 dimension"),
    (dict(image_magic=0x00000d03), r"magic number 0x00000d03"),
])
def test_bad_image_file_is_one_line(tmp_path, spoil, message):
    small_dataset(tmp_path / "mnist", **spoil)
    with pytest.raises(UserError, match=message) as error:
        source = build_source(config(tmp_path / "mnist"))
        read_images(source.split("train").idx.images, "")
    assert "\n" not in str(error.value)


def test_cut_gzip_stream_is_one_line(tmp_path):
    small_dataset(tmp_path / "mnist")
    path = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:200])   # the copy stopped part way: no gzip trailer
    source = build_source(config(tmp_path / "mnist"))
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte.gz is not a whole gzip file .*truncated"):
        read_images(source.split("train").idx.images, "")


def test_counts_that_differ_are_one_line(tmp_path):
    images, labels = small_dataset(tmp_path / "mnist")
    write_split(tmp_path / "mnist", "train", images, labels[:11])
    with pytest.raises(UserError, match=r"split 'train': .*train-images-idx3-ubyte.gz holds 12 images but "
                                        r".*train-labels-idx1-ubyte.gz 11 labels"):
        build_source(config(tmp_path / "mnist"))


def test_label_outside_the_known_classes_is_one_line(tmp_path):
    """Fashion-MNIST has 10 classes: a label 10 in a folder of that name is refused before training."""
    small_dataset(tmp_path / "fashion-mnist", classes=11)
    with pytest.raises(UserError, match=r"train-labels-idx1-ubyte.gz: label 10 is outside the dataset's 10 "
                                        r"classes \(0..9\)"):
        build_source(config(tmp_path / "fashion-mnist"))


def test_missing_split_names_the_files_it_looked_for(tmp_path):
    small_dataset(tmp_path / "mnist")
    os.remove(tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(UserError, match=r"split 'val': .* has no t10k-images-idx3-ubyte\[.gz\] and "
                                        r"t10k-labels-idx1-ubyte\[.gz\] or test-images"):
        build_source(config(tmp_path / "mnist"))


def test_dali_is_refused_for_pixels(tmp_path):
    cfg = DataConfig(format="idx", dir=str(tmp_path), decoder="dali")
    with pytest.raises(UserError, match="data.format idx holds pixels"):
        choose(cfg, ["/device:CPU:0"])
    assert choose(DataConfig(format="idx", decoder="auto"), ["/device:GPU:0"]) == "tf"
