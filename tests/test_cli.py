"""The command line as a user runs it: real processes, real files, exit codes."""

import os
import re
import sys

import pytest
import yaml

from conftest import REPO, assert_one_line_error, last_line, read_jsonl, run_tfdp

FAST = ["--model=simple_cnn", "--set=data.image_size=16", "--batch_size_per_replica=32"]


def write_config(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return str(path)


@pytest.mark.parametrize("config, extra, message", [
    (None, ["--config=/nonexistent/x.yaml"], "config file not found: /nonexistent/x.yaml"),
    ("train:\n  epohcs: 3\n", [], "unknown config key 'train.epohcs'; did you mean 'train.epochs'?"),
    ("train:\n  epochs: three\n", [], "config field 'train.epochs': input should be a valid integer"),
    ("train:\n  batch_size_per_replica: 0\n", [], "config field 'train.batch_size_per_replica': input should be greater than 0"),
    (None, ["--batch_size_per_replica=-4"], "config field 'train.batch_size_per_replica': input should be greater than 0"),
    (None, ["--set=optimizer.lrr=0.1"], "unknown config key 'optimizer.lrr'; did you mean 'optimizer.lr'?"),
    (b"model: \x89PNG\r\n\x1a\n\xff\xfe", [], "is not UTF-8 text: is it a config?"),   # a picture given as a config
    (None, ["--epohcs=3"], "Unknown command line flag 'epohcs'. Did you mean: epochs ?"),
    (None, ["--epochs=three"], "flag --epochs=three: invalid literal for int()"),
    (None, ["--flagfile=/nonexistent/flags.txt"], "Unable to open flagfile: [Errno 2] No such file or directory"),
    (None, ["--max_replicas=0"], "flag --max_replicas=0: 0 is not a positive integer"),   # benchmark's, at parsing
    (None, ["--port=70000"], "flag --port=70000: 70000 is not an integer in the range [0, 65535]"),   # data-service's
])
def test_bad_config_fails_fast_with_one_line(tmp_path, config, extra, message):
    args = ["train", *extra]
    if config is not None:
        args.append("--config=" + write_config(tmp_path, config))
    result = run_tfdp(*args, timeout=60)
    assert_one_line_error(result, 2, message)


def test_a_model_dir_in_a_store_without_conditional_writes_is_one_line_and_writes_no_local_folder(tmp_path):
    """`os.path` would make hdfs://host/run a local folder 'hdfs:/host/run': the run's output not where asked.
    Buckets (gs://, s3://) are model_dirs (tests/rundir/test_bucket_run.py); other stores lack the lease's writes."""
    for command in ("train", "evaluate", "export"):
        result = run_tfdp(command, "--model_dir=hdfs://namenode/run", cwd=str(tmp_path), timeout=60)
        assert_one_line_error(result, 2, "model_dir hdfs://namenode/run: tfdp keeps runs on a local or shared file "
                                         "system path, gs:// or s3://, not hdfs://")
    result = run_tfdp("train", "--model_dir=file:///tmp/run", cwd=str(tmp_path), timeout=60)
    assert_one_line_error(result, 2, "model_dir file:///tmp/run: give the path without file://")
    assert os.listdir(tmp_path) == []


def test_missing_data_directory(tmp_path):
    result = run_tfdp("train", "--data_format=image_folder", f"--data_dir={tmp_path}/nope",
                      f"--model_dir={tmp_path}/run", timeout=120)
    assert_one_line_error(result, 2, f"data directory not found: {tmp_path}/nope")


def test_empty_data_directory(tmp_path):
    (tmp_path / "data").mkdir()
    result = run_tfdp("train", "--data_format=image_folder", f"--data_dir={tmp_path}/data",
                      f"--model_dir={tmp_path}/run", timeout=120)
    assert_one_line_error(result, 2, "has no 'train' split folder")


def test_unknown_model_lists_valid_names(tmp_path, digits_dir):
    result = run_tfdp("train", "--model=resnet9000", "--data_format=image_folder", f"--data_dir={digits_dir}",
                      f"--model_dir={tmp_path}/run", timeout=120)
    assert_one_line_error(result, 2, "unknown model 'resnet9000' (valid: ")
    assert "resnet18_small" in last_line(result.stderr) and "resnet50" in last_line(result.stderr)


def test_unknown_command_is_a_usage_error():
    result = run_tfdp("trian", timeout=60)
    assert result.returncode != 0
    assert "expected a command 'trian': one of train" in result.stderr
    assert "Traceback" not in result.stderr


def test_helpfull_documents_every_flag():
    result = run_tfdp("--helpfull", timeout=60)
    assert "tfdp COMMAND" in result.stdout  # the usage text, then every flag
    for flag in ("--config", "--set", "--model_dir", "--epochs", "--batch_size_per_replica", "--strategy",
                 "--cpu_replicas", "--flagfile"):
        assert flag in result.stdout


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, digits_dir):
    """The demo recipe on the real digits (simple_cnn for CI speed), 2 replicas, 8 epochs, its model_dir and
    epochs from a flagfile: (the finished process, its model_dir). One run that the accuracy, bfloat16 and
    console tests all read."""
    root = tmp_path_factory.mktemp("demo")
    model_dir = root / "run"
    flagfile = write_config(root, f"--model_dir={model_dir}\n--epochs=8\n", name="flags.txt")
    result = run_tfdp("train", "--config=configs/digits.yaml", f"--flagfile={flagfile}", *FAST,
                      f"--data_dir={digits_dir}", timeout=600)
    return result, model_dir


