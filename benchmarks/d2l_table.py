"""d2l's table (Dive into Deep Learning, section 13.6): ResNet-18 on Fashion-MNIST, tfdp beside a PyTorch twin
of the book's code, on 1 and 2 replicas, in one run on one machine.

Each row trains in its own process on the same IDX files (Debian's `dataset-fashion-mnist`, or a subset of its
first images written as IDX files, `--train_images`/`--test_images`), for the same epochs, global batch and
learning rate, and prints the test accuracy after every epoch and the seconds per epoch (training only, as the
book's timer: evaluation is outside it):

- tfdp: `tfdp train --config=configs/fashion_mnist_d2l.yaml`, 1 replica (distribute.strategy one_device) and 2
  (mirrored: two GPUs, or `distribute.cpu_replicas: 2`, two logical CPU devices, on a host without GPUs);
  accuracy and seconds from its metrics.jsonl (`val_top1`, `seconds`).
- torch: the book's PyTorch code (`resnet18`, `d2l.Residual`, `init_weights`, `nn.DataParallel` over the GPUs
  of the row, torch.optim.SGD(lr), CrossEntropyLoss, a shuffled loader with the last short batch, evaluation in
  `net.eval()`), written out here as `torch_twin` since d2l's package is not needed for it. It runs under
  `--torch_python` (a Python with torch; torch is never a tfdp dependency). On a host with fewer GPUs than
  the row's replicas it runs in one process on the CPU with the same global batch and rate: PyTorch has no
  DataParallel across CPU cores, so there its 2-replica row is the same arithmetic, not data parallel.

Rows: batch 256 x replicas, lr 0.1 x replicas (the book's 0.1 at 256 and 0.2 at 512).

  python benchmarks/d2l_table.py --torch_python=/work/sidevenv/bin/python                     # the book's table
  python benchmarks/d2l_table.py --torch_python=... --epochs=2 --train_images=4000 --test_images=2000   # short
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
BATCH_PER_REPLICA = 256
LR_PER_REPLICA = 0.1   # the book's 0.1 at batch 256, 0.2 at 512


# ------------------------------------------------------------------ IDX files (both sides read them)

def read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dimensions = data[3]
    shape = struct.unpack(f">{dimensions}I", data[4:4 + 4 * dimensions])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dimensions).reshape(shape)


def write_idx(path: str, array: np.ndarray) -> None:
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape))
        f.write(np.ascontiguousarray(array, np.uint8).tobytes())


def files(folder: str, prefix: str) -> tuple[str, str]:
    return tuple(os.path.join(folder, f"{prefix}-{kind}-ubyte.gz") for kind in ("images-idx3", "labels-idx1"))


def subset(source: str, folder: str, train_images: int, test_images: int) -> str:
    """The first `train_images`/`test_images` of each split (0: all) as IDX files in `folder`/fashion-mnist
    (the folder's name gives tfdp the class names)."""
    out = os.path.join(folder, "fashion-mnist")
    os.makedirs(out, exist_ok=True)
    for prefix, keep in (("train", train_images), ("t10k", test_images)):
        for src, dst in zip(files(source, prefix), files(out, prefix)):
            array = read_idx(src)
            write_idx(dst, array[:keep] if keep else array)
    return out


# ------------------------------------------------------------------ the PyTorch twin of the book's code

def book_resnet18(num_classes: int = 10):
    """The book's PyTorch network: `d2l.Residual` (section 8.6: lazy convolutions, a 1x1 convolution on the
    shortcut) and section 13.6.1's `resnet18(num_classes, in_channels=1)`, as printed. Its lazy modules are
    materialised when it first sees an input."""
    import torch  # noqa: F401 (the twin's side only: never a tfdp dependency)
    from torch import nn
    from torch.nn import functional as F

    class Residual(nn.Module):
        """d2l.Residual (section 8.6, PyTorch): lazy convolutions, a 1x1 convolution on the shortcut."""
        def __init__(self, num_channels, use_1x1conv=False, strides=1):
            super().__init__()
            self.conv1 = nn.LazyConv2d(num_channels, kernel_size=3, padding=1, stride=strides)
            self.conv2 = nn.LazyConv2d(num_channels, kernel_size=3, padding=1)
            self.conv3 = nn.LazyConv2d(num_channels, kernel_size=1, stride=strides) if use_1x1conv else None
            self.bn1 = nn.LazyBatchNorm2d()
            self.bn2 = nn.LazyBatchNorm2d()

        def forward(self, X):
            Y = F.relu(self.bn1(self.conv1(X)))
            Y = self.bn2(self.conv2(Y))
            if self.conv3:
                X = self.conv3(X)
            Y += X
            return F.relu(Y)

    def resnet18(num_classes, in_channels=1):
        """The book's section 13.6.1, as printed."""
        def resnet_block(in_channels, out_channels, num_residuals, first_block=False):
            blk = []
            for i in range(num_residuals):
                if i == 0 and not first_block:
                    blk.append(Residual(out_channels, use_1x1conv=True, strides=2))
                else:
                    blk.append(Residual(out_channels))
            return nn.Sequential(*blk)
        net = nn.Sequential(nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1), nn.BatchNorm2d(64),
                            nn.ReLU())
        net.add_module("resnet_block1", resnet_block(64, 64, 2, first_block=True))
        net.add_module("resnet_block2", resnet_block(64, 128, 2))
        net.add_module("resnet_block3", resnet_block(128, 256, 2))
        net.add_module("resnet_block4", resnet_block(256, 512, 2))
        net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
        net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))
        return net

    return resnet18(num_classes)


