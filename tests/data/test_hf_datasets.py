"""`data.dir: hf://datasets/ORG/NAME`: a dataset repository on the Hugging Face Hub, read as a bucket is, through
huggingface_hub's own `HfFileSystem`, against a Hub on loopback (`tests/support/hf_hub.py`) that serves the real
client the file protocol and the JSON API it lists repositories with. The run is a real `tfdp` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import assert_one_line_error, run_tfdp, train_one_epoch
from support.hf_hub import hub_server
from test_wds_layout import info_file, write_shards

REPO = "datasets/tfdp/digits-wds"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def hub():
    with hub_server() as served:
        yield served


def hub_env(hub, tmp_path) -> dict:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1"}


def listed(data_dir: str, tmp_path, env: dict) -> subprocess.CompletedProcess:
    """A process (the Hub's settings are read at import) that lists a WebDataset repository's two splits and
    prints their sizes."""
    code = ("from tfdp.config import DataConfig\nfrom tfdp.data import build_source\n"
            f"source = build_source(DataConfig(format='wds', dir='{data_dir}', cache_dir='{tmp_path / 'cache'}'))\n"
            "print(source.split('train').num_examples, source.split('val').num_examples)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=REPO_ROOT)


def publish(hub, root, repo: str = REPO) -> str:
    return hub.publish(repo, {name: (root / name).read_bytes() for name in sorted(os.listdir(root))})


def test_a_run_trains_from_a_dataset_repository(hub, tiny_dir, tmp_path):
    """WebDataset shards with timm's `_info.json` in a dataset repository: listed from `_info.json` (in pages) and
    each split's first sample, copied into data.cache_dir byte for byte, trained on and validated."""
    root = tmp_path / "wds"
    info_file(root, write_shards(tiny_dir, root))
    publish(hub, root)
    hub.page_size = 4   # the repository's 7 files listed in pages, as the Hub pages a large tree (1,000 a page)
    cache, run = tmp_path / "cache", tmp_path / "run"
    result = train_one_epoch("wds", f"hf://{REPO}", run, f"--set=data.cache_dir={cache}",
                             env_extra=hub_env(hub, tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tfdp: data: 64 train / 40 val images" in result.stdout, result.stdout
    assert "tfdp: done: 1 epochs, validation top-1" in result.stdout
    copied = cache / "hf" / REPO
    assert sorted(os.listdir(copied)) == sorted(n for n in os.listdir(root) if n.endswith(".tar"))
    for name in os.listdir(copied):
        assert (copied / name).read_bytes() == (root / name).read_bytes()
    assert any("/tree/main" in path and "cursor=" in path for _, path in hub.requests)   # a second page was read
    downloads = [path for method, path in hub.requests if method == "GET" and "/resolve/main/" in path]
    assert all(downloads.count(path) <= 2 for path in downloads), downloads   # the first sample, then the copy


def test_parquet_files_in_a_dataset_repository_read_as_local_ones(hub, tiny_dir, tmp_path):
    """A repository as `datasets`' push_to_hub leaves it (data/<split>-*.parquet): listed from the files' footers
    (byte ranges), copied, unpacked, and decoded to the very images and labels of the same files on disk."""
    from test_parquet_layout import write_parquet
    from test_wds_layout import decoded
    from tfdp.config import DataConfig
    from tfdp.data import build_source
    root = tmp_path / "pushed"
    write_parquet(tiny_dir, root)
    hub.publish("datasets/tfdp/digits-parquet", {os.path.relpath(os.path.join(base, f), root): open(
        os.path.join(base, f), "rb").read() for base, _, files in os.walk(root) for f in files})
    local = DataConfig(format="parquet", dir=str(root), image_size=16, cache_dir=str(tmp_path / "local_cache"))
    expected = decoded(build_source(local).split("val"), local)
    code = ("import json, sys; sys.path[:0] = ['tests', 'tests/data']\n"
            "from test_wds_layout import decoded\nfrom tfdp.config import DataConfig\n"
            "from tfdp.data import build_source\n"
            f"cfg = DataConfig(format='parquet', dir='hf://datasets/tfdp/digits-parquet', image_size=16, "
            f"cache_dir='{tmp_path / 'cache'}')\n"
            "source = build_source(cfg)\n"
            "print(json.dumps([source.class_names, decoded(source.split('val'), cfg)]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **hub_env(hub, tmp_path)}, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    names, found = json.loads(result.stdout.strip().splitlines()[-1])
    assert names == [f"digit {c}" for c in range(10)] and found == expected


def test_a_repository_that_cannot_be_read_is_one_line(hub, tiny_dir, tmp_path):
    """A missing repository, a gated one without a token, a revision it lacks, a Hub that does not answer: one line
    each, before TensorFlow loads, naming the repository and the endpoint; with the token the gated one lists."""
    root = tmp_path / "wds"
    write_shards(tiny_dir, root)
    publish(hub, root, "datasets/tfdp/gated")
    hub.gated["datasets/tfdp/gated"] = "secret"
    env = hub_env(hub, tmp_path)
    common = ["train", "--config=configs/digits.yaml", "--data_format=wds", f"--model_dir={tmp_path / 'run'}"]
    missing = run_tfdp(*common, "--data_dir=hf://datasets/tfdp/nothing", env_extra=env)
    assert_one_line_error(missing, 2, f"no Hugging Face Hub repository datasets/tfdp/nothing at {hub.endpoint} (or it "
                                      f"is private: set HF_TOKEN;")
    gated = run_tfdp(*common, "--data_dir=hf://datasets/tfdp/gated", env_extra=env)
    assert_one_line_error(gated, 2, "the Hugging Face Hub repository datasets/tfdp/gated", "is gated",
                          "set HF_TOKEN")
    with_token = listed("hf://datasets/tfdp/gated", tmp_path, {**env, "HF_TOKEN": "secret"})
    assert with_token.returncode == 0 and with_token.stdout.split() == ["64", "40"], with_token.stderr[-2000:]
    no_revision = run_tfdp(*common, "--data_dir=hf://datasets/tfdp/gated@v9", env_extra={**env, "HF_TOKEN": "secret"})
    assert_one_line_error(no_revision, 2, "the Hugging Face Hub repository datasets/tfdp/gated@v9 at",
                          "has no such revision")
    gone = run_tfdp(*common, "--data_dir=hf://datasets/tfdp/nothing",
                    env_extra={**env, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert_one_line_error(gone, 2, "cannot reach storage endpoint http://127.0.0.1:9")
