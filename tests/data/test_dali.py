"""data.decoder: dali on CPU (DALI's CPU operators, `device_id=None`), 2 logical CPU replicas, no GPU.

DALI only decodes and crops; the examples, their order, the stream positions and
the corrupt-image bookkeeping are tfdp's. Each training image here is one flat
colour that names it, so a decoded, cropped and resized image still says which
file it came from. The GPU half ("mixed" decoding, the speed) is not run here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from conftest import CPU_DEVICES, REPO, assert_one_line_error, read_jsonl, run_tfdp
from support.inprocess import evaluate_in_process, train_in_process
from tfdp.commands.predict import predict, read_rows, request
from tfdp.config import DataConfig, validate
from tfdp.data import build_source, dali, preprocess
from tfdp.data.corrupt import LOG
from tfdp.data.pipeline import Bookkeeping, StreamPosition, eval_dataset, streams_dataset, train_dataset
from tfdp.distribute.cluster import free_ports
from tfdp.distribute.strategy import Runtime, make_runtime
from tfdp.models import build_model
from tfdp.errors import UserError
from support.dali_batches import BROKEN, CLASSES, replica_batches, write_id_tree

pytestmark = pytest.mark.skipif(bool(dali.available()), reason=f"NVIDIA DALI's TensorFlow plugin does not import "
                                                               f"here ({dali.available()}): pip install tfdp[dali]")

@pytest.fixture(scope="module")
def id_tree(tmp_path_factory) -> str:
    """46 flat-colour JPEGs of 4 classes (image i in class i mod 4) of assorted sizes; image 13 cut short."""
    root = tmp_path_factory.mktemp("ids")
    write_id_tree(root)
    return str(root)


def runtime_of(kind: str, replicas: int) -> Runtime:
    """A one-host runtime on the first `replicas` of conftest's logical CPUs."""
    devices = CPU_DEVICES[:replicas]
    strategy = (tf.distribute.OneDeviceStrategy(devices[0]) if kind == "one_device"
                else tf.distribute.MirroredStrategy(devices))
    return Runtime(strategy, kind, tuple(devices))


@pytest.mark.parametrize("kind, replicas, repeated", [("mirrored", 2, 1), ("mirrored", 2, 2), ("mirrored", 1, 1),
                                                      ("one_device", 1, 1)])
def test_dali_batches_hold_the_tf_paths_examples_in_its_order_and_resume_at_a_position(id_tree, kind, replicas,
                                                                                       repeated):
    """Two replicas are dealt the stream's batches (`dali.Dealer`); one reads the stream itself. Under one_device
    the dataset per replica is tfdp's own (`Runtime.datasets_per_replica`), as under multi_worker."""
    cfg = DataConfig(format="image_folder", dir=id_tree, image_size=8, shuffle_buffer=16, max_bad_fraction=0.2,
                     repeated_augmentation=repeated)
    split = build_source(cfg).split("train")
    runtime = runtime_of(kind, replicas)
    LOG.clear()
    tf_steps, tf_bad, tf_positions = replica_batches(runtime, split, cfg, (0, 0), 8)
    LOG.clear()
    dali_cfg = dataclasses.replace(cfg, decoder="dali")
    dali_steps, dali_bad, dali_positions = replica_batches(runtime, split, dali_cfg, (0, 0), 8)

    assert dali_steps == tf_steps  # per step, per replica: the same files, labels and order
    assert all(ids and all(i % CLASSES == label for i, label in zip(ids, labels))
               for step in dali_steps for ids, labels in step)
    # The same records consumed and corrupt images met after every step (what a checkpoint stores), and the
    # broken image named by path, as on the tf path. (The running corrupt count is not compared: each
    # pipeline reads ahead of the steps by its own prefetch depth.)
    assert dali_positions == tf_positions
    assert dali_bad >= dali_positions[-1][1] and tf_bad >= tf_positions[-1][1]
    broken = [p for p in split.files if p.endswith(f"{BROKEN:04d}.jpg")]
    # Only the broken image is ever named; the stream names it as it decodes the next image, a stage before it
    # counts it, so a stream deleted in between has named it in its read-ahead without counting it.
    assert list(LOG.entries) in ([], broken) and (list(LOG.entries) == broken or not dali_bad)
    if repeated == 1:  # with every image once per epoch, 8 steps of 8 pass image 13
        assert dali_positions[-1][1] >= 1 and "Invalid JPEG data" in LOG.entries[broken[0]]

    # A stream started at a checkpoint's position goes on with the uninterrupted stream's examples.
    resumed, _, _ = replica_batches(runtime, split, dali_cfg, dali_positions[2], 3)
    assert resumed == dali_steps[3:6]


