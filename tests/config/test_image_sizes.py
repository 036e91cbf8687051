"""Progressive resizing (FFCV) and a separate test-time size (FixRes): the schedule, the any-size model, the
segment datasets, evaluation and export at the evaluation size, and a real run."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_one_line_error, read_jsonl, run_tfdp
from tfdp.config import validate
from tfdp.data import build_source
from tfdp.data.pipeline import eval_dataset
from tfdp.errors import UserError
from tfdp.models import build_model
from tfdp.config.image_sizes import eval_image_size, size_runs, train_image_size
from tfdp.train.trainer import Segment, segments, size_line, split_by_image_size


def ffcv_get_resolution(epoch, min_res, max_res, end_ramp, start_ramp, step=32):
    """libffcv/ffcv-imagenet train_imagenet.py, with the step (32 there) as a parameter."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    final_res = int(np.round(interp[0] / step)) * step
    return final_res


def data(**fields):
    return validate({"data": fields}).data


RAMPS = [(160, 192, 65, 76, 32), (160, 192, 11, 13, 32), (128, 224, 2, 30, 32), (140, 210, 0, 9, 32),
         (160, 256, 5, 8, 16), (16, 32, 0, 3, 8), (100, 224, 3, 3, 32), (64, 64, 0, 5, 32), (150, 200, 1, 40, 7)]


@pytest.mark.parametrize("low, high, start, end, step", RAMPS)
def test_training_size_is_ffcvs_rule(low, high, start, end, step):
    cfg = data(image_size=high, progressive_min_size=low, progressive_start_epoch=start, progressive_end_epoch=end,
               progressive_step=step)
    epochs = range(end + 5)
    assert [train_image_size(cfg, e) for e in epochs] == [ffcv_get_resolution(e, low, high, end, start, step)
                                                          for e in epochs]


def test_ffcvs_rounding_ties_go_to_even_and_off_means_image_size():
    # 160 -> 192 over epochs 11..13: epoch 12 interpolates to 176 = 5.5 x 32, which np.round takes to 6.
    cfg = data(image_size=192, progressive_min_size=160, progressive_start_epoch=11, progressive_end_epoch=13)
    assert [train_image_size(cfg, e) for e in (11, 12, 13)] == [160, 192, 192]
    off = data(image_size=48)
    assert {train_image_size(off, e) for e in range(50)} == {48} and eval_image_size(off) == 48
    assert eval_image_size(data(image_size=176, eval_image_size=224)) == 224


def test_fits_split_where_the_size_changes_and_resume_keeps_the_partial_epoch():
    cfg = data(image_size=32, progressive_min_size=16, progressive_end_epoch=3, progressive_step=8)
    assert [train_image_size(cfg, e) for e in range(5)] == [16, 24, 24, 32, 32]
    assert split_by_image_size(segments(0, 0, 5, 10), cfg) == [
        Segment(0, 1, 10, 16), Segment(1, 3, 10, 24), Segment(3, 5, 10, 32)]
    # Resumed at epoch 2 (0-based 1), step 4: the rest of that epoch, then the rest of the ramp.
    assert split_by_image_size(segments(1, 4, 5, 10), cfg) == [
        Segment(1, 2, 6, 24), Segment(2, 3, 10, 24), Segment(3, 5, 10, 32)]
    assert size_runs(cfg, 1, 5) == [(1, 3, 24), (3, 5, 32)]
    assert size_line(cfg, 1, 5) == "tfdp: data: epochs 2-3 train at 24 px"
    assert size_line(cfg, 0, 5) == "tfdp: data: epoch 1 trains at 16 px"
    off = data(image_size=32)
    assert split_by_image_size(segments(0, 0, 5, 10), off) == [Segment(0, 5, 10, 32)]


