"""`tfdp evaluate --continuous` against the checkpoints of one tiny real training run: each checkpoint that
appears is evaluated once, a pruned one is skipped in one line, a restarted evaluator goes on where its own
log stops, and it ends at the run's last epoch or after its timeout. The evaluator beside a real cluster
is in tests/distribute/test_multi_worker.py; in a bucket, in tests/rundir/test_bucket_run.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, assert_one_line_error, read_jsonl, run_tfdp

pytestmark = pytest.mark.slow   # an evaluator process beside the checkpoints a test puts in place

RUN = ["--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=16",
       "--data_format=image_folder", "--batch_size_per_replica=16", "--set=train.validate=never"]


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory):
    """3 epochs of 2 steps, workers not validating: epoch-0002 and epoch-0003 kept, no best checkpoint."""
    model_dir = tmp_path_factory.mktemp("trained") / "run"
    result = run_tfdp("train", *RUN, f"--data_dir={tiny_dir}", f"--model_dir={model_dir}", "--epochs=3",
                      "--set=train.checkpoint_every_steps=0")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tfdp: validation: not on the workers (train.validate: never)" in result.stdout
    assert "no validation on the workers" in result.stdout   # the summary line
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["epoch-0002", "epoch-0003"]
    return model_dir


def put_in_place(source, model_dir, name, leave_out=()):
    """A checkpoint folder copied under a temporary name and renamed into place, as the store commits one;
    `leave_out`: files a prune already deleted (it removes a folder file by file)."""
    root = model_dir / "checkpoints"
    tmp = root / f".tmp-{name}"
    shutil.copytree(source / "checkpoints" / name, tmp, ignore=lambda d, names: [n for n in names if n in leave_out])
    os.rename(tmp, root / name)


def put_damaged(source, model_dir, name, as_name):
    """Checkpoint `name` committed as `as_name` with its weights cut to a third, as a failing disk leaves a file."""
    root = model_dir / "checkpoints"
    tmp = root / f".tmp-{as_name}"
    shutil.copytree(source / "checkpoints" / name, tmp)
    with open(tmp / "model.weights.h5", "r+b") as f:
        f.truncate(os.path.getsize(tmp / "model.weights.h5") // 3)
    state = json.loads((tmp / "state.json").read_text())
    (tmp / "state.json").write_text(json.dumps({**state, "step": int(as_name.split("-")[1])}))  # the step it lists
    os.rename(tmp, root / as_name)
    return root / as_name


def evaluator(tiny_dir, model_dir, *extra):
    return [sys.executable, "-m", "tfdp", "evaluate", *RUN, f"--data_dir={tiny_dir}", f"--model_dir={model_dir}",
            "--epochs=3", "--continuous", "--poll_seconds=0.1", *extra]


def wait_for(proc, fragment: str) -> list[str]:
    """The evaluator's lines up to the first holding `fragment`."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if fragment in line:
            return seen
    raise AssertionError(f"the evaluator ended before {fragment!r}:\n" + "".join(seen[-30:]))