def torch_twin(data_dir: str, replicas: int, epochs: int, seed: int) -> dict:
    """The book's `train(net, num_gpus, batch_size, lr)`, PyTorch tab, on the IDX files in `data_dir`."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    gpus = torch.cuda.device_count()
    devices = ([torch.device(f"cuda:{i}") for i in range(replicas)] if gpus >= replicas
               else [torch.device("cpu")])
    batch_size, lr = BATCH_PER_REPLICA * replicas, LR_PER_REPLICA * replicas
    x_train, y_train = (torch.from_numpy(read_idx(p).copy()) for p in files(data_dir, "train"))
    x_test, y_test = (torch.from_numpy(read_idx(p).copy()) for p in files(data_dir, "t10k"))

    def batches(x, y, shuffle: bool):
        """d2l.load_data_fashion_mnist's loader: ToTensor (pixels / 255, one channel), shuffled for training,
        the last short batch kept."""
        order = torch.randperm(len(y)) if shuffle else torch.arange(len(y))
        for i in range(0, len(y), batch_size):
            take = order[i:i + batch_size]
            yield x[take].unsqueeze(1).float().div_(255), y[take].long()

    net = book_resnet18(10)

    def init_weights(module):
        if type(module) in [nn.Linear, nn.Conv2d]:
            nn.init.normal_(module.weight, std=0.01)
    net.apply(init_weights)   # as the book: its lazy Residual convolutions are not nn.Conv2d yet, so keep torch's
    net = net.to(devices[0])
    with torch.no_grad():   # materialise the lazy modules (DataParallel replicates them), no statistics moved
        net.eval()(torch.zeros(2, 1, 28, 28, device=devices[0]))
    if devices[0].type == "cuda":
        net = nn.DataParallel(net, device_ids=devices)
    trainer = torch.optim.SGD(net.parameters(), lr)
    loss = nn.CrossEntropyLoss()
    rows = []
    for epoch in range(epochs):
        net.train()
        start = time.perf_counter()
        for X, y in batches(x_train, y_train, shuffle=True):
            trainer.zero_grad()
            X, y = X.to(devices[0]), y.to(devices[0])
            l = loss(net(X), y)  # noqa: E741 (the book's name)
            l.backward()
            trainer.step()
        if devices[0].type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        net.eval()
        correct = 0
        with torch.no_grad():
            for X, y in batches(x_test, y_test, shuffle=False):
                correct += int((net(X.to(devices[0])).argmax(dim=1).cpu() == y).sum())
        rows.append({"epoch": epoch + 1, "test_acc": correct / len(y_test), "seconds": seconds})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    where = f"{len(devices)} GPU(s), DataParallel" if devices[0].type == "cuda" else "CPU, one process"
    return {"rows": rows, "where": where}


# ------------------------------------------------------------------ tfdp

def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def run_tfdp(data_dir: str, replicas: int, epochs: int, seed: int, workdir: str) -> dict:
    model_dir = os.path.join(workdir, f"tfdp_r{replicas}_s{seed}")
    cmd = [sys.executable, "-m", "tfdp", "train", "--config=configs/fashion_mnist_d2l.yaml", f"--data_dir={data_dir}",
           f"--model_dir={model_dir}", f"--epochs={epochs}", "--set=log.tensorboard=false",
           "--set=train.checkpoint_every_steps=0", f"--set=train.seed={seed}"]
    env = dict(os.environ)
    gpus = gpu_count()
    if replicas > 1:
        cmd.append("--set=distribute.strategy=mirrored")
        if gpus >= replicas:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(replicas))
        else:
            cmd.append(f"--set=distribute.cpu_replicas={replicas}")
    subprocess.run(cmd, cwd=REPO, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        metrics = [json.loads(line) for line in f]
    rows = [{"epoch": m["epoch"], "test_acc": m["val_top1"], "seconds": m["seconds"]} for m in metrics]
    where = (f"{replicas} GPU(s)" if gpus >= replicas else
             f"{replicas} logical CPU device(s)" if replicas > 1 else "CPU") + (", mirrored" if replicas > 1 else "")
    return {"rows": rows, "where": where}


def run_torch(torch_python: str, data_dir: str, replicas: int, epochs: int, seed: int) -> dict:
    out = subprocess.run([torch_python, os.path.abspath(__file__), "--torch_twin", f"--data_dir={data_dir}",
                          f"--replicas={replicas}", f"--epochs={epochs}", f"--seed={seed}"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the table

def table(results: list[dict], train_images: int, test_images: int) -> str:
    epochs = max(len(r["rows"]) for r in results)
    head = ("| replicas | batch | lr | framework | where | " + " | ".join(f"acc e{e}" for e in range(1, epochs + 1))
            + " | s/epoch |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        accs = " | ".join(f"{row['test_acc']:.3f}" for row in r["rows"])
        seconds = np.mean([row["seconds"] for row in r["rows"]])
        lines.append(f"| {r['replicas']} | {BATCH_PER_REPLICA * r['replicas']} | {LR_PER_REPLICA * r['replicas']:.1f} "
                     f"| {r['framework']} | {r['where']} | {accs} | {seconds:.1f} |")
    for replicas in sorted({r["replicas"] for r in results}):
        pair = {r["framework"]: r for r in results if r["replicas"] == replicas}
        if len(pair) == 2:
            mean = {k: np.mean([row["seconds"] for row in v["rows"]]) for k, v in pair.items()}
            lines.append(f"\n{replicas} replica(s): tfdp's s/epoch / torch's = {mean['tfdp'] / mean['torch']:.2f}; "
                         f"final accuracy tfdp {pair['tfdp']['rows'][-1]['test_acc']:.3f}, "
                         f"torch {pair['torch']['rows'][-1]['test_acc']:.3f}")
    lines.append(f"\n{train_images or 60000} training images, {test_images or 10000} test images; "
                 f"{platform.node()}, {os.cpu_count()} CPU(s), {gpu_count()} GPU(s), "
                 f"{time.strftime('%Y-%m-%d', time.gmtime())}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=DEBIAN_FASHION_MNIST, help="Fashion-MNIST's four IDX files")
    parser.add_argument("--torch_python", default="", help="a Python with torch for the twin ('' = tfdp only)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--replicas", default="1,2", help="rows: replica counts")
    parser.add_argument("--train_images", type=int, default=0, help="the first N training images (0: all)")
    parser.add_argument("--test_images", type=int, default=0, help="the first N test images (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="both sides' seed (weights, shuffling)")
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--torch_twin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_twin:
        print(json.dumps(torch_twin(args.data_dir, int(args.replicas), args.epochs, args.seed)))
        return
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        data_dir = (subset(args.data_dir, workdir, args.train_images, args.test_images)
                    if args.train_images or args.test_images else args.data_dir)
        for replicas in (int(r) for r in args.replicas.split(",")):
            sides = [("tfdp", lambda: run_tfdp(data_dir, replicas, args.epochs, args.seed, workdir))]
            if args.torch_python:
                sides.append(("torch", lambda: run_torch(args.torch_python, data_dir, replicas, args.epochs,
                                                         args.seed)))
            for framework, run in sides:
                result = run()
                results.append({"framework": framework, "replicas": replicas, **result})
                print(f"{framework} x{replicas}: {json.dumps(result)}", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    print(table(results, args.train_images, args.test_images))


if __name__ == "__main__":
    main()
