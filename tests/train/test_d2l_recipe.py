"""configs/fashion_mnist_d2l.yaml: d2l's section 13.6 recipe gives the book's two rows' batch and learning rate,
and trains on real Fashion-MNIST (a few of Debian's images) on 2 replicas (its table: benchmarks/d2l_table.py)."""

import gzip
import math
import os
import struct

import numpy as np
import pytest

from conftest import read_jsonl
from support.inprocess import cli_config, train_in_process
from tfdp.optim.schedules import build_schedule

DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"   # apt-get install dataset-fashion-mnist
TWO_REPLICAS = ("--set=distribute.strategy=mirrored", "--set=distribute.cpu_replicas=2")


@pytest.mark.parametrize("flags, replicas, batch, lr", [((), 1, 256, 0.1), (TWO_REPLICAS, 2, 512, 0.2)])
def test_the_books_two_rows(flags, replicas, batch, lr):
    """The book's rows: 1 GPU, batch 256, lr 0.1; 2 GPUs, batch 512, lr 0.2; the second by flags alone. Plain SGD
    at a constant rate, no augmentation, the book's network."""
    cfg = cli_config("--config=configs/fashion_mnist_d2l.yaml", *flags)
    assert (cfg.data.format, cfg.model.name, cfg.train.epochs) == ("idx", "resnet18_d2l", 10)
    assert (cfg.data.hflip, cfg.data.min_crop_area, cfg.data.eval_crop_fraction) == (False, 1.0, 1.0)
    assert (cfg.optimizer.name, cfg.optimizer.momentum, cfg.optimizer.weight_decay) == ("sgd", 0.0, 0.0)
    assert cfg.train.label_smoothing == 0.0
    global_batch = cfg.train.batch_size_per_replica * replicas
    assert global_batch == batch
    schedule = build_schedule(cfg.schedule, cfg.optimizer.lr, global_batch, 234, cfg.train.epochs, cfg.rules,
                              cfg.optimizer)
    assert [float(schedule(step)) for step in (0, 1000, 2339)] == pytest.approx([lr] * 3, rel=1e-6)


def write_idx(path, array: np.ndarray) -> None:
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes())


def read_idx(path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    shape = struct.unpack(f">{data[3]}I", data[4:4 + 4 * data[3]])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * data[3]).reshape(shape)


@pytest.mark.full(reason="builds and traces ResNet-18 on 2 replicas: about 15 s of CPU")
@pytest.mark.skipif(not os.path.isdir(DEBIAN_FASHION_MNIST),
                    reason="Fashion-MNIST's IDX files are not installed: apt-get install dataset-fashion-mnist")
def test_trains_on_a_few_real_images_on_two_replicas(tmp_path):
    """The recipe as it is but for its size: 32 of Fashion-MNIST's training images and 16 of its test images, one
    step of 2 x 16 on 2 replicas; the loss finite and the accuracy measured on all 16 test images."""
    data = tmp_path / "fashion-mnist"
    data.mkdir()
    for prefix, keep in (("train", 32), ("t10k", 16)):
        for kind in ("images-idx3", "labels-idx1"):
            name = f"{prefix}-{kind}-ubyte.gz"
            write_idx(data / name, read_idx(os.path.join(DEBIAN_FASHION_MNIST, name))[:keep])
    summary, out = train_in_process("--config=configs/fashion_mnist_d2l.yaml", f"--data_dir={data}",
                                    f"--model_dir={tmp_path / 'run'}", "--epochs=1", "--batch_size_per_replica=16",
                                    "--set=log.tensorboard=false", *TWO_REPLICAS)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1]
    assert math.isfinite(rows[0]["loss"]) and 0.0 <= rows[0]["val_top1"] <= 1.0
    assert round(rows[0]["val_top1"] * 16) == pytest.approx(rows[0]["val_top1"] * 16)   # 16 images counted
