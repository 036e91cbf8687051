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
