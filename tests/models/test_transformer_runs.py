"""The ViT and ConvNeXt families train as exactly as the ResNets: the same training on 1 replica and on 2, and a
run killed mid-epoch with `kill -9` resumed bit for bit (`train.deterministic`).

Small members of each family, small images: `vit_mini_patch4_small` (4 blocks of width 64, 4 px patches) at
16 px and timm's `convnext_atto` at 32 px (its smallest input), AdamW with weight decay off the norms, biases,
layer scales, position embedding and class token (`optimizer.decay_norm_and_bias: false`), as their recipes.
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, last_line, read_jsonl
from support.fixed_steps import train_fixed_batches
from tfdp.config import validate

STEPS = 6
GLOBAL_BATCH = 32
# (registry name, image size): the smallest real member of each family
MODELS = [("vit_mini_patch4_small", 16), ("convnext_atto", 32)]


def make_cfg(digits_dir, replicas, model, size):
    return validate({
        # No random flip (the model's first layer) and no drop path: every layout must see the same pixels
        # and keep every branch.
        "data": {"format": "image_folder", "dir": digits_dir, "image_size": size, "eval_crop_fraction": 1.0,
                 "hflip": False},
        "model": {"name": model},
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.05, "decay_norm_and_bias": False},
        "train": {"batch_size_per_replica": GLOBAL_BATCH // replicas, "epochs": 1, "seed": 3, "jit_compile": False},
        "distribute": {"strategy": "mirrored", "cpu_replicas": replicas},
    })


@pytest.mark.parametrize("model,size", MODELS)
def test_two_replicas_train_as_one_on_the_same_global_batch(digits_dir, model, size):
    """6 AdamW steps on a fixed sequence of 32-image batches, on 2 replicas of 16 and on 1 of 32, from the same
    weights: the same weights and optimizer moments to float rounding (LayerNorm, unlike batch norm, does not
    depend on how the batch is cut), identical on both replicas."""
    _, two, initial = train_fixed_batches(make_cfg(digits_dir, 2, model, size), STEPS, GLOBAL_BATCH)
    _, one, _ = train_fixed_batches(make_cfg(digits_dir, 1, model, size), STEPS, GLOBAL_BATCH, start=initial)
    assert int(two.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == STEPS
    moved = 0.0
    for a, b, init in zip(two.weights, one.weights, initial):
        copies = a.value.values
        np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy(), err_msg=a.path)
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=a.path)
        moved = max(moved, float(np.abs(a.numpy() - init).max()))
    assert moved > 1e-3  # the weights really trained, so equality is not vacuous
    for a, b in zip(two.optimizer.variables, one.optimizer.variables):  # AdamW's moments and step count
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6, err_msg=a.path)


def vit_run(data_dir, model_dir):
    """The ViT on the demo's data, 2 replicas, AdamW, deterministic, a step checkpoint every 3 of 10 steps;
    with drop path and flips, whose random streams a resume must continue, not restart."""
    return ["train", "--config=configs/digits.yaml", f"--data_dir={data_dir}", "--data_format=image_folder",
            f"--model_dir={model_dir}", "--model=vit_mini_patch4_small", "--set=data.image_size=16", "--epochs=2",
            "--set=train.batch_size_per_replica=32", "--set=train.deterministic=true",
            "--set=train.checkpoint_every_steps=3", "--set=optimizer.name=adamw", "--set=optimizer.lr=0.001",
            "--set=optimizer.weight_decay=0.05", "--set=optimizer.decay_norm_and_bias=false",
            "--set=model.drop_path=0.1", "--set=data.hflip=true"]


def kill_after_step_checkpoint(args, model_dir, step):
    """Starts `tfdp ARGS` and kills it (SIGKILL) as soon as its step checkpoint `step` is written."""
    proc = subprocess.Popen([sys.executable, "-m", "tfdp", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    checkpoint = model_dir / "checkpoints" / f"step-{step:09d}"
    deadline = time.time() + 300
    while not checkpoint.exists() and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert checkpoint.exists()


@pytest.mark.slow
def test_vit_killed_mid_epoch_resumes_bit_identical(tmp_path, small_dir):
    """kill -9 right after the step checkpoint of step 3 (of 5 in epoch 1), the same command again: it goes on
    at step 4 and ends with the uninterrupted run's weights fingerprint, metrics and validation numbers.
    The killed run is a real `tfdp` process (what SIGKILL interrupts); the uninterrupted run and the resume run
    in this process from the same flags (inprocess), so the fingerprints also match across processes."""
    from support.inprocess import train_in_process
    _, clean = train_in_process(*vit_run(small_dir, tmp_path / "clean")[1:])
    model_dir = tmp_path / "killed"
    kill_after_step_checkpoint(vit_run(small_dir, model_dir), model_dir, 3)
    _, resumed = train_in_process(*vit_run(small_dir, model_dir)[1:])
    assert "tfdp: resuming at epoch 1 of 2, step 4 of 5" in resumed
    fingerprint = re.compile(r"weights fingerprint (\w+)")
    assert fingerprint.findall(resumed) == fingerprint.findall(clean) != []
    assert last_line(resumed).split(",")[:2] == last_line(clean).split(",")[:2]  # epochs, top-1
    rows, clean_rows = read_jsonl(model_dir / "metrics.jsonl"), read_jsonl(tmp_path / "clean" / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2]
    for key in ("loss", "top1", "val_loss", "val_top1"):  # the partial epoch's metrics continued exactly
        assert [round(r[key], 5) for r in rows] == [round(r[key], 5) for r in clean_rows], key
    assert not [p for p in os.listdir(model_dir / "checkpoints") if p.startswith(".tmp")]
