"""Exact resume: step checkpoints, kill -9 at random steps, damaged checkpoints, TensorBoard after restarts."""

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, last_line, read_jsonl, run_tfdp
from tfdp.config import DistributeConfig
from tfdp.distribute.replica_state import start_random_streams
from tfdp.distribute.strategy import make_runtime
from tfdp.rundir.checkpoints import CheckpointStore


def small_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("damage", ["truncated weights", "half-written state"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, capsys, damage):
    store = CheckpointStore(str(tmp_path))
    model = small_model()
    saved = {}
    for step in (2, 4):
        model.layers[0].kernel.assign(np.full((4, 3), step, np.float32))
        store.save(model, {"epoch": 0, "step": step, "step_in_epoch": step, "best": None}, kind="step")
        saved[step] = model.get_weights()
    newest = tmp_path / "checkpoints" / "step-000000004"
    if damage == "truncated weights":  # as a failing disk or a bad copy leaves it
        weights = newest / "model.weights.h5"
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 3)
    else:
        (newest / "state.json").write_text('{"epoch": ')

    fresh = small_model()
    state = store.restore_latest(fresh)
    assert state["step"] == 2
    for a, b in zip(fresh.get_weights(), saved[2]):
        np.testing.assert_array_equal(a, b)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("tfdp: warning: skipping") and str(newest) in err[0], err
    assert newest.exists()  # nothing deleted that someone could still recover


def test_step_checkpoints_are_pruned_and_superseded_by_the_epoch_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    model = small_model()
    for step in (2, 4, 6, 8):
        store.save(model, {"epoch": 0, "step": step, "step_in_epoch": step, "best": None}, kind="step")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-000000006", "step-000000008"]
    store.save(model, {"epoch": 1, "step": 10, "step_in_epoch": 0, "best": None})
    store.save(model, {"epoch": 1, "step": 12, "step_in_epoch": 2, "best": None}, kind="step")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch-0001", "step-000000012"]


def test_a_resumed_model_continues_every_replicas_random_stream(tmp_path):
    """Keras' weights file leaves seed generators out: the checkpoint's own record of them gives each of 2
    replicas back the very flips a run never stopped draws next; a checkpoint without it says so in one line."""
    strategy = make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy
    x = tf.reshape(tf.range(64 * 16, dtype=tf.float32), [64, 4, 4, 1])

    def flipping_model():
        with strategy.scope():
            model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.RandomFlip("horizontal", seed=7)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    def flips(model):
        out = strategy.experimental_local_results(strategy.run(tf.function(lambda: model(x, training=True))))
        return [np.any(o.numpy() != x.numpy(), axis=(1, 2, 3)).tolist() for o in out]

    model, store = flipping_model(), CheckpointStore(str(tmp_path))
    assert start_random_streams(model, None) == ""
    for _ in range(2):
        flips(model)
    store.save(model, {"epoch": 1, "step": 2, "step_in_epoch": 0, "best": None})
    uninterrupted = flips(model)
    assert uninterrupted[0] != uninterrupted[1]  # each replica its own stream

    resumed = flipping_model()
    assert start_random_streams(resumed, store.restore_latest(resumed)) == ""
    assert flips(resumed) == uninterrupted

    state_file = tmp_path / "checkpoints" / "epoch-0001" / "state.json"
    state_file.write_text(json.dumps({k: v for k, v in json.loads(state_file.read_text()).items()
                                      if k != "random_streams"}))  # as a checkpoint written before it was kept
    old = flipping_model()
    line = start_random_streams(old, store.restore_latest(old))
    assert line.startswith("tfdp: the checkpoint holds no state of the random layers") and "restart" in line
    assert flips(old) != uninterrupted


def demo_args(data_dir, model_dir, epochs=3, every=2, size=8, model="resnet10_small"):
    """The demo's recipe with a ResNet with batch norm (resnet10_small: the demo's ResNet-18 with one block per
    stage, at 0.6x its CPU) on 2 replicas, deterministic, a step checkpoint every 2 steps; at 8 px (its smallest
    input: batch norm down to 1x1 maps) its steps cost a quarter of 16 px's."""
    return ["train", "--config=configs/digits.yaml", f"--model={model}", f"--data_dir={data_dir}",
            "--data_format=image_folder", f"--model_dir={model_dir}", f"--epochs={epochs}", f"--set=data.image_size={size}",
            f"--set=train.checkpoint_every_steps={every}", "--set=train.deterministic=true"]


def fingerprint(stdout):
    return re.findall(r"weights fingerprint (\w+)", stdout)


@pytest.mark.full(reason="100 CPU-s of kills at random steps: resuming from a step checkpoint is checked by "
                         "test_sigterm_on_one_host_saves_where_it_is_and_loses_no_step and tests/test_cli.py's "
                         "killed-run test")