def test_several_streams_on_one_worker_are_dealt_to_dali_in_the_tf_paths_order(id_tree):
    """An elastic resume (`tfdp.train.input_streams`): a 2-worker run's two streams, read from a checkpoint's
    positions by one worker of 2 replicas, joined step by step and dealt to its DALI pipelines, hold the tf
    path's examples on each replica in its order, 32 different whole images in 4 steps. DALI's batches are made
    first and the tf path's after, on the same strategy: DALI's datasets per replica must leave the strategy's own
    input as it was (TensorFlow's PER_REPLICA path does not: tfdp.distribute.strategy._dataset_per_device)."""
    cfg = DataConfig(format="image_folder", dir=id_tree, image_size=8, shuffle_buffer=16, max_bad_fraction=0.2)
    split = build_source(cfg).split("train")
    runtime = runtime_of("mirrored", 2)
    starts = [(4, 0), (4, 0)]   # each stream after its first step (4 of a global batch of 8)

    def steps(decoder: str) -> list:
        data = dataclasses.replace(cfg, decoder=decoder)

        def streams(ctx):
            return streams_dataset(split, data, 8, 3, 2, {s: Bookkeeping(start, StreamPosition(), None, CLASSES)
                                                          for s, start in enumerate(starts)}, ctx)
        return replica_batches(runtime, split, data, (0, 0), 4, stream=streams)[0]
    dali_steps = steps("dali")
    assert dali_steps == steps("tf")
    ids = [i for step in dali_steps for replica_ids, _ in step for i in replica_ids]
    assert len(ids) == 32 == len(set(ids)) and BROKEN not in ids
    assert all(i % CLASSES == label for step in dali_steps for ids, labels in step for i, label in zip(ids, labels))


# Replicas per worker in the clusters below: each worker deals its share between its DALI pipelines, as a host of
# several GPUs does. One replica per worker is the same code with one pipeline (`Runtime.datasets_per_replica`), and
# a single DALI pipeline's order is checked above ("one_device", "mirrored" on 1); each case is a cluster's 17 CPU-s.
PER_WORKER = 2


@pytest.mark.slow
def test_dali_on_two_workers_gives_each_its_share_in_the_tf_paths_order(id_tree, tmp_path):
    """A real 2-worker MultiWorkerMirroredStrategy cluster on 127.0.0.1 (`tests/support/dali_batches.py` in each
    process): each worker's DALI batches hold its own share of the tf path's, in its order, and resume at a
    position. TensorFlow's own per-worker input would deal them through its MultiDeviceIterator, which crashes
    over DALI; tfdp builds a dataset per replica there (`Runtime.datasets_per_replica`). With 2 replicas per
    worker (`distribute.cpu_replicas_per_worker`, as a host's GPUs), each worker's share is dealt between its
    two DALI pipelines as the tf path deals it."""
    ports = free_ports(2)
    procs = []
    for index in range(2):
        tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker",
                                                                                     "index": index}}
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", "support", "dali_batches.py"), id_tree,
             str(tmp_path / f"worker-{index}.json"), str(PER_WORKER)], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "TF_CONFIG": json.dumps(tf_config)}))
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    found = [json.loads((tmp_path / f"worker-{index}.json").read_text()) for index in range(2)]
    for worker in found:
        assert worker["dali"] == worker["tf"]  # steps (per local replica) and stream positions alike
        assert all(len(step) == PER_WORKER for step in worker["dali"]["steps"])
        assert worker["resumed"] == worker["dali"]["steps"][2:5]
        assert all(i % CLASSES == label for step in worker["dali"]["steps"] for ids, labels in step
                   for i, label in zip(ids, labels))
    # each worker reads its own share: no image in both workers' first epoch (23 images each, 4 a step)
    first_epoch = [{i for step in worker["dali"]["steps"][:5] for ids, _ in step for i in ids} for worker in found]
    assert all(len(ids) >= 16 for ids in first_epoch) and not first_epoch[0] & first_epoch[1], first_epoch