@pytest.mark.slow
def test_train_two_replicas_reaches_accuracy_saves_config_and_evaluates(demo_run, digits_dir):
    """The demo recipe on the real digits (simple_cnn for CI speed): 2 replicas, held-out accuracy."""
    result, model_dir = demo_run
    assert result.returncode == 0, result.stderr[-3000:]
    saved = yaml.safe_load((model_dir / "config.yaml").read_text())
    assert saved["train"]["epochs"] == 8 and saved["model"]["name"] == "simple_cnn"  # flagfile + flags applied
    assert (saved["distribute"]["strategy"], saved["distribute"]["cpu_replicas"]) == ("mirrored", 2)
    rows = read_jsonl(model_dir / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == list(range(1, 9))
    # One run's final epoch on 360 images moves by about a point between runs (parallel random crops).
    assert max(r["val_top1"] for r in rows[-3:]) >= 0.97
    summary = last_line(result.stdout)
    assert summary.startswith("tfdp: done: 8 epochs, validation top-1 ")
    assert f"{100 * rows[-1]['val_top1']:.2f}%" in summary and "on 2 replica(s), global batch 64" in summary
    assert (model_dir / "checkpoints" / "best.weights.h5").exists()

    # `tfdp evaluate` in this process (tests/support/inprocess.py): what it prints, not its process, is checked
    from support.inprocess import evaluate_in_process
    _, evaluated = evaluate_in_process("--config=configs/digits.yaml", f"--model_dir={model_dir}", *FAST,
                                       f"--data_dir={digits_dir}")
    best = max(r["val_top1"] for r in rows)
    assert f"top1 {best:.4f}" in evaluated


@pytest.mark.slow
@pytest.mark.full(reason="33 CPU-s of three 8-epoch runs for an accuracy outcome; bfloat16 training itself is "
                  "checked step by step by tests/optim/test_accumulation.py and the Swin and EVA runs")
def test_mixed_bfloat16_matches_float32_accuracy(tmp_path, digits_dir, demo_run):
    """Compared on the plateau (last 3 epochs, 2 seeds): one run's final epoch
    on 360 images moves by a point between seeds in either precision. The demo's run above is the float32 run
    of seed 0 (the config's defaults, checked in the config it saved); the other three are run here, in this
    process (tests/support/inprocess.py: accuracy is the point, not the process)."""
    from support.inprocess import train_in_process
    common = ["--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=16",
              f"--data_dir={digits_dir}", "--epochs=8"]
    top1 = {}
    for precision in ("float32", "mixed_bfloat16"):
        plateau = []
        for seed in (0, 1):
            if (precision, seed) == ("float32", 0):
                result, model_dir = demo_run
                assert result.returncode == 0, result.stderr[-2000:]
                saved = yaml.safe_load((model_dir / "config.yaml").read_text())["train"]
                assert (saved["precision"], saved["seed"], saved["epochs"]) == (precision, seed, 8), saved
            else:
                model_dir = tmp_path / f"{precision}-{seed}"
                train_in_process(*common, f"--model_dir={model_dir}", f"--set=train.precision={precision}",
                                 f"--set=train.seed={seed}")
                saved = yaml.safe_load((model_dir / "config.yaml").read_text())["train"]
                assert (saved["precision"], saved["seed"], saved["epochs"]) == (precision, seed, 8), saved
            plateau += [row["val_top1"] for row in read_jsonl(model_dir / "metrics.jsonl")[-3:]]
        top1[precision] = sum(plateau) / len(plateau)
    assert top1["float32"] >= 0.97
    # bfloat16 must not cost accuracy beyond seed-to-seed noise (about a point between the plateaus, figures in
    # docs/benchmarks.md); a broken cast costs far more.
    assert top1["mixed_bfloat16"] >= top1["float32"] - 0.02, top1


@pytest.mark.slow
def test_killed_run_resumes_after_the_last_complete_epoch(tmp_path, digits_dir):
    """kill -9 during epoch 2, run the same command again: it resumes at epoch 2, each epoch logged once.
    The killed run is a real process; the runs after it are the same command in this process
    (tests/support/inprocess.py): what they read from the killed run's folder is the point, not their process."""
    import signal
    import subprocess
    import sys
    import time

    model_dir = tmp_path / "run"
    args = [sys.executable, "-m", "tfdp", "train", "--config=configs/digits.yaml", f"--model_dir={model_dir}",
            "--epochs=3", *FAST, "--set=data.image_size=32", f"--data_dir={digits_dir}"]
    first = subprocess.Popen(args, cwd=os.path.dirname(os.path.dirname(__file__)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    epoch1 = model_dir / "checkpoints" / "epoch-0001"
    deadline = time.time() + 300
    while not epoch1.exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert epoch1.exists(), "the first run never finished epoch 1"
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert not (model_dir / "checkpoints" / "epoch-0002").exists(), "epoch 2 finished before the kill"
    assert [r["epoch"] for r in read_jsonl(model_dir / "metrics.jsonl")] == [1]

    from support.inprocess import train_in_process
    _, second = train_in_process(*args[4:])
    assert "tfdp: resuming at epoch 2 of 3" in second
    assert [r["epoch"] for r in read_jsonl(model_dir / "metrics.jsonl")] == [1, 2, 3]
    assert not [p for p in os.listdir(model_dir / "checkpoints") if p.startswith(".tmp")]

    _, third = train_in_process(*args[4:])  # already complete: nothing retrained, same summary
    assert "tfdp: all 3 epochs already trained" in third and "Epoch " not in third
    assert last_line(third) == last_line(second)


TF_INTERNALS = re.compile(r"^(\[worker \d\] )?([IWEF]\d{4} |WARNING: All log messages)|cross_device_ops|oneDNN|cudart|"
                          r"cuda_platform|cpu_feature_guard|Traceback")


def test_console_shows_what_a_person_needs_and_verbosity_brings_back_the_rest(tmp_path, small_dir, demo_run):
    quiet, model_dir = demo_run  # the demo at the default verbosity
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    lines = [line for line in (quiet.stdout + quiet.stderr).splitlines() if line.strip()]
    assert len(lines) < 40, "\n".join(lines)
    assert not [line for line in lines if TF_INTERNALS.search(line)], "\n".join(lines)
    for expected in ("tfdp: strategy mirrored: 2 replica(s)", "tfdp: data: 1437 train / 360 val images",
                     f"tfdp: config: the resolved config is in {model_dir}/config.yaml", "tfdp: done: 8 epochs"):
        assert any(line.startswith(expected) for line in lines), expected
    assert sum(line.startswith("22/22 ") for line in lines) == 8  # one line per epoch

    # TensorFlow's own lines come as it starts: one short epoch on the 360 digits of `small_dir` shows them.
    args = ["train", "--config=configs/digits.yaml", *FAST, f"--data_dir={small_dir}", "--data_format=image_folder",
            "--epochs=1", "--set=schedule.warmup_epochs=0"]
    loud = run_tfdp(*args, f"--model_dir={tmp_path}/loud", "--verbosity=1", timeout=300)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert [line for line in (loud.stdout + loud.stderr).splitlines() if TF_INTERNALS.search(line)]


FILTERED_PROCESS = """
import os, sys, time
sys.argv = ["tfdp"]
from tfdp.startup import console
console.filter_native_stderr()
os.write(2, b"Improper call to JPEG library in state 201\\n")
os.write(2, b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\\n")
os.write(2, b"fully_quantize: 0, inference_type: 6, input_inference_type: FLOAT32, output_inference_type: FLOAT32\\n")
os.write(2, b"tfdp: a line of its own\\n")
os.write(2, b"Corrupt JPEG data: 3 extraneous bytes before marker 0xd9\\n")
if sys.argv[-1] == "term":
    os.killpg(0, 15)   # the whole process group, as Slurm or a pod's stop does; this process ignores it
os.write(2, b"tfdp: the last line, just before os._exit\\n")
os._exit(3)
"""


@pytest.mark.parametrize("group_signal", [False, True])
def test_native_library_lines_are_filtered_and_the_last_line_survives_os_exit(group_signal):
    """The stderr filter drops what libjpeg and LiteRT print on their own and passes every other line, including
    one written just before `os._exit` and one written after the process group got SIGTERM."""
    import subprocess
    code = FILTERED_PROCESS
    if group_signal:
        code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + code
    proc = subprocess.run([sys.executable, "-c", code, "term" if group_signal else "plain"], capture_output=True,
                          timeout=60, cwd=REPO, start_new_session=True,
                          env={k: v for k, v in os.environ.items() if k != "TFDP_STDERR_FILTER"})
    assert proc.returncode == 3
    assert proc.stderr.decode().splitlines() == ["tfdp: a line of its own", "tfdp: the last line, just before os._exit"]


def test_floats_as_everyone_writes_them_pass_the_command_line():
    """--set and a float flag take 1e-3: the first field refused is the one after optimizer.lr (fields are checked
    in order, so a refused lr would be named instead)."""
    result = run_tfdp("train", "--set=optimizer.lr=1e-3", "--set=optimizer.weight_decay=5e-5", "--poll_seconds=1E-2",
                      "--set=train.epochs=ten", timeout=60)
    assert_one_line_error(result, 2, "config field 'train.epochs': input should be a valid integer (got 'ten')")


def test_models_lists_a_pattern_with_counts_sizes_and_weights():
    result = run_tfdp("models", "*_small_patch16_224", timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["model", "params", "size"]
    rows = {line.split()[0]: line.split(None, 3)[1:] for line in lines[1:-1]}
    assert set(rows) == {"vit_small_patch16_224", "deit_small_patch16_224", "deit3_small_patch16_224"}, lines
    # timm's own counts (docs/models.md); what timm's, torchvision's and keras-hub's ViT files it reads
    assert rows["vit_small_patch16_224"] == ["22,050,664", "224", "timm, torchvision, keras-hub"]
    assert rows["deit3_small_patch16_224"][:2] == ["22,059,496", "224"]
    assert lines[-1].startswith("tfdp: models: 3 listed; params: trainable, at 1000 classes")


def test_models_with_a_pattern_that_matches_nothing_is_one_line():
    result = run_tfdp("models", "*convnxt*", timeout=300)
    assert_one_line_error(result, 2, "tfdp: error: no model matches '*convnxt*' (")