@pytest.mark.slow
def test_killed_at_random_steps_ends_bit_identical_to_an_uninterrupted_run(tmp_path, small_dir):
    """kill -9 twice at random moments (during steps or checkpoint writes), resume each time; with random flips
    and drop path (the layer every family's residual branches use, the ViTs' and ConvNeXts' too), whose streams
    every resume continues. The killed runs are `tfdp` processes; the uninterrupted run and the last resume,
    where the process boundary is not the point, are `tfdp train`'s function in this process."""
    from support.inprocess import train_in_process
    stochastic = ["--set=data.hflip=true", "--set=model.drop_path=0.1"]
    _, clean_stdout = train_in_process(*demo_args(small_dir, tmp_path / "clean")[1:], *stochastic)
    model_dir = tmp_path / "killed"
    rng = random.Random(7)
    resumed_steps = []
    for kill in range(2):
        proc = subprocess.Popen([sys.executable, "-m", "tfdp", *demo_args(small_dir, model_dir), *stochastic],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # Wait for this run's first new checkpoint, then kill after a random delay: mid-step or mid-write.
        before = set(checkpoint_dirs(model_dir))
        deadline = time.time() + 300
        while not set(checkpoint_dirs(model_dir)) - before and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 1.5))
        proc.send_signal(signal.SIGKILL)
        out = proc.communicate()[0]
        if m := re.search(r"resuming at epoch (\d+) of 3(?:, step (\d+) of 5)?", out):
            resumed_steps.append((int(m.group(1)) - 1) * 5 + int(m.group(2) or 1) - 1)
    _, final_stdout = train_in_process(*demo_args(small_dir, model_dir)[1:], *stochastic)
    assert "tfdp: resuming at epoch" in final_stdout and "random streams" not in final_stdout
    assert len(resumed_steps) == 1 and resumed_steps[0] > 0  # the second run went on from the first's checkpoint
    assert fingerprint(final_stdout) == fingerprint(clean_stdout) != []
    assert last_line(final_stdout).split(",")[:2] == last_line(clean_stdout).split(",")[:2]  # same epochs, top-1
    assert [r["epoch"] for r in read_jsonl(model_dir / "metrics.jsonl")] == [1, 2, 3]
    assert not [p for p in os.listdir(model_dir / "checkpoints") if p.startswith(".tmp")]
    clean_rows, rows = read_jsonl(tmp_path / "clean" / "metrics.jsonl"), read_jsonl(model_dir / "metrics.jsonl")
    for key in ("loss", "top1", "val_loss", "val_top1"):  # the partial epochs' metrics continued exactly
        assert [round(r[key], 5) for r in rows] == [round(r[key], 5) for r in clean_rows], key
    steps = tensorboard_steps(model_dir / "tensorboard" / "train", "epoch_loss")
    assert steps == [0, 1, 2]  # one point per epoch after the restarts' purges

    # What training reported for the last epoch is what `tfdp evaluate` finds in its checkpoint (its command
    # function, in this process: the process boundary is not the point here).
    from support.inprocess import evaluate_in_process
    _, evaluated = evaluate_in_process(*demo_args(small_dir, model_dir)[1:], *stochastic,
                                       checkpoint=f"{model_dir}/checkpoints/epoch-0003/model.weights.h5")
    assert f"loss {rows[-1]['val_loss']:.4f}, top1 {rows[-1]['val_top1']:.4f}" in evaluated


def checkpoint_dirs(model_dir):
    root = model_dir / "checkpoints"
    return [p for p in os.listdir(root) if not p.startswith(".")] if root.exists() else []


def test_a_run_resumed_inside_epoch_0_drops_the_killed_runs_epoch_0_from_tensorboard(tmp_path):
    """A run killed after logging epoch 0 but before its epoch checkpoint resumes inside epoch 0 (initial epoch 0)
    and logs epoch 0 again: TensorBoard must show it once, the resumed run's. As the random-kill test above met
    it twice: the resumed run opens its writers in the second it marks the restart (one for the rest of epoch 0,
    one for the epochs after), in a process whose TensorFlow writers are numbered 1x and whose TensorBoard writers
    (tensorboard's own counter) are numbered 2 and up: an event file counted '2' sorts after one counted '1x'."""
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tfdp.train.callbacks import tensorboard
    scratch = (tmp_path / "scratch" / str(i) for i in range(10**6))
    while not re.fullmatch(r"1\d+", writer_count(lambda run: tf.summary.create_file_writer(run).close(), next(scratch))):
        pass
    while writer_count(lambda run: EventFileWriter(run).close(), next(scratch)) < "2":
        pass

    def log(run, step_values):
        with tf.summary.create_file_writer(str(run)).as_default():
            for step, value in step_values:
                tf.summary.scalar("epoch_loss", value, step=step)
    for attempt in range(5):   # until the mark and the resumed run's writers share their second
        root = tmp_path / f"run{attempt}"
        log(root / "train", [(0, 2.0)])                                  # the killed run's epoch 0
        time.sleep(1.01 - time.time() % 1)                               # the start of a second
        tensorboard(str(root), (0, 0), initial_epoch=0)
        log(root / "train", [(0, 1.0)])                                  # the resumed run's epoch 0 ...
        log(root / "train", [(1, 0.5), (2, 0.25)])                       # ... and the epochs after
        if len({name.split(".")[3][:10] for name in os.listdir(root / "train")}) == 2:
            break
    assert len({name.split(".")[3][:10] for name in os.listdir(root / "train")}) == 2, os.listdir(root / "train")
    assert tensorboard_values(root / "train", "epoch_loss") == [(0, 1.0), (1, 0.5), (2, 0.25)]