@pytest.mark.full(reason="50 CPU-s of a cluster: each worker's DALI share is "
                         "test_dali_on_two_workers_gives_each_its_share_in_the_tf_paths_order")
@pytest.mark.slow
def test_tfdp_launch_trains_with_dali_on_two_workers_to_one_model(tmp_path, tiny_dir):
    """`tfdp launch --workers=2` with data.decoder: dali: MultiWorkerMirroredStrategy's `fit`, each worker's DALI
    pipeline fed its own share; both workers end with the same weights (the all-reduce over DALI's batches). With
    2 replicas per worker, as on hosts of several GPUs, each worker deals its share to two DALI pipelines."""
    launched = run_tfdp("launch", "--workers=2", f"--launch_logs={tmp_path}/logs", "--", "train",
                        "--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=8",
                        f"--data_dir={tiny_dir}", "--data_format=image_folder", f"--model_dir={tmp_path}/run",
                        "--epochs=2", "--set=schedule.warmup_epochs=0", "--set=data.decoder=dali",
                        f"--set=distribute.cpu_replicas_per_worker={PER_WORKER}",
                        f"--batch_size_per_replica={32 // PER_WORKER}", timeout=600)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    assert f"on {2 * PER_WORKER} replica(s), global batch 64" in launched.stdout, launched.stdout[-3000:]
    for worker in (0, 1):
        assert (f"[worker {worker}] tfdp: data: training and validation images decoded and cropped by DALI"
                in launched.stdout), launched.stdout[-3000:]
    prints = dict(re.findall(r"tfdp: worker (\d) of 2: weights fingerprint (\w+)", launched.stdout))
    assert set(prints) == {"0", "1"} and prints["0"] == prints["1"], launched.stdout[-3000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)


@pytest.mark.full(reason="70 CPU-s: DALI's training input is test_tfdp_trains_the_demo_with_dali, the "
                         "benchmark's measurement is checked in parts by tests/train/test_observability.py in the "
                         "README's tier")
