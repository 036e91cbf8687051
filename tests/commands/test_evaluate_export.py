"""Evaluation counts every image once; the export takes JPEG bytes and agrees with the trained model."""

import json
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_one_line_error, last_line, run_tfdp
from tfdp.config import validate
from tfdp.data import build_source
from tfdp.data.pipeline import eval_dataset
from tfdp.commands.evaluate import evaluate
from tfdp.commands.export import export_checkpoint
from tfdp.models import build_model
from tfdp.distribute.strategy import make_runtime

VAL_IMAGES = 37  # prime: never a multiple of the global batch


@pytest.fixture(scope="module")
def odd_dir(digits_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    shutil.copytree(os.path.join(digits_dir, "train"), root / "train")
    val = sorted((cls, f) for cls in os.listdir(os.path.join(digits_dir, "val"))
                 for f in os.listdir(os.path.join(digits_dir, "val", cls)))[::9][:VAL_IMAGES]
    for cls in os.listdir(os.path.join(digits_dir, "val")):
        os.makedirs(root / "val" / cls)
    for cls, f in val:
        shutil.copy(os.path.join(digits_dir, "val", cls, f), root / "val" / cls / f)
    return str(root)


def make_cfg(data_dir, model_dir, **train):
    return validate({"model_dir": str(model_dir), "model": {"name": "simple_cnn"},
                     "data": {"format": "image_folder", "dir": data_dir, "image_size": 16, "eval_crop_fraction": 1.0},
                     "train": {"batch_size_per_replica": 8, **train},
                     "distribute": {"strategy": "mirrored", "cpu_replicas": 2}})


@pytest.fixture(scope="module")
def checkpoint(odd_dir, tmp_path_factory):
    """A partly trained model's weights (some images right, some wrong), saved as a checkpoint."""
    cfg = make_cfg(odd_dir, tmp_path_factory.mktemp("ckpt"))
    keras.utils.set_random_seed(1)
    model = build_model(cfg.model, cfg.data)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    split = build_source(cfg.data).split("train")
    model.fit(eval_dataset(split, cfg.data, 64).take(6), verbose=0)
    path = os.path.join(cfg.model_dir, "w.weights.h5")
    model.save_weights(path)
    return cfg, path, model


def reference_predictions(model, cfg):
    split = build_source(cfg.data).split("val")
    batches = list(eval_dataset(split, cfg.data, 64))
    real = np.concatenate([w.numpy() for _, _, w in batches]) > 0
    images = np.concatenate([x.numpy() for x, _, _ in batches])[real]
    return images, np.argmax(model.predict(images, verbose=0), axis=1), np.array(split.labels)


def test_evaluate_counts_every_validation_image_once(checkpoint):
    cfg, path, model = checkpoint
    images, predicted, labels = reference_predictions(model, cfg)
    assert len(labels) == VAL_IMAGES
    expected = float(np.mean(predicted == labels))
    assert 0.0 < expected < 1.0  # a partly trained model: a dropped or doubled image would show
    result = evaluate(cfg, make_runtime(cfg.distribute), checkpoint=path)  # 2 replicas, global batch 16
    assert result["examples"] == VAL_IMAGES
    assert result["top1"] == pytest.approx(expected, abs=1e-6)
    assert round(result["top1"] * VAL_IMAGES, 4) == float(np.sum(predicted == labels))


def test_validation_loss_is_the_mean_over_real_images_on_any_replica_count(checkpoint):
    """37 images, global batch 8 (1 replica) or 16 (2 replicas): the padding never enters the loss."""
    from tfdp.config import DistributeConfig
    cfg, path, model = checkpoint
    images, _, labels = reference_predictions(model, cfg)
    logits = model.predict(images, verbose=0).astype(np.float64)
    log_probs = logits - logits.max(axis=1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(axis=1, keepdims=True))
    by_hand = float(-np.mean(log_probs[np.arange(len(labels)), labels]))
    one = evaluate(cfg, make_runtime(DistributeConfig(strategy="one_device")), checkpoint=path)
    two = evaluate(cfg, make_runtime(cfg.distribute), checkpoint=path)
    assert one["loss"] == pytest.approx(by_hand, rel=1e-6)
    assert two["loss"] == pytest.approx(by_hand, rel=1e-6)


def test_evaluate_reads_only_the_validation_split(checkpoint, odd_dir, tmp_path):
    """No training split at all: evaluation neither lists nor needs it."""
    cfg, path, model = checkpoint
    shutil.copytree(os.path.join(odd_dir, "val"), tmp_path / "val")  # and no train/ folder
    only_val = make_cfg(str(tmp_path), tmp_path / "run")
    result = evaluate(only_val, make_runtime(only_val.distribute), checkpoint=path)
    assert result["examples"] == VAL_IMAGES
    _, predicted, labels = reference_predictions(model, cfg)
    assert result["top1"] == pytest.approx(float(np.mean(predicted == labels)), abs=1e-6)


def test_export_round_trip_from_jpeg_bytes(checkpoint, tmp_path):
    cfg, path, model = checkpoint
    paths = export_checkpoint(cfg, make_runtime(cfg.distribute), path, str(tmp_path / "export"))
    split = build_source(cfg.data).split("val")
    data = tf.constant([open(f, "rb").read() for f in split.files])
    _, expected, _ = reference_predictions(model, cfg)
    reloaded = keras.saving.load_model(paths["keras"])
    np.testing.assert_array_equal(np.argmax(reloaded.predict(data, verbose=0), axis=1), expected)
    loaded = tf.saved_model.load(paths["saved_model"])  # keep a reference: it owns the variables
    served = loaded.serve(data).numpy()
    np.testing.assert_array_equal(np.argmax(served, axis=1), expected)
    np.testing.assert_allclose(served.sum(axis=1), 1.0, rtol=1e-5)  # probabilities
    assert json.load(open(paths["classes"])) == [str(d) for d in range(10)]


def test_a_run_s_checkpoint_that_does_not_fit_says_what_the_run_was_trained_as(tmp_path):
    """The usual mismatch: a run trained with `--model=…` (here simple_cnn at 8 px), evaluated or exported without
    it. The one line names what the run's config.yaml holds and how to pass it; a checkpoint outside a run, or of
    a run trained as configured, keeps the generic hint."""
    from tfdp.config import dump_yaml
    from tfdp.errors import UserError
    from tfdp.rundir.checkpoints import load_checkpoint
    run = tmp_path / "run"
    trained = validate({"model_dir": str(run), "model": {"name": "simple_cnn"}, "data": {"image_size": 8}})
    path = run / "checkpoints" / "epoch-0001" / "model.weights.h5"
    path.parent.mkdir(parents=True)
    build_model(trained.model, trained.data).save_weights(str(path))
    (run / "config.yaml").write_text(dump_yaml(trained))
    other = validate({"model_dir": str(run), "model": {"name": "resnet10_small"}, "data": {"image_size": 16}})
    what = f"checkpoint {path} does not fit model 'resnet10_small' with 10 classes at 16 px"
    with pytest.raises(UserError) as error:
        load_checkpoint(build_model(other.model, other.data), str(path), other)
    assert "\n" not in str(error.value) and str(error.value).startswith(
        f"{what} (its run was trained with model.name=simple_cnn, data.image_size=8: set the same, or pass "
        f"--config={run}/config.yaml): "), error.value
    lone = tmp_path / "lone.weights.h5"
    shutil.copy(path, lone)
    (run / "config.yaml").write_text(dump_yaml(other))   # the run says what is configured: nothing to point at
    for where in (lone, path):
        with pytest.raises(UserError) as error:
            load_checkpoint(build_model(other.model, other.data), str(where), other)
        assert str(error.value).startswith(f"checkpoint {where} does not fit model 'resnet10_small' with 10 classes "
                                           f"at 16 px (another architecture or class count?): "), error.value


def test_a_checkpoint_that_cannot_be_read_is_one_line_naming_it_and_why(checkpoint, odd_dir, tmp_path):
    """Not weights at all, empty, cut short, a `.keras` that is no archive, a name Keras does not read: each is
    one line naming the file and why, not h5py's or zipfile's traceback, nor the hint meant for a checkpoint of
    another model. `tfdp evaluate` once through the command line; `export` and `predict` load it alike."""
    from tfdp.rundir.checkpoints import UnreadableWeights, load_checkpoint
    cfg, path, model = checkpoint
    whole = open(path, "rb").read()
    files = {"junk.weights.h5": (os.urandom(4096), "file signature not found"),
             "empty.weights.h5": (b"", "file signature not found"),
             "cut.weights.h5": (whole[: len(whole) // 3], "truncated file"),
             "junk.keras": (b"not a zip archive", "File is not a zip file"),
             "weights.txt": (whole, "not a Keras weights file: Keras reads .weights.h5, .keras and .h5")}
    for name, (data, why) in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UnreadableWeights) as error:
            load_checkpoint(model, str(tmp_path / name), cfg)
        line = str(error.value)
        assert line.startswith(f"checkpoint {tmp_path / name} cannot be read (") and why in line, line
        assert "\n" not in line and "does not fit" not in line, line
    result = run_tfdp("evaluate", "--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=16",
                      "--data_format=image_folder", f"--data_dir={odd_dir}", f"--model_dir={tmp_path}",
                      f"--checkpoint={tmp_path}/junk.keras", timeout=300)
    assert_one_line_error(result, 2, f"checkpoint {tmp_path}/junk.keras cannot be read (File is not a zip file)")


def test_checkpoint_of_another_architecture_or_class_count(checkpoint, odd_dir, tmp_path):
    _, path, _ = checkpoint
    for override in (["--model=resnet18_small"], ["--set=model.num_classes=7"]):
        result = run_tfdp("evaluate", "--config=configs/digits.yaml", *override, "--set=data.image_size=16",
                          "--data_format=image_folder", f"--data_dir={odd_dir}", f"--checkpoint={path}",
                          f"--model_dir={tmp_path}", timeout=300)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        line = last_line(result.stderr)
        if "num_classes" in override[0]:
            assert line == "tfdp: error: the data has 10 classes but model.num_classes is 7"
        else:
            assert line.startswith(f"tfdp: error: checkpoint {path} does not fit model 'resnet18_small'")
