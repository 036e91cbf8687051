"""A diverging run says so and stops safely: a non-finite loss ends `tfdp train` with one line naming the step and
the checkpoint it keeps (exit `DIVERGED_EXIT_CODE`), nothing of the diverged weights is written, the same run goes on
from that checkpoint with a sane learning rate; an exploding but finite loss is reported once and the run goes on;
`tfdp export` does not call a model with the same logits for every image "agreeing".

Real runs of the command line on 320 real digits at 16 px (simple_cnn: a fraction of a second per epoch)."""

from __future__ import annotations

import hashlib
import os
import re

import keras
import numpy as np
import pytest

from conftest import assert_one_line_error, read_jsonl, run_tfdp
from tfdp.config import validate
from tfdp.errors import DIVERGED_EXIT_CODE, Diverged
from tfdp.rundir.checkpoints import CheckpointStore
from tfdp.train.callbacks import Checkpointer, CheckpointSettings

EXPLOSION = "tfdp: warning: training loss"


def small_run(small_dir: str, model_dir) -> tuple[str, ...]:
    return ("--model=simple_cnn", "--data_format=image_folder", f"--data_dir={small_dir}", f"--model_dir={model_dir}",
            "--batch_size_per_replica=32", "--cpu_replicas=2", "--set=data.image_size=16", "--set=log.tensorboard=false",
            "--set=train.checkpoint_every_steps=0", "--set=train.deterministic=true")


def digests(folder: str) -> dict[str, str]:
    """Every file under `folder` (relative name → sha256 of its bytes)."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def test_an_exploding_loss_is_said_once_a_nan_one_stops_the_run_and_the_run_goes_on_from_what_it_kept(
        small_dir, tmp_path):
    run = tmp_path / "run"
    args = (*small_run(small_dir, run), "--set=optimizer.clip_norm=1.0")
    # Clipped to norm 1 at a learning rate of 25 per step (100 per 256 images), the weights jump far enough for
    # the loss to climb thousands of times over, and never far enough to overflow: said once, and the run goes on.
    exploding = run_tfdp("train", *args, "--epochs=1", "--set=optimizer.lr=100")
    assert exploding.returncode == 0, exploding.stderr[-3000:]
    warnings = [line for line in exploding.stderr.splitlines() if line.startswith(EXPLOSION)]
    assert len(warnings) == 1, exploding.stderr[-3000:]   # its loss stays up there for the rest of the epoch
    assert re.match(r"tfdp: warning: training loss \S+ at step [2-5] \(epoch 1\) is over 100x its start", warnings[0])
    assert "optimizer.clip_norm (now 1)" in warnings[0]
    kept = digests(str(run / "checkpoints"))
    assert "epoch-0001/model.weights.h5" in kept and "best.weights.h5" in kept

    # An infinite rate makes the first update of epoch 2 (step 6) put inf, or nan where a gradient is 0, into
    # every weight: step 7's logits are nan by arithmetic, not by where a chaotic climb happens to overflow.
    diverged = run_tfdp("train", *args, "--epochs=2", "--set=optimizer.lr=.inf")
    assert_one_line_error(diverged, DIVERGED_EXIT_CODE, "training loss is nan at step 7 (epoch 2); the last good "
                          "checkpoint (checkpoints/epoch-0001) is kept; lower optimizer.lr (now inf) or "
                          "optimizer.clip_norm (now 1)")
    assert digests(str(run / "checkpoints")) == kept   # nothing written since: no step, epoch or best checkpoint
    assert [r["epoch"] for r in read_jsonl(str(run / "metrics.jsonl"))] == [1]

    again = run_tfdp("train", *args, "--epochs=2", "--set=optimizer.lr=0.2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming at epoch 2 of 2 from checkpoints/epoch-0001" in again.stdout, again.stdout
    rows = read_jsonl(str(run / "metrics.jsonl"))
    assert [r["epoch"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows), rows


def test_no_checkpoint_holds_non_finite_weights_and_a_nan_metric_is_never_the_best(tmp_path):
    """A step can leave nan weights behind a finite loss (the loss is computed before the update): the
    checkpointer checks the weights themselves before it writes."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="logits")])
    model.compile(optimizer="sgd", loss="mse")
    store = CheckpointStore(str(tmp_path))
    checkpointer = Checkpointer(store, CheckpointSettings("val_top1", steps_per_epoch=5), average=lambda: None,
                                input_state=lambda steps: [], snapshot=None)
    checkpointer.set_model(model)
    checkpointer.on_epoch_end(0, {"val_top1": 0.5})
    kept = digests(str(tmp_path / "checkpoints"))
    assert not checkpointer._improved(float("nan"))
    kernel = model.get_layer("logits").kernel
    kernel.assign(np.where(np.arange(12).reshape(4, 3) == 7, np.nan, kernel.numpy()))
    with pytest.raises(Diverged, match=r"the weights are not finite after step 10 \(the end of epoch 2\); the last "
                                       r"good checkpoint \(checkpoints/epoch-0001\) is kept"):
        checkpointer.on_epoch_end(1, {"val_top1": 0.9})
    assert digests(str(tmp_path / "checkpoints")) == kept


def test_an_export_of_a_model_with_the_same_logits_for_every_image_is_not_called_agreeing(small_dir, tmp_path):
    """Dead units (a diverged run's usual end) make the logits the classifier's bias for every image: every
    format then "agrees" with the Keras model on every image. Here the classifier's kernel is zeroed."""
    run = tmp_path / "run"
    args = small_run(small_dir, run)
    cfg = validate({"model_dir": str(run), "data": {"format": "image_folder", "dir": small_dir, "image_size": 16},
                    "model": {"name": "simple_cnn", "num_classes": 10}})
    from tfdp.train.task import serving_model
    model = serving_model(cfg)
    head = model.get_layer("simple_cnn_backbone").get_layer("logits")
    head.kernel.assign(np.zeros(head.kernel.shape, np.float32))
    head.bias.assign(np.linspace(-1, 1, 10).astype(np.float32))
    weights = str(tmp_path / "dead.weights.h5")
    model.save_weights(weights)
    result = run_tfdp("export", *args, f"--checkpoint={weights}", "--format=keras", f"--export_dir={tmp_path}/out")
    assert_one_line_error(result, 2, "the model's logits are the same for every one of the 40 validation images "
                                     "checked: nothing to compare; the run diverged?",
                          f"written, not verified: {tmp_path}/out/model.keras")
    assert "agrees" not in result.stdout + result.stderr
    assert os.path.exists(tmp_path / "out" / "model.keras")