@pytest.mark.slow
def test_tfdp_benchmark_measures_the_input_as_tfdp_train_decodes_it(tmp_path, tiny_dir):
    """`tfdp benchmark` with data.decoder: dali: its real-data row trains through DALI and its input rates are the
    stream's decoded by DALI, as `tfdp train` would run (the rates' worth is a GPU's; here the wiring)."""
    out = tmp_path / "bench"
    result = run_tfdp("benchmark", "--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=16",
                      f"--data_dir={tiny_dir}", "--data_format=image_folder", "--max_replicas=1", "--steps=1",
                      "--warmup_steps=1", f"--benchmark_dir={out}", "--set=data.decoder=dali", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((out / "benchmark.json").read_text())
    assert data["decoder"] == "dali" and "input pipeline alone (data.decoder dali)" in result.stdout
    assert data["input_pipeline_images_per_sec"] > 0 and data["input_beside_training_images_per_sec"] > 0
    assert data["rows"][0]["real_data_images_per_sec"] > 0


def test_an_image_dali_cannot_decode_is_failed_before_it_and_a_whole_one_passes(id_tree):
    transform = preprocess.encoded_transform(DataConfig(decoder="dali"), 0)
    files = build_source(DataConfig(format="image_folder", dir=id_tree)).split("train").files
    whole = next(p for p in files if p.endswith("0001.jpg"))
    data = tf.io.read_file(whole)
    assert transform(data, tf.constant(0, tf.int64)).numpy() == data.numpy()
    for bad in (data.numpy()[:-2], b"not an image at all", data.numpy()[:300]):
        with pytest.raises((tf.errors.OpError, ValueError)):
            transform(tf.constant(bad), tf.constant(0, tf.int64))


@pytest.mark.parametrize("raw, message", [
    ({"train": {"deterministic": True}}, "train.deterministic cannot use data.decoder: dali"),
    ({"data": {"deterministic": True}}, "data.deterministic cannot use data.decoder: dali"),
    ({"data": {"format": "synthetic"}}, "nothing to decode"),
])
def test_what_dali_cannot_do_is_refused_in_the_config(raw, message):
    raw = {**raw, "data": {**raw.get("data", {}), "decoder": "dali"}}
    with pytest.raises(UserError, match=re.escape(message)):
        validate(raw)


def test_auto_is_tf_on_cpu_replicas_and_dali_names_the_install_command_where_it_is_missing(tmp_path, tiny_dir):
    assert dali.choose(DataConfig(decoder="auto", format="image_folder"), list(CPU_DEVICES)) == "tf"
    assert dali.choose(DataConfig(decoder="dali", format="image_folder"), list(CPU_DEVICES)) == "dali"
    shim = tmp_path / "shim" / "nvidia" / "dali"
    shim.mkdir(parents=True)
    (shim.parent / "__init__.py").write_text("")
    (shim / "__init__.py").write_text("raise ImportError('No module named nvidia.dali (simulated)')\n")
    result = run_tfdp("train", "--config=configs/digits.yaml", f"--data_dir={tiny_dir}", "--data_format=image_folder",
                      f"--model_dir={tmp_path / 'run'}", "--set=data.decoder=dali",
                      env_extra={"PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), REPO])})
    assert_one_line_error(result, 2, "data.decoder: dali needs NVIDIA DALI", "--no-build-isolation",
                          "nvidia-dali-tf-plugin-cuda120")


@pytest.fixture(scope="module")
def photo_tree(tmp_path_factory) -> str:
    """A validation split of 12 real photos (2 classes) at assorted sizes, both orientations; photo 5 cut short."""
    from support.photos import photo_jpeg, real_photos
    root, rng = tmp_path_factory.mktemp("photos"), np.random.default_rng(0)
    photos = real_photos()
    for i in range(12):
        folder = root / "val" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        size = (int(rng.integers(60, 140)), int(rng.integers(60, 140)))
        data = photo_jpeg(photos[i % len(photos)], rng, size=size)
        (folder / f"{i:04d}.jpg").write_bytes(data[:len(data) // 2] if i == 5 else data)
    return str(root)


def validation_batches(split, cfg: DataConfig, replicas: int = 2):
    """Every step of the validation pipeline per replica: (images, labels, weights) arrays."""
    runtime = runtime_of("mirrored", replicas)
    strategy = runtime.strategy

    def worker(ctx):
        return eval_dataset(split, cfg, 8, ctx, num_classes=2)
    ds = (strategy.distribute_datasets_from_function(worker) if cfg.decoder == "tf"
          else dali.distribute_evaluation(runtime, worker, cfg, 8))
    return [[tuple(x.numpy() for x in replica) for replica in zip(*(strategy.experimental_local_results(t)
                                                                   for t in step))] for step in ds]


@pytest.mark.parametrize("replicas", [2, 1])
def test_validation_with_dali_holds_every_image_once_in_the_tf_paths_central_window(photo_tree, replicas):
    """12 photos, one cut short, 8 a step: the same steps, labels and weight-0 padding per replica as the tf
    path, the broken photo left out and named, and each image DALI's decode of the tf path's window."""
    cfg = DataConfig(format="image_folder", dir=photo_tree, image_size=24, eval_image_size=32, max_bad_fraction=0.2)
    split = build_source(cfg, splits=("val",)).split("val")
    LOG.clear()
    ours = validation_batches(split, dataclasses.replace(cfg, decoder="dali"), replicas)
    assert list(LOG.entries) == [p for p in split.files if p.endswith("0005.jpg")]
    theirs = validation_batches(split, cfg, replicas)
    whole = validation_batches(split, dataclasses.replace(cfg, eval_crop_fraction=1.0), replicas)

    assert len(ours) == len(theirs) == 2
    assert all(images.shape == (8 // replicas, 32, 32, 3) for step in ours for images, _, _ in step)
    flat = [[np.concatenate(part) for part in zip(*(batch for step in run for batch in step))]
            for run in (ours, theirs, whole)]
    (images, labels, weights), (tf_images, tf_labels, tf_weights), (whole_images, _, _) = flat
    assert labels.tolist() == tf_labels.tolist() and weights.tolist() == tf_weights.tolist()
    assert weights.sum() == 11 and weights.tolist().count(0) == 16 - 11   # every whole photo once
    real = weights > 0
    # Both decode with libjpeg-turbo here: the same window is about 0.02 levels off on average (on a GPU, DALI's
    # mixed decoder rounds its own way: not run here). One pixel off (DALI's default rounding of the window's
    # corner) is 5 levels off; the whole image (no crop) 23.
    off = np.abs(images[real].astype(float) - tf_images[real]).mean()
    assert off < 1 < np.abs(whole_images[real].astype(float) - tf_images[real]).mean(), off


def test_predict_with_dali_gives_each_photo_the_tf_paths_row(photo_tree, tmp_path, capsys):
    """`tfdp predict` (in this process) with data.decoder: dali on 2 replicas: 12 real photos of assorted sizes,
    one cut short, and the oddities ILSVRC2012's raw tree holds (a CMYK JPEG, a greyscale one, a PNG named .jpg),
    8 a step: one row per photo in the tf path's order, each whole photo with the tf path's classes and
    probabilities (both decode the same central window with libjpeg-turbo here), the cut-short one an error row
    saying why (DALI's check before it: no end-of-image marker), as one whose header is cut but whose end marker
    is there and a PNG cut short (the check parses the header, decodes the PNG: DALI would stop on either)."""
    tree = tmp_path / "photos"
    shutil.copytree(photo_tree, tree)
    photo = Image.open(tree / "val" / "c0" / "0000.jpg")
    photo.convert("CMYK").save(tree / "val" / "c0" / "odd_cmyk.jpg", "JPEG")
    photo.convert("L").save(tree / "val" / "c0" / "odd_grey.jpg", "JPEG")
    photo.save(tree / "val" / "c0" / "odd_png.jpg", "PNG")
    whole = (tree / "val" / "c0" / "0000.jpg").read_bytes()
    (tree / "val" / "c0" / "odd_header.jpg").write_bytes(whole[:120] + whole[-2:])
    png = (tree / "val" / "c0" / "odd_png.jpg").read_bytes()
    (tree / "val" / "c0" / "odd_png_cut.jpg").write_bytes(png[:len(png) // 2])
    raw = {"model_dir": str(tmp_path), "model": {"name": "simple_cnn", "num_classes": 2},
           "data": {"format": "image_folder", "dir": str(tree), "image_size": 32},
           "train": {"batch_size_per_replica": 4}, "distribute": {"strategy": "mirrored", "cpu_replicas": 2}}
    cfg = validate(raw)
    keras.utils.set_random_seed(0)
    weights = str(tmp_path / "random.weights.h5")
    build_model(cfg.model, cfg.data).save_weights(weights)
    runtime = make_runtime(cfg.distribute)
    rows = {}
    for decoder in ("tf", "dali"):
        data = validate({**raw, "data": {**raw["data"], "decoder": decoder}})
        capsys.readouterr()
        summary = predict(data, runtime, weights, request(data, str(tree / "val"),
                                                           str(tmp_path / f"{decoder}.jsonl"), top_k=2))
        said = capsys.readouterr().out
        assert summary["images"] == 17 and summary["failed"] == 3, summary
        assert ("decoded and cropped by DALI" in said) == (decoder == "dali"), said
        rows[decoder] = read_rows(str(tmp_path / f"{decoder}.jsonl"))
    assert [r["path"] for r in rows["dali"]] == [r["path"] for r in rows["tf"]]
    assert sum("odd_" in r["path"] for r in rows["dali"]) == 5
    for ours, theirs in zip(rows["dali"], rows["tf"]):
        if ours["path"].endswith("0005.jpg"):
            assert ours["predictions"] == [] and theirs["error"]
            assert ours["error"] == "a truncated JPEG: no end-of-image marker"   # the check's own words, alone
            continue
        if ours["path"].endswith(("odd_header.jpg", "odd_png_cut.jpg")):
            assert ours["predictions"] == [] and ours["error"].startswith("Invalid") and theirs["error"]
            continue
        assert ours["error"] is None and [p["class"] for p in ours["predictions"]] == [
            p["class"] for p in theirs["predictions"]], (ours, theirs)
        assert np.allclose([p["probability"] for p in ours["predictions"]],
                           [p["probability"] for p in theirs["predictions"]], atol=0.002), (ours, theirs)


def test_tfdp_trains_the_demo_with_dali(tmp_path, tiny_dir):
    """The demo's config with data.decoder: dali, through `tfdp train` (in this process: the exit status is not
    the point) on its 2 CPU replicas; its ResNet-18's smaller sibling with the same stem and batch norm."""
    args = ["--config=configs/digits.yaml", f"--data_dir={tiny_dir}", "--data_format=image_folder",
            "--model=resnet10_small", f"--model_dir={tmp_path}"]
    _, stdout = train_in_process(*args, "--epochs=1", "--set=schedule.warmup_epochs=0", "--set=data.decoder=dali")
    assert "training and validation images decoded and cropped by DALI" in stdout
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1] and np.isfinite(rows[0]["loss"])
    # `tfdp evaluate` with each decoder: every validation image once, the same predictions (here both decode
    # with libjpeg-turbo and resize alike: at most one of the 40 images may fall the other way).
    (tf_result, tf_out), (dali_result, dali_out) = (evaluate_in_process(*args, f"--set=data.decoder={decoder}")
                                                    for decoder in ("tf", "dali"))
    assert "validation images decoded and cropped by DALI" in dali_out and "DALI" not in tf_out
    assert tf_result["examples"] == dali_result["examples"] == 40
    assert abs(tf_result["top1"] - dali_result["top1"]) <= 1 / 40, (tf_result, dali_result)
    assert abs(tf_result["top1"] - rows[0]["val_top1"]) <= 1 / 40, (tf_result, rows[0])


@pytest.mark.slow
def test_shards_train_with_dali_and_a_run_killed_mid_epoch_resumes_at_its_position_on_fewer_replicas(tmp_path):
    """Killed on 2 replicas after a step checkpoint, resumed by the same command on 1 (the checkpoint's global
    batch of 8 as 1 replica x 4 x 2 micro-batches, DALI's pipeline now on the one replica): the resumed run
    goes on from the killed run's stream position, and every epoch ends where the uninterrupted run's does."""
    from test_data_faults import write_shards
    data, model_dir = tmp_path / "shards", tmp_path / "run"
    write_shards(str(data))  # 24 training records in 2 shards: 3 steps of 8 per epoch
    args = ["train", "--config=configs/digits.yaml", "--model=simple_cnn", f"--data_dir={data}",
            "--data_format=tfrecord", "--set=data.train_split=train", "--set=data.val_split=validation",
            "--set=model.num_classes=3", f"--model_dir={model_dir}", "--epochs=2", "--set=data.image_size=16",
            "--set=train.batch_size_per_replica=4", "--set=train.checkpoint_every_steps=1", "--set=data.decoder=dali"]
    proc = subprocess.Popen([sys.executable, "-m", "tfdp", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    checkpoints = model_dir / "checkpoints"
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not (
            checkpoints.exists() and any(p.startswith("step-") for p in os.listdir(checkpoints))):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    steps = sorted(int(p[len("step-"):]) for p in os.listdir(checkpoints) if p.startswith("step-"))
    assert steps and steps[-1] % 3, steps  # killed mid-epoch, after a step checkpoint
    with open(checkpoints / f"step-{steps[-1]:09d}" / "state.json", encoding="utf-8") as f:
        saved = json.load(f)
    assert saved["input"] == [[8 * steps[-1], 0]]  # records consumed: 8 per step on the one stream

    # the resumed run in this process (its exit status is not the point), on one of its CPU devices
    _, final = train_in_process(*args[1:], "--set=distribute.cpu_replicas=1")
    assert f"resuming at epoch 1 of 2, step {steps[-1] + 1} of 3" in final, final
    assert ("resuming at the checkpoint's global batch 8: 1 replica x 4 x 2 micro-batches (the checkpoint's: "
            "2 replicas x 4 x 1 micro-batch)") in final, final
    assert [r["epoch"] for r in read_jsonl(model_dir / "metrics.jsonl")] == [1, 2]
    for epoch, records in ((1, 24), (2, 48)):
        with open(checkpoints / f"epoch-{epoch:04d}" / "state.json", encoding="utf-8") as f:
            assert json.load(f)["input"] == [[records, 0]]


def test_an_image_dali_stops_on_is_one_line_naming_the_tf_decoder(id_tree):
    """What passes the check but stops DALI anyway ends the run in one line (here the check is left out)."""
    files = build_source(DataConfig(format="image_folder", dir=id_tree)).split("train").files
    broken = next(p for p in files if p.endswith(f"{BROKEN:04d}.jpg"))
    with tf.device("/cpu:0"):
        batches = tf.data.Dataset.from_tensors((tf.stack([tf.io.read_file(broken)] * 2), tf.zeros([2], tf.int32)))
    ds = dali.replica_pipeline(dali.padded(batches), DataConfig(image_size=8), 2, "/device:CPU:0", seed=0)
    with pytest.raises(tf.errors.OpError) as raised:
        next(iter(ds))
    line = preprocess.dali_stopped(raised.value.message)
    assert re.fullmatch(r"DALI stopped the input in nvidia\.dali\.fn\.decoders\.image_random_crop: "
                        r"\S[^\n]* \(data\.decoder: dali; with data\.decoder: tf an image that cannot be decoded "
                        r"is skipped and named\)", line), line
    assert preprocess.dali_stopped("some other error") == ""


def test_dali_threads_are_the_setting_or_the_hosts_cores_shared_among_the_replicas():
    cores = len(os.sched_getaffinity(0))
    assert dali.pipeline_threads(DataConfig(dali_threads=3), on_gpu=True, replicas=8) == 3
    assert dali.pipeline_threads(DataConfig(), on_gpu=False, replicas=1) == cores
    assert dali.pipeline_threads(DataConfig(), on_gpu=False, replicas=cores + 1) == 1
    assert dali.pipeline_threads(DataConfig(), on_gpu=True, replicas=1) == min(3, cores)   # measured: docs/benchmarks.md
    assert dali.pipeline_threads(DataConfig(), on_gpu=True, replicas=cores) == 1
    with pytest.raises(UserError, match="dali_hw_decoder_load"):
        validate({"data": {"decoder": "dali", "dali_hw_decoder_load": 1.5}})


def test_a_replicas_dali_dataset_leaves_tf_data_nothing_to_autotune_at_its_outermost(id_tree):
    """Deleting a DALI replica dataset's iterator waited on tf.data's autotuner thread (Keras deletes the last
    validation iterator as each evaluation starts: 7.6-8.8 s in 11 of 20 evaluations on 2 workers); its outermost
    stages (the copy to the device, a prefetch of 2) have nothing to tune, so the autotuner is off there, and the
    stream DALI reads keeps it."""
    cfg = DataConfig(format="image_folder", dir=id_tree, image_size=8, decoder="dali")
    rows = dali.padded(train_dataset(build_source(cfg).split("train"), cfg, 4, 0))
    decoded = dali.replica_pipeline(rows, cfg, 4, "/device:CPU:0", seed=0)
    assert decoded.options().autotune.enabled is False
    assert rows.options().autotune.enabled is not False
    images, labels = next(iter(decoded))
    assert images.shape == (4, 8, 8, 3) and labels.shape == (4,)
