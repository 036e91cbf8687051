"""Time to the first training step (and peak memory) on an ImageNet-sized raw tree, beside a small one and the peers.

The scale-dependent part of start-up (listing, labels, the file-order
tensors, the graphs that hold them, the validation stream, a resume's skip)
is the large tree's time minus the small tree's, for the same command. The
trees hold no data of their own: every file is a hard link to one of a few
hundred distinct JPEGs cut from the real photos in the scikit-image and
scikit-learn wheels (`tests/support/photos.py`), so a 1.33 M-file tree takes
a few minutes to build and almost no disk. It is built once under --root and
reused.

  large  1,000 classes x (1,281 train + 50 val) = 1,331,000 files, the ILSVRC2012 shape
  small  1,000 classes x (2 train + 1 val)      = 3,000 files, the same classes

Measured, each in a process of its own, one at a time (so the figures do not
share the machine with each other):

  tfdp train        `tfdp train` (simple_cnn, 32 px, global batch 64) until its first training step
  tfdp resume       the same command again on a model_dir whose step checkpoint sits in the middle of
                    epoch 1 (`mid_epoch_checkpoint`): the resume skips half a data epoch
  tfdp predict      `tfdp predict` over the val/ folder (50,000 or 1,000 images), with the weights of one
                    epoch on the small tree: the whole run less its prediction loop (listing, model,
                    pipeline, and writing the rows)
  torchvision       ImageFolder(train/) + DataLoader(num_workers=2, shuffle) until its first batch
                    (run with --torch_python, a Python that has torch and torchvision)
  keras             keras.utils.image_dataset_from_directory(train/) until its first batch

The first step is seen from outside, with nothing added to tfdp: each
command runs on a pseudo-terminal, where Keras draws its progress bar after
every training step ("1/N"); the clock stops at the first one. Peak memory is the largest sum of
the resident sets of the process and its children, sampled every 50 ms (the
DataLoader's workers are processes of their own).

  python benchmarks/startup.py [--root=/tmp/startup-tree] [--torch_python=/tmp/torchvenv/bin/python]
                               [--only=train,resume,predict,torchvision,keras] [--rounds=1]
                               [--trees=small,large] [--checkout=DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

TREES = {"large": (1000, 1281, 50), "small": (1000, 2, 1)}   # classes, train and val images per class
SOURCES = 300          # distinct JPEGs; each is linked at most ~4,500 times (ext4 allows 65,000)
SOURCE_SIZE = (160, 120)
TIMEOUT = 900.0
GLOBAL_BATCH = 64
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# --- the trees -------------------------------------------------------------

def wnid(k: int) -> str:
    return f"n{k + 1:08d}"


def sources(root: str) -> list[str]:
    """SOURCES distinct JPEGs cut from the real photos (class k links to source k mod SOURCES)."""
    import numpy as np
    from support.photos import photo_jpeg, real_photos

    folder = os.path.join(root, "sources")
    paths = [os.path.join(folder, f"{i:04d}.JPEG") for i in range(SOURCES)]
    if all(os.path.exists(p) for p in paths):
        return paths
    os.makedirs(folder, exist_ok=True)
    photos, rng = real_photos(), np.random.default_rng(0)
    for i, path in enumerate(paths):
        with open(path, "wb") as f:
            f.write(photo_jpeg(photos[i % len(photos)], rng, SOURCE_SIZE, quality=90))
    return paths


def tree(root: str, name: str) -> str:
    """root/<name>/{train,val}/<wnid>/*.JPEG, built once (a `.complete` file marks a finished tree)."""
    out = os.path.join(root, name)
    if os.path.exists(os.path.join(out, ".complete")):
        return out
    shutil.rmtree(out, ignore_errors=True)
    classes, train, val = TREES[name]
    jpegs = sources(root)
    for k in range(classes):
        source = jpegs[k % len(jpegs)]
        for split, count in (("train", train), ("val", val)):
            folder = os.path.join(out, split, wnid(k))
            os.makedirs(folder)
            first = 1 if split == "train" else 1 + k * val
            for n in range(first, first + count):
                file = f"{wnid(k)}_{n}.JPEG" if split == "train" else f"ILSVRC2012_val_{n:08d}.JPEG"
                os.link(source, os.path.join(folder, file))
    open(os.path.join(out, ".complete"), "w").close()
    return out


# --- measuring a process ---------------------------------------------------

def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process below it."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


def until(command: list[str], marker: str, env: dict | None = None, cwd: str | None = None) -> tuple[float, int, str]:
    """(seconds until `marker` (a regex) appears in the output, peak resident bytes, the output): the
    command runs on a pseudo-terminal and is stopped once the marker is seen."""
    main, child = pty.openpty()
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=child, stderr=child, cwd=cwd or CHECKOUT[0],
                            env={**os.environ, **(env or {})}, start_new_session=True)
    os.close(child)
    text, peak, found = "", 0, None
    pattern = re.compile(marker)
    try:
        while found is None and time.perf_counter() - start < TIMEOUT:
            peak = max(peak, tree_rss(proc.pid))
            ready, _, _ = select.select([main], [], [], 0.05)
            if ready:
                try:
                    chunk = os.read(main, 65536).decode(errors="replace")
                except OSError:
                    chunk = ""
                if not chunk and proc.poll() is not None:
                    break
                text += ANSI.sub("", chunk)
                if pattern.search(text):
                    found = time.perf_counter() - start
            elif proc.poll() is not None:
                break
        peak = max(peak, tree_rss(proc.pid))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        os.close(main)
    if found is None:
        raise RuntimeError(f"{' '.join(command)}: no {marker!r} within {TIMEOUT:g} s; output:\n{text[-3000:]}")
    return found, peak, text


# --- the commands ------------------------------------------------------------

# `python -m tfdp` run in a checkout imports that checkout's tfdp (--checkout: an older one, to compare)
TFDP = [sys.executable, "-m", "tfdp"]
CHECKOUT = [REPO]
FIRST_STEP = r"(?<![0-9])1/\d+ "            # Keras' progress bar after the first training step
PREDICTED = r"tfdp: predict: (\d+) image.*, (\d+) images/s"   # its last line


def train_flags(data: str, model_dir: str) -> list[str]:
    return [f"--data_dir={data}", f"--model_dir={model_dir}",
            "--set=data.format=image_folder", "--set=model.name=simple_cnn", "--set=model.num_classes=1000",
            "--set=data.image_size=32", f"--set=train.batch_size_per_replica={GLOBAL_BATCH}", "--set=train.epochs=2",
            "--set=train.checkpoint_every_steps=5", "--set=log.tensorboard=false"]


def tfdp_train(data: str, model_dir: str) -> tuple[float, int, str]:
    return until([*TFDP, "train", *train_flags(data, model_dir)], FIRST_STEP)


def mid_epoch_checkpoint(data: str, model_dir: str, train_images: int) -> None:
    """A model_dir whose latest checkpoint sits in the middle of epoch 1: the step checkpoint a run writes
    after 10 steps, moved to step steps_per_epoch / 2 (its step, and its input position: that many global
    batches of records), so the resume skips half a data epoch as a real one would. The weights stay those
    of step 10; what is timed does not read them."""
    shutil.rmtree(model_dir, ignore_errors=True)
    until([*TFDP, "train", *train_flags(data, model_dir)], r"(?<![0-9])1[2-9]/\d+ ")
    step = train_images // GLOBAL_BATCH // 2
    checkpoints = os.path.join(model_dir, "checkpoints")
    source, target = os.path.join(checkpoints, "step-000000010"), os.path.join(checkpoints, f"step-{step:09d}")
    for name in os.listdir(checkpoints):
        if name != "step-000000010":
            shutil.rmtree(os.path.join(checkpoints, name))
    with open(os.path.join(source, "state.json")) as f:
        state = json.load(f)
    state.update(step=step, step_in_epoch=step, input=[[step * GLOBAL_BATCH, 0]])
    with open(os.path.join(source, "state.json"), "w") as f:
        json.dump(state, f)
    os.rename(source, target)


def predict_weights(root: str, small: str) -> str:
    """The weights every `tfdp predict` loads: one epoch of the small tree (the same model for both trees)."""
    model_dir = os.path.join(root, "run-weights")
    weights = os.path.join(model_dir, "checkpoints", "best.weights.h5")
    if not os.path.exists(weights):
        shutil.rmtree(model_dir, ignore_errors=True)
        subprocess.run([*TFDP, "train", *train_flags(small, model_dir), "--set=train.epochs=1"], check=True,
                       stdout=subprocess.DEVNULL, cwd=CHECKOUT[0])
    return weights


def tfdp_predict(data: str, model_dir: str, weights: str) -> tuple[float, int, str]:
    """`tfdp predict`'s time outside its prediction loop: the whole run less the loop's seconds (its images
    over its images/s, both on its last line). Predicting draws no progress bar off a terminal of its own."""
    out = os.path.join(model_dir, "predictions.jsonl")
    seconds, peak, text = until([*TFDP, "predict", *train_flags(data, model_dir), f"--checkpoint={weights}",
                                 f"--input={os.path.join(data, 'val')}", f"--output={out}"], PREDICTED)
    images, rate = (int(n) for n in re.search(PREDICTED, text).groups())
    return seconds - images / rate, peak, text


TORCH = """
import sys, time, torch, torchvision
from torchvision import transforms
ds = torchvision.datasets.ImageFolder(sys.argv[1], transforms.Compose([transforms.RandomResizedCrop(32),
                                                                       transforms.PILToTensor()]))
loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2)
next(iter(loader))
print("FIRST BATCH", len(ds), flush=True)
"""

KERAS = """
import sys, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras
ds = keras.utils.image_dataset_from_directory(sys.argv[1], image_size=(32, 32), batch_size=64, shuffle=True, seed=0)
next(iter(ds))
print("FIRST BATCH", flush=True)
"""


def peer(python: str, code: str, data: str) -> tuple[float, int, str]:
    return until([python, "-c", code, os.path.join(data, "train")], r"FIRST BATCH", cwd="/")


# --- the table ---------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/tmp/startup-tree")
    parser.add_argument("--torch_python", default="/tmp/torchvenv/bin/python")
    parser.add_argument("--only", default="train,resume,predict,torchvision,keras")
    parser.add_argument("--trees", default="small,large")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--checkout", default=REPO, help="the tfdp checkout to time (another one: to compare)")
    args = parser.parse_args()
    CHECKOUT[0] = os.path.abspath(args.checkout)
    only = set(args.only.split(","))
    trees = {name: tree(args.root, name) for name in args.trees.split(",")}
    rows: dict[tuple[str, str], list[tuple[float, int]]] = {}

    def measure(what: str, name: str, run) -> None:
        seconds, peak, _ = run()
        rows.setdefault((what, name), []).append((seconds, peak))
        print(f"{what:12s} {name:6s} {seconds:7.1f} s {peak / 2**30:6.2f} GiB  (load {os.getloadavg()[0]:.2f})",
              flush=True)

    for _ in range(args.rounds):
        for name, data in trees.items():
            model_dir = os.path.join(args.root, f"run-{name}")
            if "train" in only:
                shutil.rmtree(model_dir, ignore_errors=True)
                measure("tfdp train", name, lambda: tfdp_train(data, model_dir))
            if "resume" in only:
                classes, train, _ = TREES[name]
                mid_epoch_checkpoint(data, model_dir, classes * train)
                measure("tfdp resume", name, lambda: tfdp_train(data, model_dir))
            if "predict" in only:
                weights = predict_weights(args.root, tree(args.root, "small"))
                os.makedirs(model_dir, exist_ok=True)
                measure("tfdp predict", name, lambda: tfdp_predict(data, model_dir, weights))
            if "torchvision" in only and os.path.exists(args.torch_python):
                measure("torchvision", name, lambda: peer(args.torch_python, TORCH, data))
            if "keras" in only:
                measure("keras", name, lambda: peer(sys.executable, KERAS, data))

    print("\nbest of rounds: seconds to first step/batch, peak resident GiB")
    print(f"{'':14s}" + "".join(f"{n:>20s}" for n in trees) + f"{'large - small':>20s}")
    for what in dict.fromkeys(w for w, _ in rows):
        cells = {n: min(rows[(what, n)]) for n in trees if (what, n) in rows}
        line = f"{what:14s}" + "".join(f"{cells[n][0]:10.1f} s {cells[n][1] / 2**30:5.2f} GB" if n in cells
                                       else f"{'':20s}" for n in trees)
        if {"small", "large"} <= set(cells):
            line += (f"{cells['large'][0] - cells['small'][0]:10.1f} s "
                     f"{(cells['large'][1] - cells['small'][1]) / 2**30:5.2f} GB")
        print(line)


if __name__ == "__main__":
    main()
