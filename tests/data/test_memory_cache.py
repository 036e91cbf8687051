"""`data.cache` is refused before training when the worker's share cannot stay in memory (tfdp/data/memory_cache.py)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, assert_one_line_error
from support.cgroups import memory_limited, why_no_memory_cgroup
from tfdp.data.layouts import Split
from tfdp.data.memory_cache import PER_EXAMPLE, SAMPLED_FILES, cached_bytes, check_fits
from tfdp.errors import UserError
from tfdp.startup.memory import available_memory

CONTAINER_LIMIT = 2 << 30


def write_files(folder, sizes) -> list[str]:
    os.makedirs(folder)
    paths = [str(folder / f"{i:05d}.jpg") for i in range(len(sizes))]
    for path, size in zip(paths, sizes):
        with open(path, "wb") as f:
            f.write(b"\xff" * int(size))
    return paths


def test_a_splits_cached_bytes_are_its_files_or_an_even_sample_of_them(tmp_path):
    """Up to twice SAMPLED_FILES files every one is measured: the exact bytes. A larger tree is estimated from an
    even sample, here within 3 % of its real bytes though its sizes vary 50x; synthetic data caches nothing."""
    rng = np.random.default_rng(0)
    few = write_files(tmp_path / "few", rng.integers(100, 5000, 300))
    exact = sum(map(os.path.getsize, few))
    assert cached_bytes(Split("train", tuple(few), labels=(0,) * len(few))) == exact + PER_EXAMPLE * len(few)

    many = write_files(tmp_path / "many", rng.integers(100, 5000, 5 * SAMPLED_FILES + 7))
    real = sum(map(os.path.getsize, many)) + PER_EXAMPLE * len(many)
    estimate = cached_bytes(Split("train", tuple(many), labels=(0,) * len(many)))
    assert abs(estimate - real) < 0.03 * real, (estimate, real)

    assert cached_bytes(Split("train", ("synthetic",), counts=(1000,), synthetic=True)) == 0


def test_workers_sharing_a_host_check_their_shares_together(tmp_path):
    """Split 2 ways, a split of 1.4x the memory this process has left (sparse files) fits each worker alone, and
    is refused when both workers fill one host."""
    paths = write_files(tmp_path / "train", [0] * 4)
    for path in paths:
        os.truncate(path, int(1.4 * available_memory()) // 4)
    split = Split("train", tuple(paths), labels=(0,) * 4)
    check_fits([split], workers=2, on_host=1)
    with pytest.raises(UserError, match=r"^data.cache: keeping this worker's 1/2 of 'train' in memory takes about "
                                        r"[0-9.]+ GiB \(the encoded images\), x2 for the workers on this host, but "):
        check_fits([split], workers=2, on_host=2)


def sparse_copy(data_dir, root, split: str, limit: int) -> int:
    """A copy of `data_dir` whose `split` images are each a real JPEG followed by zeros that take no disk, twice
    `limit` in all; returns the bytes of one."""
    shutil.copytree(data_dir, root)
    files = sorted(str(p) for p in (root / split).rglob("*") if p.is_file())
    size = 2 * limit // len(files)
    for path in files:
        os.truncate(path, size)
    return size * len(files)


def run_in_container(args, limit: int):
    """`tfdp ARGS` inside a memory cgroup of `limit` bytes, or unconfined where none can be made."""
    command = [sys.executable, "-m", "tfdp", *args, "--set=data.cache=true"]
    with memory_limited(CONTAINER_LIMIT) if limit == CONTAINER_LIMIT else contextlib.nullcontext(lambda c: c) as inside:
        return subprocess.run(inside(command), capture_output=True, text=True, timeout=300, cwd=REPO)


def test_a_share_larger_than_the_memory_left_is_refused_before_training(tiny_dir, tmp_path):
    """`data.cache: true` on training images twice as large as the memory left is one line with the share's size
    and the memory left, before the first step, where tf.data would fill its cache until the kernel killed the
    process. Inside a 2 GiB memory cgroup where one can be made (a container's limit, far below the host's memory;
    a regression is then killed there), else against the host's own memory."""
    limit = CONTAINER_LIMIT if why_no_memory_cgroup() is None else available_memory()
    total = sparse_copy(tiny_dir, tmp_path / "data", "train", limit)
    result = run_in_container(["train", "--config=configs/digits.yaml", "--data_format=image_folder",
                               f"--data_dir={tmp_path / 'data'}", f"--model_dir={tmp_path / 'run'}"], limit)
    line = assert_one_line_error(result, 2, "data.cache: keeping 'train' and 'val' in memory takes about",
                                 "GiB is available to this process", "set data.cache: false")
    need, free = map(float, re.findall(r"([0-9.]+) GiB", line))
    print(line)
    assert need >= total / 2**30 - 0.1 and free < limit / 2**30 and free < need / 1.5, line
    assert "tfdp: epoch" not in result.stdout and not list((tmp_path / "run").rglob("*.index")), result.stdout


def test_a_validation_split_larger_than_the_memory_left_is_refused_before_evaluating(tiny_dir, tmp_path):
    """`tfdp evaluate` (one pass, or `--continuous` and a cluster's evaluator task, which read the split again for
    every checkpoint) caches the validation split from its first pass: the same line, before the model is built
    or the checkpoint read (here a file that is none: a regression fails on it, or is killed in the cgroup)."""
    limit = CONTAINER_LIMIT if why_no_memory_cgroup() is None else available_memory()
    total = sparse_copy(tiny_dir, tmp_path / "data", "val", limit)
    checkpoint = tmp_path / "model.weights.h5"
    checkpoint.write_bytes(b"not read")
    result = run_in_container(["evaluate", "--config=configs/digits.yaml", "--data_format=image_folder",
                               f"--data_dir={tmp_path / 'data'}", f"--checkpoint={checkpoint}"], limit)
    line = assert_one_line_error(result, 2, "data.cache: keeping 'val' in memory takes about",
                                 "GiB is available to this process", "set data.cache: false")
    need, free = map(float, re.findall(r"([0-9.]+) GiB", line))
    assert need >= total / 2**30 - 0.1 and free < need / 1.5, line