def test_each_checkpoint_once_a_pruned_one_skipped_until_the_last_epoch(trained, tiny_dir, tmp_path):
    """Started before the run has a checkpoint, it waits; checkpoints put in place one by one, the first of
    them half-pruned and the second damaged (each skipped with a warning), are each evaluated once, and the
    last epoch's ends it, with the best checkpoint kept (the workers did not validate) and its points on
    TensorBoard's epoch charts."""
    model_dir = tmp_path / "run"
    (model_dir / "checkpoints").mkdir(parents=True)
    proc = subprocess.Popen(evaluator(tiny_dir, model_dir, "--eval_timeout=0"), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(proc, "tfdp: evaluate: watching")
        put_in_place(trained, model_dir, "epoch-0002", leave_out=("model.weights.h5",))
        skipped = wait_for(proc, "skipping checkpoint")[-1]
        shutil.rmtree(model_dir / "checkpoints" / "epoch-0002")
        damaged = put_damaged(trained, model_dir, "epoch-0002", "step-000000005")
        skipped_damaged = wait_for(proc, "skipping damaged checkpoint")[-1]
        put_in_place(trained, model_dir, "epoch-0003")
        out = "".join(wait_for(proc, "training ended")) + proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert skipped.strip() == (f"tfdp: warning: evaluate: skipping checkpoint {model_dir}/checkpoints/epoch-0002: it "
                               f"was deleted before it was read (the run keeps only its newest checkpoints, and "
                               f"evaluating takes longer than training)")
    assert skipped_damaged.strip().startswith(f"tfdp: warning: evaluate: skipping damaged checkpoint {damaged} "
                                              f"(Unable to synchronously open file (truncated file"), skipped_damaged
    assert "Traceback" not in out
    assert out.count(f"tfdp: evaluate: {model_dir}/checkpoints/epoch-0003: loss ") == 1
    rows = read_jsonl(model_dir / "eval_metrics.jsonl")
    assert [(r["checkpoint"], r["step"], r["epoch"], r["examples"]) for r in rows] == [("epoch-0003", 6, 3, 40)]
    best = json.loads((model_dir / "checkpoints" / "best.json").read_text())
    assert best == {"epoch": 3, "metric": "val_top1", "value": rows[0]["val_top1"], "step": 6}
    assert ((model_dir / "checkpoints" / "best.weights.h5").read_bytes()
            == (trained / "checkpoints" / "epoch-0003" / "model.weights.h5").read_bytes())
    # The report draws on the evaluator's figures where the workers have none.
    shutil.copy(trained / "metrics.jsonl", model_dir / "metrics.jsonl")
    report = run_tfdp("report", str(model_dir))
    assert report.returncode == 0, report.stderr[-2000:]
    assert f"| final validation top-1 | {100 * rows[0]['val_top1']:.2f}% |" in report.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray
    events = EventAccumulator(str(model_dir / "tensorboard" / "eval"), size_guidance={"tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["tensors"]) == ["epoch_loss", "epoch_top1", "epoch_top5"]
    assert [(e.step, round(float(make_ndarray(e.tensor_proto)), 6)) for e in events.Tensors("epoch_top1")] == [
        (2, round(rows[0]["val_top1"], 6))]   # Keras' epoch index: where validation/ draws epoch 3


def test_a_restarted_evaluator_goes_on_after_its_log_and_stops_after_its_timeout(trained, tiny_dir, tmp_path):
    """Its log holds epoch 2: only epoch 3 is evaluated; the run's last epoch (4 here) never comes, so it
    stops after --eval_timeout. Bad flags are one line each."""
    model_dir = tmp_path / "run"
    (model_dir / "checkpoints").mkdir(parents=True)
    for name in ("epoch-0002", "epoch-0003"):
        put_in_place(trained, model_dir, name)
    (model_dir / "eval_metrics.jsonl").write_text(json.dumps(
        {"step": 4, "epoch": 2, "step_in_epoch": 0, "checkpoint": "epoch-0002", "val_top1": 0.99}) + "\n")
    result = subprocess.run([*evaluator(tiny_dir, model_dir, "--eval_timeout=1"), "--epochs=4",
                             "--set=schedule.warmup_epochs=0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "going on after epoch-0002 (1 row(s) in" in result.stdout
    assert "epoch-0002: loss" not in result.stdout and "epoch-0003: loss" in result.stdout
    assert "tfdp: evaluate: no new checkpoint for 1 s; stopping after 1 checkpoint(s)" in result.stdout
    assert [r["checkpoint"] for r in read_jsonl(model_dir / "eval_metrics.jsonl")] == ["epoch-0002", "epoch-0003"]
    # epoch 2's recorded top-1 (0.99) beats epoch 3's: the best checkpoint is not replaced by a worse one.
    assert not (model_dir / "checkpoints" / "best.json").exists()

    bad = run_tfdp("evaluate", *RUN, f"--model_dir={model_dir}", "--continuous", "--poll_seconds=0")
    assert_one_line_error(bad, 2, "--poll_seconds must be above 0, got 0")
    bad = run_tfdp("evaluate", *RUN, f"--model_dir={model_dir}", "--continuous", "--checkpoint=x.weights.h5")
    assert_one_line_error(bad, 2, "--checkpoint names one checkpoint; --continuous evaluates each one")