@pytest.mark.parametrize("fields, message", [
    ({"image_size": 32, "progressive_min_size": 40}, "data.progressive_min_size (40) must not exceed data.image_size"),
    ({"progressive_min_size": 16, "progressive_start_epoch": 5, "progressive_end_epoch": 2},
     "data.progressive_start_epoch (5) must not exceed data.progressive_end_epoch (2)"),
    ({"progressive_end_epoch": 4}, "need data.progressive_min_size above 0"),
    ({"image_size": 32, "progressive_min_size": 8, "progressive_end_epoch": 4},
     "data.progressive_step (32) rounds the ramp"),
    ({"progressive_step": 0}, "config field 'data.progressive_step': input should be greater than 0"),
    ({"eval_image_size": -1}, "config field 'data.eval_image_size': input should be greater than or equal to 0"),
])
def test_bad_ramps_are_one_line_errors(fields, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as raised:
        validate({"data": fields})
    assert "\n" not in str(raised.value)


# The small-image ResNet builder (resnet10_small: resnet18_small's code with one block per stage) and a
# keras.applications model.
@pytest.mark.parametrize("name", ["resnet10_small", "mobilenet_v2"])
def test_any_size_model_gives_the_static_models_logits(name):
    size = 32
    static_cfg = validate({"model": {"name": name}, "data": {"image_size": size}})
    any_cfg = validate({"model": {"name": name}, "data": {"image_size": size, "eval_image_size": 48}})
    keras.utils.set_random_seed(0)
    static = build_model(static_cfg.model, static_cfg.data)
    variable = build_model(any_cfg.model, any_cfg.data)
    assert static.input_shape == (None, size, size, 3) and variable.input_shape == (None, None, None, 3)
    assert [w.path for w in variable.weights] == [w.path for w in static.weights]  # checkpoints fit both
    variable.set_weights(static.get_weights())
    images = np.random.default_rng(0).integers(0, 256, (3, size, size, 3), dtype=np.uint8)
    np.testing.assert_allclose(np.asarray(variable(images, training=False)), np.asarray(static(images, training=False)),
                               rtol=1e-5, atol=1e-5)
    for side in (48, 40):
        assert variable(np.zeros((2, side, side, 3), np.uint8), training=False).shape == (2, 10)


@pytest.mark.parametrize("fields, message", [
    ({"eval_image_size": 24}, "model 'simple_cnn' takes only one image size"),
    ({"progressive_min_size": 8, "progressive_step": 8}, "model 'simple_cnn' takes only one image size"),
])
def test_a_model_that_flattens_refuses_a_second_size(fields, message):
    cfg = validate({"model": {"name": "simple_cnn"}, "data": {"image_size": 16, **fields}})
    with pytest.raises(UserError, match=message):
        build_model(cfg.model, cfg.data)


def test_the_smallest_size_used_is_checked_against_the_models_minimum():
    cfg = validate({"model": {"name": "inception_v3"},
                    "data": {"image_size": 96, "progressive_min_size": 64, "progressive_end_epoch": 2}})
    with pytest.raises(UserError, match="model 'inception_v3' needs images of at least 75 px, .* down to 64 px"):
        build_model(cfg.model, cfg.data)


def test_each_segments_stream_has_its_size_and_the_same_records(small_dir):
    """The trainer's per-size datasets: batches of each size, and (crop windows and order drawn from the seed and
    the stream position) the same records at every size, so resuming at any segment stays exact."""
    from tfdp.distribute.strategy import make_runtime
    from tfdp.train.task import TrainStream, make_plan
    cfg = validate({"data": {"format": "image_folder", "dir": small_dir, "image_size": 32, "progressive_min_size": 16,
                             "progressive_end_epoch": 3, "progressive_step": 8},
                    "train": {"batch_size_per_replica": 8, "deterministic": True},
                    "distribute": {"strategy": "mirrored", "cpu_replicas": 2}})
    runtime = make_runtime(cfg.distribute)
    source = build_source(cfg.data)
    stream = TrainStream(cfg, source, runtime, make_plan(cfg, source, runtime), None)
    labels = {}
    for size in (16, 24, 32):
        batch = next(iter(stream.dataset((40, 0), size)))
        images = runtime.strategy.experimental_local_results(batch[0])
        assert [tuple(x.shape) for x in images] == [(8, size, size, 3)] * 2
        assert stream.image_size == size
        labels[size] = np.concatenate([y.numpy() for y in runtime.strategy.experimental_local_results(batch[1])])
    assert np.array_equal(labels[16], labels[24]) and np.array_equal(labels[16], labels[32])


@pytest.fixture(scope="module")
def strategy_of_two():
    from tfdp.config import DistributeConfig
    from tfdp.distribute.strategy import make_runtime
    return make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy


def test_whole_step_xla_compiles_each_size(strategy_of_two):
    """train.jit_compile: the compiled step traces again for a new image size (a small any-size network: XLA on
    CPU takes a minute for resnet18_small; `tfdp train` with progressive resizing and XLA ran it, see README)."""
    from tfdp.keras_patches.train_step import compile_train_step
    with strategy_of_two.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((None, None, 3)), keras.layers.Conv2D(4, 3),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        compile_train_step(model)
        model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    before = model.get_weights()
    forward_backward, _, update = model.tfdp_step_functions
    traces = []
    for size in (8, 12, 8):
        batch = (rng.random((8, size, size, 3), np.float32), rng.integers(0, 10, 8))
        history = model.fit(tf.data.Dataset.from_tensors(batch).repeat(), steps_per_epoch=2, epochs=1, verbose=0,
                            shuffle=False)
        assert np.isfinite(history.history["loss"][0])
        traces.append(forward_backward.experimental_get_tracing_count())
    # 8 px traced (once per replica device), 12 px traced again with any size (reduce_retracing), which 8 px reuses.
    assert 0 < traces[0] < traces[1] == traces[2], traces
    assert update.experimental_get_tracing_count() >= 1
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_evaluation_and_export_run_at_the_evaluation_size(small_dir, tmp_path):
    from tfdp.commands.export import export
    cfg = validate({"model": {"name": "resnet10_small"},   # an any-size model with batch norm, the demo's builder
                    "data": {"format": "image_folder", "dir": small_dir, "image_size": 16, "eval_image_size": 24,
                             "eval_crop_fraction": 1.0, "hflip": False}})
    split = build_source(cfg.data).split("val")
    batches = list(eval_dataset(split, cfg.data, 20))
    assert {tuple(x.shape[1:]) for x, _, _ in batches} == {(24, 24, 3)}
    keras.utils.set_random_seed(3)
    model = build_model(cfg.model, cfg.data)
    real = np.concatenate([w.numpy() for _, _, w in batches]) > 0
    images = np.concatenate([x.numpy() for x, _, _ in batches])[real]
    expected = model.predict(images, verbose=0)
    written = export(model, cfg, tuple(str(d) for d in range(10)), str(tmp_path / "export"))
    assert not written.failed
    reloaded = keras.saving.load_model(written.paths["keras"])  # the any-size backbone survives saving
    assert reloaded.get_layer("decode").image_size == 24
    data_bytes = tf.constant([open(f, "rb").read() for f in split.files])
    probabilities = reloaded.predict(data_bytes, verbose=0)
    np.testing.assert_allclose(probabilities, tf.nn.softmax(expected).numpy(), rtol=1e-4, atol=1e-5)


def test_bad_sizes_on_the_command_line_are_one_line(small_dir, tmp_path):
    common = ["train", "--config=configs/digits.yaml", "--data_format=image_folder", f"--data_dir={small_dir}",
              f"--model_dir={tmp_path}/run", "--set=data.image_size=16"]
    too_big = run_tfdp(*common, "--set=data.progressive_min_size=24", timeout=120)
    assert_one_line_error(too_big, 2, "data.progressive_min_size (24) must not exceed data.image_size (16)")
    backwards = run_tfdp(*common, "--set=data.progressive_min_size=8", "--set=data.progressive_start_epoch=3",
                         "--set=data.progressive_end_epoch=1", timeout=120)
    assert_one_line_error(backwards, 2, "data.progressive_start_epoch (3) must not exceed data.progressive_end_epoch")
    flattens = run_tfdp(*common, "--model=simple_cnn", "--set=data.eval_image_size=24", timeout=120)
    assert_one_line_error(flattens, 2, "model 'simple_cnn' takes only one image size", "data.eval_image_size")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.full(reason="50 CPU-s: its parts are "
                         "test_fits_split_where_the_size_changes_and_resume_keeps_the_partial_epoch, "
                         "test_each_segments_stream_has_its_size_and_the_same_records, "
                         "test_whole_step_xla_compiles_each_size and "
                         "test_evaluation_and_export_run_at_the_evaluation_size")
@pytest.mark.slow
def test_progressive_run_trains_each_size_and_evaluates_at_the_test_size(tiny_dir, tmp_path):
    """resnet10_small (the demo's small-image ResNet with one block per stage: any size, batch norm) on 2 replicas,
    8 -> 12 -> 16 px over 3 epochs (of one step: 64 digits; from the digits' own 8 px, which resnet10_small takes),
    evaluated at 20 px; `tfdp evaluate` of the last checkpoint finds what training
    reported for the last epoch. Both commands run in this process, from the same flags (inprocess):
    what is checked is what the run does, not the process around it."""
    from support.inprocess import evaluate_in_process, train_in_process
    args = ["--config=configs/digits.yaml", "--data_format=image_folder", f"--data_dir={tiny_dir}",
            f"--model_dir={tmp_path}", "--cpu_replicas=2", "--model=resnet10_small", "--set=data.image_size=16",
            "--set=data.progressive_min_size=8", "--set=data.progressive_end_epoch=2",
            "--set=data.progressive_step=4", "--set=data.eval_image_size=20", "--set=schedule.warmup_epochs=0"]
    _, stdout = train_in_process(*args, "--epochs=3")
    lines = [line for line in stdout.splitlines() if " px" in line and line.startswith("tfdp: data: ")]
    assert lines == ["tfdp: data: epoch 1 trains at 8 px", "tfdp: data: epoch 2 trains at 12 px",
                     "tfdp: data: epoch 3 trains at 16 px"], stdout[-3000:]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["image_size"] for r in rows] == [8, 12, 16]  # each fit's dataset's size
    _, evaluated = evaluate_in_process(*args, checkpoint=f"{tmp_path}/checkpoints/epoch-0003/model.weights.h5")
    assert f"loss {rows[-1]['val_loss']:.4f}, top1 {rows[-1]['val_top1']:.4f}" in evaluated
