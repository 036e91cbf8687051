"""`model.init_from` on the Hugging Face Hub (`hf-hub:ORG/NAME`, timm's name; `hf://ORG/NAME`, keras-hub's): the
real huggingface_hub client against a Hub on loopback (tests/support/hf_hub.py) serving real files (the timm and
keras-hub fixtures made in a side venv with timm and keras-hub), into a real cache, which then answers without
the Hub."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, assert_one_line_error, run_tfdp
from support.hf_hub import hub_server

FIXTURES = os.path.join(REPO, "tests", "fixtures")
TIMM_REPO, PRESET_REPO = "timm/vit_mini_patch4_small.tfdp_test", "keras/vit_mini_patch4_small_tfdp_test"
# What timm's save_for_hf writes beside model.safetensors (architecture, classes, pretrained cfg); the file itself
# carries no metadata but the format, as on the Hub, so the preprocessing can only come from here.
TIMM_CONFIG = {"architecture": "vit_mini_patch4_small", "num_classes": 10,
               "pretrained_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "crop_pct": 0.9,
                                  "interpolation": "bicubic", "input_size": [3, 16, 16]}}


def timm_files() -> dict[str, bytes]:
    """The timm fixture's tensors as the Hub holds timm's files: metadata {"format": "pt"}, config.json beside."""
    from safetensors.numpy import load_file, save
    tensors = load_file(os.path.join(FIXTURES, "vit_timm_mini.safetensors"))
    return {"model.safetensors": save(tensors, metadata={"format": "pt"}),
            "config.json": json.dumps(TIMM_CONFIG).encode()}


@pytest.fixture
def hub(tmp_path):
    with hub_server() as hub:
        hub.publish(TIMM_REPO, timm_files())
        hub.publish_folder(PRESET_REPO, os.path.join(FIXTURES, "vit_kerashub_mini"))
        hub.env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""}
        yield hub


def fetch(handle: str, env: dict) -> subprocess.CompletedProcess:
    """What `tfdp train` calls before TensorFlow starts, in a process of its own (huggingface_hub reads HF_* when
    imported)."""
    code = f"from tfdp.rundir.hub import local_copy; print(local_copy({handle!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def snapshot(env: dict, repo: str, commit: str) -> str:
    return os.path.join(env["HF_HOME"], "hub", f"models--{repo.replace('/', '--')}", "snapshots", commit)


def test_a_run_starts_from_a_timm_repository_and_its_pretrained_cfg(hub, tiny_dir, tmp_path):
    """`tfdp train --init_from=hf-hub:…`: config.json, then model.safetensors at the commit config.json came from,
    into the Hub's cache; every layer loaded, and the preprocessing of config.json's pretrained cfg in the run. The
    run, started again, resumes without the Hub or a cache. Then with the Hub gone the cache answers alone: the
    same snapshot, nothing fetched."""
    commit = hub.repos[TIMM_REPO][-1][0]
    train = ["train", "--config=configs/digits.yaml", "--data_format=image_folder", f"--data_dir={tiny_dir}",
             f"--model_dir={tmp_path / 'run'}", "--model=vit_mini_patch4_small", "--epochs=1",
             "--set=data.image_size=16", "--set=schedule.warmup_epochs=0", "--cpu_replicas=1",
             f"--init_from=hf-hub:{TIMM_REPO}"]
    result = run_tfdp(*train, env_extra=hub.env)
    assert result.returncode == 0, result.stderr[-3000:]
    local = os.path.join(snapshot(hub.env, TIMM_REPO, commit), "model.safetensors")
    assert f"tfdp: init_from: hf-hub:{TIMM_REPO} is {local}\n" in result.stdout
    assert re.search(rf"tfdp: init_from: loaded (\d+) of \1 layers from {re.escape(local)} \(timm layout\)",
                     result.stdout), result.stdout
    assert ("tfdp: preprocessing from model.safetensors (its timm pretrained cfg): RGB, mean 127.5,127.5,127.5, "
            "std 63.75,63.75,63.75 (R,G,B)") in result.stdout, result.stdout
    assert [path for method, path in hub.requests if method == "GET" and "/resolve/" in path] == [
        f"/{TIMM_REPO}/resolve/main/config.json", f"/{TIMM_REPO}/resolve/{commit}/model.safetensors"]
    saved = open(os.path.join(tmp_path, "run", "config.yaml"), encoding="utf-8").read()
    # the run records the repository at the commit its files came from, not this host's cache: its config runs
    # again on another host, with the same weights
    assert f"init_from: hf-hub:{TIMM_REPO}@{commit}\n" in saved and "snapshots" not in saved

    # A run that resumes reads no init_from, so it fetches nothing: a host with neither the Hub nor its cache goes on
    again = run_tfdp(*train, env_extra={**hub.env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "no_cache")})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "fetching" not in again.stdout and "tfdp: all 1 epochs already trained in" in again.stdout, again.stdout
    assert open(os.path.join(tmp_path, "run", "config.yaml"), encoding="utf-8").read() == saved   # the commit kept

    hub.requests.clear()
    hub.repos.clear()   # the Hub answers nothing now; then no Hub at all (port 9: refused), offline or not
    for env in ({**hub.env, "HF_HUB_OFFLINE": "1"}, hub.env):
        with_hub_gone = fetch(f"hf-hub:{TIMM_REPO}", {**env, "HF_ENDPOINT": "http://127.0.0.1:9"})
        assert with_hub_gone.returncode == 0 and with_hub_gone.stdout.strip() == local, with_hub_gone.stderr[-2000:]
    assert hub.requests == []


def test_a_keras_hub_preset_is_fetched_whole_and_a_moved_branch_is_followed(hub):
    """`hf://ORG/NAME`: a repository whose config.json names a keras-hub class comes as the preset folder, byte for
    byte, and configures the run as the folder on disk does; three processes fetching it at once into one empty
    cache (a host's workers starting together) all get it whole. When main moves, the next fetch takes the new
    commit; `@COMMIT` keeps the old one, from the cache."""
    from tfdp.config import validate
    env, preset = hub.env, os.path.join(FIXTURES, "vit_kerashub_mini")
    first = hub.repos[PRESET_REPO][-1][0]
    code = f"from tfdp.rundir.hub import local_copy; print(local_copy('hf://{PRESET_REPO}'))"
    together = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env={**os.environ, **env}) for _ in range(3)]
    outputs = [process.communicate(timeout=120) for process in together]
    assert [process.returncode for process in together] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    assert {out.strip() for out, _ in outputs} == {snapshot(env, PRESET_REPO, first)}
    folder = snapshot(env, PRESET_REPO, first)
    assert sorted(os.listdir(folder)) == sorted(os.listdir(preset))
    for name in os.listdir(preset):
        assert open(os.path.join(folder, name), "rb").read() == open(os.path.join(preset, name), "rb").read(), name
    model = {"name": "vit_mini_patch4_small", "num_classes": 10}
    assert validate({"model": {**model, "init_from": folder}}).data == validate(
        {"model": {**model, "init_from": preset}}).data != validate({"model": model}).data

    converter = json.loads(open(os.path.join(preset, "image_converter.json"), "rb").read())
    converter["config"]["scale"] = [1 / 255] * 3
    second = hub.publish_folder(PRESET_REPO, preset, **{"image_converter.json": json.dumps(converter).encode()})
    moved = fetch(f"hf://{PRESET_REPO}", env)
    assert moved.returncode == 0 and moved.stdout.strip() == snapshot(env, PRESET_REPO, second), moved.stderr[-2000:]
    np.testing.assert_allclose(validate({"model": {**model, "init_from": moved.stdout.strip()}}).data.std, (255,) * 3)
    hub.requests.clear()
    pinned = fetch(f"hf://{PRESET_REPO}@{first}", env)
    assert pinned.returncode == 0 and pinned.stdout.strip() == folder, pinned.stderr[-2000:]
    assert hub.gets("model.weights.h5") == 0   # the old commit's files came from the cache


def test_what_stops_a_fetch_is_one_line(hub, tmp_path):
    """Through the command line, before TensorFlow starts: a repository that is not there, gated, at a revision it
    lacks, without the weights tfdp reads; a handle that names no repository; no Hub and no copy in the cache, with
    and without HF_HUB_OFFLINE; a cache that cannot be written; a Kaggle preset handle."""
    hub.publish("timm/pickled_only", {"pytorch_model.bin": b"\x80\x02", "config.json": b"{}"})
    hub.publish("timm/gated", timm_files())
    hub.gated["timm/gated"] = "hf_secret"
    gone = {**hub.env, "HF_ENDPOINT": "http://127.0.0.1:9"}
    cases = [
        ("hf-hub:timm/no_such_model", hub.env,
         f"model.init_from: hf-hub:timm/no_such_model: no repository timm/no_such_model on the Hub ({hub.endpoint}), "
         f"or a private one this token cannot read"),
        ("hf-hub:timm/gated", hub.env, "model.init_from: hf-hub:timm/gated: the repository is gated: accept its terms "
                                       "on the Hub with your account, and give that account's token in HF_TOKEN"),
        (f"hf-hub:{TIMM_REPO}@v2", hub.env,
         f"model.init_from: hf-hub:{TIMM_REPO}@v2: the repository has no revision v2"),
        ("hf-hub:timm/pickled_only", hub.env, "model.init_from: hf-hub:timm/pickled_only has no model.safetensors "
                                              "(at commit "),
        ("hf-hub:vit_base_patch16_224", hub.env, "model.init_from: hf-hub:vit_base_patch16_224 does not name a Hugging "
                                                 "Face Hub repository (hf-hub:ORG/NAME or hf://ORG/NAME"),
        (f"hf-hub:{TIMM_REPO}", gone, f"model.init_from: hf-hub:{TIMM_REPO}: the Hub (http://127.0.0.1:9) cannot be "
                                      f"reached and the cache ({hub.env['HF_HOME']}/hub) has no copy of it"),
        (f"hf://{PRESET_REPO}", {**hub.env, "HF_HUB_OFFLINE": "1"},
         f"model.init_from: hf://{PRESET_REPO}: HF_HUB_OFFLINE is set and the cache ({hub.env['HF_HOME']}/hub) has no "
         f"copy of it"),
        (f"hf-hub:{TIMM_REPO}", {**hub.env, "HF_HOME": f"{REPO}/README.md/hf"},
         f"model.init_from: hf-hub:{TIMM_REPO}: cannot write the Hugging Face cache ({REPO}/README.md/hf/hub)"),
        ("kaggle://keras/vit/keras/vit_base_patch16_224_imagenet/4", hub.env,
         "model.init_from: kaggle://keras/vit/keras/vit_base_patch16_224_imagenet/4 is a keras-hub preset handle on "
         "Kaggle, which tfdp does not fetch from: give the preset's copy on the Hugging Face Hub (hf://ORG/NAME)"),
    ]
    for handle, env, expected in cases:
        result = run_tfdp("train", "--config=configs/digits.yaml", f"--model_dir={tmp_path / 'run'}",
                          f"--init_from={handle}", env_extra=env, timeout=120)
        assert expected in assert_one_line_error(result, 2), handle
        assert result.stderr.count("\n") == 1, result.stderr   # huggingface_hub's retries say nothing of their own
        assert "tfdp: init_from: hf" not in result.stdout.replace("tfdp: init_from: fetching", "")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
    with_token = fetch("hf-hub:timm/gated", {**hub.env, "HF_TOKEN": "hf_secret"})
    assert with_token.returncode == 0 and with_token.stdout.strip().endswith("/model.safetensors"), \
        with_token.stderr[-2000:]
