"""TensorBoard event files, the metrics log, `tfdp report`, `tfdp benchmark`, Weights & Biases offline."""

import glob
import json
import os

import numpy as np
import pytest
from PIL import Image

from conftest import assert_one_line_error, read_jsonl, run_tfdp
from tfdp.commands.benchmark import verdict

FAST = ["--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=16"]


def scalar_steps(event_dir):
    import tensorflow as tf
    tags = {}
    for path in glob.glob(os.path.join(event_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
    return tags


@pytest.fixture(scope="module")
def finished_run(small_dir, tmp_path_factory):
    """3 epochs of 5 steps (320 of the digits, a global batch of 64): the profiled steps 2 and 3 in each."""
    model_dir = tmp_path_factory.mktemp("obs") / "run"
    wandb_dir = model_dir.parent / "wandb-home"
    result = run_tfdp("train", *FAST, f"--model_dir={model_dir}", f"--data_dir={small_dir}", "--epochs=3",
                      "--set=log.profile_steps=[2, 3]", "--set=log.wandb_project=tfdp-test",
                      "--set=log.wandb_mode=offline", timeout=600,
                      env_extra={"WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    return model_dir, result


def test_tensorboard_scalars_have_one_point_per_epoch(finished_run):
    model_dir, _ = finished_run
    train = scalar_steps(model_dir / "tensorboard" / "train")
    for tag in ("epoch_loss", "epoch_top1", "epoch_top5", "epoch_lr", "epoch_images_per_sec", "epoch_seconds"):
        assert sorted(train[tag]) == [0, 1, 2], tag
    val = scalar_steps(model_dir / "tensorboard" / "validation")
    for tag in ("epoch_loss", "epoch_top1", "epoch_top5"):
        assert sorted(val[tag]) == [0, 1, 2], tag


def test_profiler_trace_is_written_for_the_configured_steps(finished_run):
    model_dir, _ = finished_run
    assert glob.glob(str(model_dir / "tensorboard" / "train" / "plugins" / "profile" / "*" / "*.xplane.pb"))


def test_metrics_file_has_one_row_per_epoch_with_throughput(finished_run):
    model_dir, _ = finished_run
    rows = read_jsonl(model_dir / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["images_per_sec"] > 0 and r["seconds"] > 0 and 0 <= r["val_top1"] <= 1
    lrs = [r["lr"] for r in rows]
    assert lrs[0] > lrs[1] > lrs[2] >= 0  # cosine decay, recorded at each epoch end


def test_wandb_offline_run_holds_the_epochs(finished_run):
    model_dir, _ = finished_run
    runs = glob.glob(str(model_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    assert glob.glob(os.path.join(runs[0], "*.wandb"))


def test_report_draws_curves_and_summarises_the_metrics(finished_run):
    model_dir, _ = finished_run
    result = run_tfdp("report", str(model_dir), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_jsonl(model_dir / "metrics.jsonl")
    summary = (model_dir / "report" / "report.md").read_text()
    best = max(rows, key=lambda r: r["val_top1"])
    assert f"| final validation top-1 | {100 * rows[-1]['val_top1']:.2f}% |" in summary
    assert f"| final validation top-5 | {100 * rows[-1]['val_top5']:.2f}% |" in summary
    assert f"{100 * best['val_top1']:.2f}% (epoch {best['epoch']})" in summary
    mean_rate = np.mean([r["images_per_sec"] for r in rows[1:]])
    assert f"| throughput | {mean_rate:.1f} images/s" in summary
    for name in ("loss", "accuracy", "lr", "throughput"):
        pixels = np.asarray(Image.open(model_dir / "report" / f"{name}.png").convert("RGB")).astype(int)
        # matplotlib's first colours (blue, orange) are drawn: curves, not just axes.
        coloured = (np.abs(pixels[..., 0] - pixels[..., 2]) > 80).sum()
        assert coloured > 200, name


def test_report_on_a_directory_without_metrics(tmp_path):
    result = run_tfdp("report", str(tmp_path), timeout=60)
    assert result.returncode == 2 and f"no metrics.jsonl in {tmp_path}" in result.stderr


@pytest.mark.parametrize("second_row, message", [
    ('{"epoch": 2, "lo', "line 2 is not a JSON object (Unterminated string starting at: line 1 column 14 (char 13)): "
                         "a damaged log; mend or remove that line"),
    ("[2, 0.5]", "line 2 is not a metrics row (a JSON object with an epoch): [2, 0.5]"),
])
def test_a_damaged_metrics_log_is_one_line_naming_the_line(tmp_path, second_row, message):
    """tfdp writes the log whole and atomically; a row damaged from outside (a disk, an edit) is named by its
    reader, `read_metrics`, which a resumed `tfdp train` shares with `tfdp report`."""
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "loss": 2.0}\n' + second_row + "\n")
    assert_one_line_error(run_tfdp("report", str(tmp_path), timeout=60), 2, f"{tmp_path}/metrics.jsonl {message}")


@pytest.mark.parametrize("real, synthetic, alone, expected, cause", [
    (3045.0, 3962.0, 6000.0, "input-bound", "not beside training"),   # an H100 run: the input alone slower than training
    (1500.0, 3962.0, 2000.0, "input-bound", "decoding is the limit"),
    (3800.0, 3962.0, 2000.0, "compute-bound", "the input keeps up"),  # 0.96x: above the 0.95 line
    (None, 3962.0, 9000.0, "compute-bound", "synthetic data only"),
])
def test_verdict_follows_from_real_and_synthetic_training(real, synthetic, alone, expected, cause):
    name, reason = verdict(real, synthetic, alone)
    assert name == expected and cause in reason
    if real is not None:
        assert f"{real / synthetic:.2f}x" in reason


def test_an_input_bound_verdict_names_what_to_try_with_its_decoder():
    assert "data.decoder: dali on GPUs" in verdict(1500.0, 3962.0, 2000.0)[1]
    name, reason = verdict(1500.0, 3962.0, 2000.0, decoder="dali")
    assert name == "input-bound" and "data.dali_hw_decoder_load" in reason and "data.decoder: dali" not in reason


def test_scaling_rows_from_recorded_probes():
    """Two replicas at 150 images/s against one at 100: 75 per replica, efficiency 0.75."""
    from tfdp.commands.benchmark import analyse
    from tfdp.config import validate
    probes = [{"replicas": 1, "global_batch": 32, "synthetic_images_per_sec": 100.0, "real_data_images_per_sec": 99.0},
              {"replicas": 2, "global_batch": 64, "synthetic_images_per_sec": 150.0, "real_data_images_per_sec": 90.0}]
    result = analyse(validate({}), probes, input_rate=400.0)
    one, two = result["rows"]
    assert (one["scaling_efficiency"], one["per_replica_images_per_sec"]) == (1.0, 100.0)
    assert (two["scaling_efficiency"], two["per_replica_images_per_sec"]) == (0.75, 75.0)
    assert result["verdict"] == "input-bound"  # 90 real vs 150 synthetic at 2 replicas, though 400 alone
    assert "not beside training" in result["verdict_reason"]


def test_probes_wait_for_two_windows_that_agree():
    """Windows of 2 steps: a warming-up rate is not steady, two windows within 3% are."""
    from tfdp.commands.benchmark import steady
    warming = [0.0, 1.0, 2.0, 2.5, 3.0]            # windows of 2.0 s then 1.0 s
    assert not steady(warming, 2)
    settled = warming + [3.5, 4.0]                  # then 1.0 s and 1.0 s
    assert steady(settled, 2)
    assert not steady(settled + [4.5, 5.2], 2)      # 1.0 s then 1.2 s: 17% apart
    assert not steady([0.0, 1.0, 2.0], 2)           # one window is never steady


def test_input_rate_beside_training_counts_whole_batch_intervals():
    """A pipeline slower than one batch per training window still reads as its rate (CI once read 0 here)."""
    from tfdp.commands.benchmark import Drain
    drain = Drain(dataset=None)
    drain.stamps = [0.0, 1.0, 2.0, 3.0]        # one batch of 8 a second
    assert drain.rate(8, 1.2, 1.5) == pytest.approx(8.0)    # no batch inside the window: 1.0 -> 2.0
    assert drain.rate(8, 0.5, 2.5) == pytest.approx(8.0)    # two inside: 0.0 -> 3.0, three intervals
    drain.stamps = [0.0]                       # nothing arrived after the window: no rate to claim
    assert drain.rate(8, 1.0, 2.0) == 0.0


@pytest.mark.slow
@pytest.mark.full(reason="the command and its probe processes, about 30 CPU-s: its parts run in the README's tier "
                         "above (the rows from recorded probes, the windows' rule, the input rate beside training, "
                         "the verdict)")
def test_benchmark_measures_one_and_two_replicas(tmp_path, digits_dir):
    """The real command, its probe processes included, with windows of one step after one warm-up step: a fit stops
    after 13 steps at most (62 with windows of 5 after 2). What is checked is the wiring and the report, not the
    rates' steadiness (test_probes_wait_for_two_windows_that_agree checks that rule)."""
    out = tmp_path / "bench"
    result = run_tfdp("benchmark", *FAST, f"--data_dir={digits_dir}", "--max_replicas=2",
                      "--steps=1", "--warmup_steps=1", f"--benchmark_dir={out}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((out / "benchmark.json").read_text())
    assert set(data) >= {"model", "image_size", "batch_size_per_replica", "rows", "input_pipeline_images_per_sec",
                         "input_beside_training_images_per_sec", "verdict", "verdict_reason"}
    assert data["input_beside_training_images_per_sec"] > 0
    assert [r["replicas"] for r in data["rows"]] == [1, 2]
    assert [r["global_batch"] for r in data["rows"]] == [32, 64]
    one, two = data["rows"]
    assert all(r["synthetic_images_per_sec"] > 0 and r["real_data_images_per_sec"] > 0 for r in data["rows"])
    assert data["verdict"] == verdict(two["real_data_images_per_sec"], two["synthetic_images_per_sec"],
                                      data["input_pipeline_images_per_sec"])[0]
    assert Image.open(out / "scaling.png").size[0] > 100
    assert "verdict: " in result.stdout
