"""On a GPU: the demo trains through the whole-step XLA update that `train.jit_compile: auto` turns on for
accelerators. Marked `gpu`: it skips, saying so, on a host without one (this project's CI host), and runs on
a GPU host (`../shared/gpu/README.md` puts tfdp there)."""

from __future__ import annotations

import pytest

from conftest import read_jsonl, run_tfdp

pytestmark = pytest.mark.gpu


def test_the_demo_trains_on_a_gpu_with_the_whole_step_compiled(tmp_path):
    result = run_tfdp("train", "--config=configs/digits.yaml", f"--model_dir={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "/device:GPU:0" in result.stdout and "tfdp: xla: on (auto: on for " in result.stdout
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["val_top1"] > 0.9 and rows[-1]["loss"] < rows[0]["loss"]


def test_the_demo_trains_on_two_logical_gpus_of_one_card(tmp_path):
    """2-replica MirroredStrategy on one card: all-reduce and per-replica batch norm on GPU devices."""
    import subprocess
    import sys

    from conftest import REPO
    result = subprocess.run([sys.executable, "benchmarks/gpu.py", "--split_gpu=2", "--", "train",
                             "--config=configs/digits.yaml", f"--model_dir={tmp_path}"], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 replica(s) on /device:GPU:0, /device:GPU:1" in result.stdout
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["val_top1"] > 0.9 and rows[-1]["loss"] < rows[0]["loss"]


def test_the_demo_trains_with_dali_decoding_on_the_gpu(tmp_path):
    """data.decoder: dali on a card: DALI's "mixed" decoder, its batches copied back and prefetched to the GPU
    (tfdp/data/dali.py). ResNet-18 and ResNet-50 trained this way on one H200 (docs/benchmarks.md); this test's
    command ran there on 2026-11-28 from the lease script (benchmarks/gpu_lease/bg.sh), not through pytest:
    exit 0, the DALI line, 98.9 % validation top-1."""
    result = run_tfdp("train", "--config=configs/digits.yaml", f"--model_dir={tmp_path}", "--set=data.decoder=dali",
                      timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "decoded and cropped by DALI" in result.stdout
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["val_top1"] > 0.9 and rows[-1]["loss"] < rows[0]["loss"]