def writer_count(open_writer, run):
    """The process-wide count a new event file writer puts in its file's name (TensorFlow's: `.<count>.v2`,
    tensorboard's own: `.<count>`)."""
    open_writer(str(run))
    return re.search(r"\.(\d+)(\.v2)?$", os.listdir(run)[0]).group(1)


def tensorboard_steps(run_dir, tag):
    """The steps TensorBoard's server shows for `tag` (its plugin accumulator, the one that purges tf.summary's
    tensor events at a restart; the legacy `EventAccumulator` purges only TF1 scalars)."""
    return [step for step, _ in tensorboard_values(run_dir, tag)]


def tensorboard_values(run_dir, tag):
    """(step, value) of each point TensorBoard's server shows for `tag`."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir), purge_orphaned_data=True)
    events.Reload()
    return sorted((e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag))


def test_resuming_with_a_model_that_does_not_fit_is_one_line_alone(tmp_path, small_dir):
    """The run that leaves the checkpoint is `tfdp train`'s function in this process (its checkpoint is the
    point, not its process); the one that cannot resume from it is a `tfdp` process: its exit code and its one
    line are."""
    from support.inprocess import train_in_process
    common = ["train", "--config=configs/digits.yaml", f"--data_dir={small_dir}", "--data_format=image_folder",
              f"--model_dir={tmp_path}/run", "--set=data.image_size=16", "--epochs=2"]
    first, _ = train_in_process(*common[1:], "--model=simple_cnn", "--epochs=1", "--set=schedule.warmup_epochs=0")
    assert first["epochs"] == 1, first
    other = run_tfdp(*common, "--model=resnet18_small", timeout=300)
    assert other.returncode == 2 and "Traceback" not in other.stdout + other.stderr
    err = [line for line in other.stderr.splitlines() if line.strip()]
    assert len(err) == 1, err  # no Keras warnings around it
    assert err[0].startswith(f"tfdp: error: checkpoint {tmp_path}/run/checkpoints/epoch-0001/model.weights.h5 "
                             "does not fit model 'resnet18_small'"), err
    # Keras' reason itself, not its opening "…Example error message for object <Conv2D …>:" cut at the colon
    assert re.search(r"\): \d+ layer\(s\) do not fit, the first \w+ '\w+': Layer '\w+' expected \d+ variables", err[0]), err


@pytest.mark.slow
def test_sigterm_on_one_host_saves_where_it_is_and_loses_no_step(tmp_path, small_dir):
    """SIGTERM once epoch 2 has begun: the run saves at the end of the step it is in (6 to 9: the preemption
    flag is read at each step's end but an epoch's last, whose epoch checkpoint follows), exits 143 and resumes
    there. The small CNN at 96 px: steps as long as the demo ResNet's at 16 px (about 0.2 s; the signal must come
    before step 9 of 10 ends) at half its CPU, which is tracing the ResNet's graph. The run after it, which resumes
    from the step saved, is `tfdp train`'s function in this process."""
    from support.inprocess import train_in_process
    args = demo_args(small_dir, tmp_path / "run", epochs=2, every=0, size=96, model="simple_cnn")
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tfdp", *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
        watchdog = threading.Timer(300, proc.kill)
        watchdog.start()
        # Keras prints "Epoch 2/2" when epoch 2 begins: after epoch 1's checkpoint and the preemption check that
        # follows it (a signal before that check is, rightly, an epoch-end save), before step 6 of 10 ends.
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.strip() == "Epoch 2/2":
                proc.send_signal(signal.SIGTERM)
                break
        out = "".join(seen) + proc.communicate(timeout=300)[0]
        watchdog.cancel()
        stderr.seek(0)
        err = stderr.read()
    assert "Epoch 2/2" in out, out[-2000:] + err[-2000:]
    assert proc.returncode == 143, err[-2000:]
    line = last_line(err)
    assert line.startswith("tfdp: preempted: saved at step ") and "exit 143" in line and "Traceback" not in err
    step = int(re.search(r"saved at step (\d+)", line).group(1))
    assert 5 < step < 10 and (tmp_path / "run" / "checkpoints" / f"step-{step:09d}").exists()
    _, again = train_in_process(*args[1:])
    assert f"resuming at epoch 2 of 2, step {step - 5 + 1} of 5" in again
    assert [r["epoch"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
