"""`tfdp.train.trainer.Trainer`: the runner's wiring comes from its builder methods, so a subclass that
overrides one changes the run through that method alone (Model Garden's runner)."""

from __future__ import annotations

import json
import os
import re

import keras

from tfdp.config import validate
from tfdp.distribute.strategy import make_runtime
from tfdp.train.trainer import Trainer, rate_words


class EpochsSeen(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs: list[int] = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)


class OwnLoggers(Trainer):
    """A run that logs to its own callback instead of TensorBoard."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen = EpochsSeen()

    def build_loggers(self, out, initial_epoch):
        return [self.seen]


def test_an_overridden_builder_wires_the_run(small_dir, tmp_path):
    cfg = validate({
        "model_dir": str(tmp_path / "run"),
        "data": {"format": "image_folder", "dir": small_dir, "image_size": 16},
        "model": {"name": "simple_cnn", "num_classes": 10},
        "train": {"epochs": 2, "batch_size_per_replica": 32, "checkpoint_every_steps": 0},
        "distribute": {"strategy": "mirrored", "cpu_replicas": 2},
    })
    trainer = OwnLoggers(cfg, make_runtime(cfg.distribute))
    summary = trainer.train()
    assert trainer.seen.epochs == [0, 1] and summary["epochs"] == 2
    assert not os.path.exists(tmp_path / "run" / "tensorboard")   # the default logger was replaced, not added to
    assert os.path.exists(tmp_path / "run" / "metrics.jsonl")      # the other callbacks are still wired


def test_a_one_epoch_run_reports_its_rate_after_the_first_step(small_dir, tmp_path, capsys):
    """One epoch has no later epoch to time: its summary's rate leaves out the first step (its tracing) and says so,
    and a slow model's rate keeps its digits instead of rounding to 0. The data: one tree of class folders (the
    training images alone), a share of it held out for validation (data.val_fraction)."""
    cfg = validate({
        "model_dir": str(tmp_path / "run"),
        "data": {"format": "image_folder", "dir": f"{small_dir}/train", "image_size": 16, "val_fraction": 0.25},
        "model": {"name": "simple_cnn", "num_classes": 10},
        "train": {"epochs": 1, "batch_size_per_replica": 32, "checkpoint_every_steps": 0},
    })
    summary = Trainer(cfg, make_runtime(cfg.distribute)).train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["images_per_sec"] == row["images_per_sec_after_first_step"] > 0
    out = capsys.readouterr().out.splitlines()
    held = [x for x in out if x.startswith("tfdp: data: data.val_fraction 0.25 of ")]
    assert len(held) == 1 and held[0].endswith(" validation images (10 classes, data.val_seed 0)"), out
    assert summary["val_top1"] is not None
    line = [x for x in out if x.startswith("tfdp: done: 1 epochs")][0]
    assert re.search(r", [\d.]+ images/s \(after the first step, whose tracing it leaves out\) on 1 replica", line)
    assert rate_words(0.273) == "0.27 images/s" and rate_words(1234.4) == "1234 images/s"
    assert rate_words(3.46, "x") == "3.5 images/s (x)"
