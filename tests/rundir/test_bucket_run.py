"""A whole run whose model_dir is a bucket, against a real S3 server on loopback (moto's, its own process).

Every `tfdp` here is a real process talking HTTP to the server, with credentials the server checks. What a
run leaves in the bucket is read back the way a user would: the listing, the objects, TensorBoard's own
event reader, `tfdp report|evaluate|export` on the URL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_one_line_error, run_tfdp, stopped
from support.s3_server import s3_server

FAST = ["--config=configs/digits.yaml", "--data_format=image_folder", "--set=data.image_size=16"]
# Where the bucket is the point and no weights are compared: the small CNN, which traces in half the demo
# ResNet's time. Two workers killed mid-checkpoint on a bucket and resumed exactly, a batch-norm ResNet, are
# tests/distribute/test_multi_worker.py's (they share that module's uninterrupted run).
SMALL = [*FAST, "--model=simple_cnn"]


@pytest.fixture(scope="module")
def s3():
    with s3_server("tfdp-runs") as server:
        yield server


@pytest.fixture
def fs(s3):
    import fsspec
    filesystem, _ = fsspec.core.url_to_fs(s3.bucket)
    filesystem.invalidate_cache()
    return filesystem


def objects(fs, url: str) -> dict[str, int]:
    """{path under url: size} of every object under `url`, listed afresh."""
    fs.invalidate_cache()
    root = url.split("://", 1)[1].rstrip("/") + "/"
    return {p[len(root):]: i["size"] for p, i in fs.find(url, detail=True).items()}


def train(s3, data_dir, model_dir, tmp_path, *extra, epochs=2, env=None, timeout=600):
    return run_tfdp("train", *SMALL, f"--data_dir={data_dir}", f"--model_dir={model_dir}", f"--epochs={epochs}",
                    f"--set=scratch_dir={tmp_path}/scratch", *extra, env_extra={**s3.env, **(env or {})},
                    timeout=timeout)


def committed(listing: dict[str, int]) -> list[str]:
    return sorted(p.split("/")[1] for p in listing if p.startswith("checkpoints/") and p.endswith("/commit.json"))


@pytest.fixture(scope="module")
def two_epochs(s3, small_dir, tmp_path_factory):
    """One run of 2 epochs in the bucket (a step checkpoint every 3 steps), which a second writer tried to join
    while it held the lease (it was stopped with SIGSTOP then, so neither could finish first): (its URL, the
    second writer's result, the first's pid, the second's scratch folder). The tests below that
    resume or damage a run each take a copy of its objects (server-side copies: the bucket is all they have)."""
    import fsspec
    fs, _ = fsspec.core.url_to_fs(s3.bucket)
    tmp_path = tmp_path_factory.mktemp("two_epochs")
    run = f"{s3.bucket}/base"
    args = [sys.executable, "-m", "tfdp", "train", *SMALL, f"--data_dir={small_dir}", f"--model_dir={run}",
            "--epochs=2", f"--set=scratch_dir={tmp_path}/one", "--set=train.checkpoint_every_steps=3"]
    first = subprocess.Popen(args, cwd=REPO, env={**os.environ, **s3.env}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while ".tfdp-lease" not in objects(fs, run):
        assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
        time.sleep(0.2)
    with stopped(first):
        second = train(s3, small_dir, run, tmp_path / "two")
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, out[-3000:] + err[-3000:]
    return run, second, first.pid, tmp_path / "two"


def copy_run(fs, source: str, run: str) -> None:
    """Every object of the run at `source` copied to `run`, as they are (names, bytes)."""
    for path in objects(fs, source):
        fs.copy(f"{source}/{path}", f"{run}/{path}")


@pytest.mark.full(reason="65 CPU-s: a run committed to and resumed from a bucket is "
                         "test_a_run_in_a_gcs_bucket_commits_and_resumes")
def test_a_run_lives_in_the_bucket_and_resumes_from_it(s3, fs, small_dir, tmp_path, two_epochs):
    """Checkpoints committed by a marker, the metrics log one object per epoch, TensorBoard's events as
    they grow; a second command on another host's empty scratch resumes from the bucket alone."""
    base = two_epochs[0]
    listing = objects(fs, base)
    run = f"{s3.bucket}/a"
    copy_run(fs, base, run)
    assert objects(fs, run) == listing
    assert committed(listing) == ["epoch-0001", "epoch-0002"]   # the step checkpoint superseded, pruned
    for name in committed(listing):
        marker = json.loads(fs.cat_file(f"{run}/checkpoints/{name}/commit.json"))
        assert marker["files"] == {f: listing[f"checkpoints/{name}/{f}"] for f in marker["files"]}
        assert set(marker["files"]) == {"model.weights.h5", "state.json"}
    assert {"checkpoints/best.weights.h5", "checkpoints/best.json", "config.yaml"} <= set(listing)
    rows = [json.loads(fs.cat_file(f"{run}/metrics/epoch-00000{e}.jsonl")) for e in (1, 2)]
    assert [r["epoch"] for r in rows] == [1, 2]
    assert ".tfdp-lease" not in listing   # released
    events = sorted(p for p in listing if "/train/" in p and "tfevents" in p)
    offsets = [int(p.rsplit(".", 1)[1]) for p in events]
    sizes = [listing[p] for p in events]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]   # each object the next bytes, none re-sent

    # Another machine: a fresh scratch folder; the bucket is all it has. `tfdp train`'s function in this process
    # (the bucket is the trainer's; the process boundary is the other tests' point), with the server's credentials.
    from support.inprocess import train_in_process
    _, second = train_in_process(*SMALL, f"--data_dir={small_dir}", f"--model_dir={run}", "--epochs=3",
                                 f"--set=scratch_dir={tmp_path / 'elsewhere'}/scratch",
                                 "--set=train.checkpoint_every_steps=3")
    assert "tfdp: resuming at epoch 3 of 3 from checkpoints/epoch-0002" in second
    listing = objects(fs, run)
    assert committed(listing) == ["epoch-0002", "epoch-0003"]
    assert sorted(p for p in listing if p.startswith("metrics/")) == [
        f"metrics/epoch-00000{e}.jsonl" for e in (1, 2, 3)]
    assert json.loads(fs.cat_file(f"{run}/metrics/epoch-000001.jsonl")) == rows[0]   # not rewritten

    # TensorBoard's own reader over the bucket's events: every epoch once, the resumed one included.
    local = tmp_path / "tb"
    fs.get(f"{run}/tensorboard", str(local), recursive=True)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for folder in ("train", "validation"):
        acc = EventAccumulator(str(local / folder), size_guidance={"tensors": 0})
        acc.Reload()
        assert [e.step for e in acc.Tensors("epoch_loss")] == [0, 1, 2], folder

    # The read commands take the URL: the report and an export are uploaded beside the run.
    report = run_tfdp("report", run, env_extra=s3.env, timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    assert f"tfdp: bucket: uploaded report/ to {run}/report" in report.stdout
    assert "| epochs | 3 |" in report.stdout
    assert {"report/report.md", "report/loss.png"} <= set(objects(fs, run))
    last = json.loads(fs.cat_file(f"{run}/metrics/epoch-000003.jsonl"))
    best = json.loads(fs.cat_file(f"{run}/checkpoints/best.json"))
    assert best["value"] == max(json.loads(fs.cat_file(f"{run}/metrics/epoch-00000{e}.jsonl"))["val_top1"]
                                for e in (1, 2, 3))
    evaluated = run_tfdp("evaluate", *SMALL, f"--data_dir={small_dir}", f"--model_dir={run}",
                         f"--set=scratch_dir={tmp_path}/scratch", env_extra=s3.env, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert f"top1 {best['value']:.4f}" in evaluated.stdout, (evaluated.stdout, last)
    exported = run_tfdp("export", *SMALL, f"--data_dir={small_dir}", f"--model_dir={run}", "--format=keras",
                        f"--set=scratch_dir={tmp_path}/scratch", env_extra=s3.env, timeout=300)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert {"export/model.keras", "export/classes.json"} <= set(objects(fs, run))
    # Every line names the bucket's objects, never the reader's local copy, gone with it.
    assert f"tfdp: export: wrote {run}/export/model.keras and {run}/export/classes.json" in exported.stdout
    assert f"tfdp: export: keras: {run}/export/model.keras: top-1 agrees" in exported.stdout
    assert str(tmp_path / "scratch") not in exported.stdout + exported.stderr
    empty = run_tfdp("evaluate", *SMALL, f"--data_dir={small_dir}", f"--model_dir={s3.bucket}/nothing-here",
                     f"--set=scratch_dir={tmp_path}/scratch", env_extra=s3.env, timeout=300)
    assert_one_line_error(empty, 2, f"no checkpoint at {s3.bucket}/nothing-here/checkpoints/best.weights.h5")

    # The evaluator beside a bucket run: the committed checkpoints, each once; its rows one object each, its
    # TensorBoard run beside the trainer's, the best checkpoint its own where the workers do not validate.
    watched = run_tfdp("evaluate", *SMALL, f"--data_dir={small_dir}", f"--model_dir={run}", "--epochs=3",
                       "--continuous", "--poll_seconds=0.2", "--set=train.validate=never",
                       f"--set=scratch_dir={tmp_path}/scratch", env_extra=s3.env, timeout=300)
    assert watched.returncode == 0, watched.stdout[-3000:] + watched.stderr[-2000:]
    assert re.findall(r"tfdp: evaluate: (\S+): loss", watched.stdout) == [
        f"{run}/checkpoints/epoch-0002", f"{run}/checkpoints/epoch-0003"]
    assert f"rows in {run}/eval_metrics/; best val_top1" in watched.stdout
    assert str(tmp_path / "scratch") not in watched.stdout + watched.stderr
    listing = objects(fs, run)
    steps = [json.loads(fs.cat_file(f"{run}/{p}"))["step"] for p in sorted(listing) if p.startswith("eval_metrics/")]
    assert steps == [json.loads(fs.cat_file(f"{run}/checkpoints/epoch-000{e}/state.json"))["step"] for e in (2, 3)]
    assert [p for p in listing if p.startswith("tensorboard/eval/") and "tfevents" in p]
    assert json.loads(fs.cat_file(f"{run}/checkpoints/best.json"))["step"] in steps
    assert [p for p in os.listdir(tmp_path / "scratch") if p.startswith(("read-", "eval-"))] == []   # copies gone


def test_an_uncommitted_or_changed_checkpoint_is_never_resumed_from(s3, fs, small_dir, tmp_path, two_epochs):
    """What kill -9 between a checkpoint's objects and its marker leaves (the objects, no marker), and an
    object whose size changed after its commit: both skipped, the first swept, the run resumes from the
    newest intact one."""
    run = f"{s3.bucket}/b"
    copy_run(fs, two_epochs[0], run)   # a finished run of 2 epochs: epoch-0001 and epoch-0002 committed
    assert committed(objects(fs, run)) == ["epoch-0001", "epoch-0002"]
    # epoch-0003 as a run killed before its marker leaves it: every object there, no commit.json.
    for f in ("model.weights.h5", "state.json"):
        fs.copy(f"{run}/checkpoints/epoch-0002/{f}", f"{run}/checkpoints/epoch-0003/{f}")
    # epoch-0002's weights replaced by a shorter object after it was committed.
    fs.pipe_file(f"{run}/checkpoints/epoch-0002/model.weights.h5", b"not weights")
    again = train(s3, small_dir, run, tmp_path, "--set=train.checkpoint_every_steps=3", epochs=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"tfdp: warning: skipping checkpoint {run}/checkpoints/epoch-0002: object(s) changed since it was "
            f"committed: model.weights.h5 (11, ") in again.stderr
    assert "tfdp: bucket: removed 1 uncommitted checkpoint(s) a stopped run left (epoch-0003)" in again.stdout
    assert "tfdp: resuming at epoch 2 of 2 from checkpoints/epoch-0001" in again.stdout
    listing = objects(fs, run)
    assert committed(listing) == ["epoch-0001", "epoch-0002"]   # epoch 2 trained again and committed
    assert listing["checkpoints/epoch-0002/model.weights.h5"] == listing["checkpoints/epoch-0001/model.weights.h5"]
    assert not [p for p in listing if p.startswith("checkpoints/epoch-0003/")]


def test_a_second_writer_on_a_bucket_run_is_refused(two_epochs):
    """The lease is one object created with If-None-Match: * on the real server; the second run, on its own
    scratch, is refused while the first is alive (stopped with SIGSTOP, so neither can finish first), and the
    first goes on to finish (the module's `two_epochs` run)."""
    run, second, first_pid, second_scratch = two_epochs
    assert_one_line_error(second, 2, f"model_dir {run} is in use by another run", f"pid {first_pid}")
    assert not os.path.exists(second_scratch)   # refused before it copied anything


def test_no_write_permission_is_one_line_before_training(s3, small_dir, tmp_path):
    result = train(s3, small_dir, f"{s3.bucket}/d", tmp_path, env=s3.reader)
    line = assert_one_line_error(result, 2, f"cannot write to model_dir {s3.bucket}/d: ")
    assert "denied" in line.lower() or "forbidden" in line.lower(), line
    assert "Epoch 1" not in result.stdout and "tfdp: data:" not in result.stdout


def test_a_bucket_that_stops_answering_ends_the_run_with_the_restart_status(small_dir, tmp_path):
    """The server killed mid-run: uploads retry for train.upload_retry_seconds, then exit 143 and one line."""
    with s3_server("tfdp-gone") as server:
        port = server.endpoint.rsplit(":", 1)[1]
        args = [sys.executable, "-m", "tfdp", "train", *SMALL, f"--data_dir={small_dir}",
                f"--model_dir={server.bucket}/run", "--epochs=3", f"--set=scratch_dir={tmp_path}/scratch",
                "--set=train.upload_retry_seconds=4", "--set=train.checkpoint_every_steps=0"]
        proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, **server.env}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith("Epoch 1/"):
                break
        os.kill(_listening_pid(port), signal.SIGKILL)
        started = time.time()
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"tfdp: stopped: the bucket of model_dir {server.bucket}/run did not answer for 4 s "
                           f"while trying to "), last
    assert last.endswith("exit 143 (run the same command to continue)"), last
    assert time.time() - started < 120


@pytest.mark.full(reason="50 CPU-s: a bucket that stops answering ends with the restart status in "
                         "test_a_bucket_that_stops_answering_ends_the_run_with_the_restart_status")
def test_a_data_bucket_that_stops_answering_mid_run_ends_with_the_restart_status(small_dir, tmp_path):
    """Images streamed from the bucket through a cache a quarter of their size; the server killed mid-run:
    the fetcher retries for 6 x data.remote_timeout, then exit 143 naming the object (the same command
    resumes from the last checkpoint once the bucket is back). data.remote_timeout is 2 s, not less: it also
    bounds the bucket's first answer at start-up, which a loaded host's server once missed at 0.5 s (exit 2)."""
    import fsspec
    with s3_server("tfdp-data-gone") as server:
        fs, _ = fsspec.core.url_to_fs(server.bucket)
        fs.put(small_dir, f"{server.bucket}/data", recursive=True)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(small_dir) for f in files)
        args = [sys.executable, "-m", "tfdp", "train", *SMALL, f"--data_dir={server.bucket}/data",
                f"--model_dir={tmp_path}/run", "--epochs=3", f"--set=data.cache_dir={tmp_path}/cache",
                f"--set=data.cache_limit={size // 4}", "--set=data.remote_timeout=2"]
        proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, **server.env}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith("Epoch 1/"):
                break
        os.kill(_listening_pid(server.endpoint.rsplit(":", 1)[1]), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    last = err.strip().splitlines()[-1]
    assert re.match(rf"tfdp: stopped: cannot download {server.bucket}/data/\S+ \(retried for 12 s, 6 times "
                    rf"data.remote_timeout\): .*; exit 143 \(run the same command to continue\)$", last), last


def _listening_pid(port: str) -> int:
    """The process whose command line serves `port` (the server a context manager started)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"moto.server" in cmdline and port.encode() in cmdline:
            return int(pid)
    raise AssertionError(f"no server process on port {port}")


def test_a_run_in_a_gcs_bucket_commits_and_resumes(gcs_bucket, small_dir, tmp_path):
    """The same on gs:// (the GCS emulator on loopback, through gcsfs). Both runs are `tfdp train`'s function in
    this process (the bucket is the trainer's, tfdp/train/trainer.py; the process boundary is the S3 tests')."""
    import fsspec
    from support.inprocess import train_in_process
    run = f"{gcs_bucket}/run-{tmp_path.name}"
    for epochs, scratch in ((1, "one"), (2, "two")):
        _, out = train_in_process(*SMALL, f"--data_dir={small_dir}", f"--model_dir={run}", f"--epochs={epochs}",
                                  f"--set=scratch_dir={tmp_path}/{scratch}", "--set=train.checkpoint_every_steps=0",
                                  "--set=schedule.warmup_epochs=0")
    assert "tfdp: resuming at epoch 2 of 2 from checkpoints/epoch-0001" in out
    gcs, _ = fsspec.core.url_to_fs(run)
    listing = objects(gcs, run)
    assert committed(listing) == ["epoch-0001", "epoch-0002"]
    assert [json.loads(gcs.cat_file(f"{run}/metrics/epoch-00000{e}.jsonl"))["epoch"] for e in (1, 2)] == [1, 2]
    assert ".tfdp-lease" not in listing


def cached_files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(base, f), root) for base, _, files in os.walk(root) for f in files)


def test_a_fresh_run_starts_from_a_run_in_the_bucket(s3, fs, small_dir, tmp_path, two_epochs):
    """`--init_from=s3://…/run` on a local model_dir: `tfdp train` copies what init_from reads of a run (its best
    checkpoint and config.yaml, not its other checkpoints or logs) into data.cache_dir, byte for byte, and starts
    from it: every layer loaded. `tfdp evaluate --checkpoint=s3://…` likewise."""
    base = two_epochs[0]
    cache = tmp_path / "cache"
    result = train(s3, small_dir, tmp_path / "fine", tmp_path, f"--init_from={base}", f"--set=data.cache_dir={cache}",
                   "--set=schedule.warmup_epochs=0", epochs=1)
    assert result.returncode == 0, result.stderr[-3000:]
    local = cache / "s3" / base.split("://")[1]
    assert f"tfdp: init_from: {base} copied to {local}\n" in result.stdout
    assert re.search(rf"tfdp: init_from: loaded (\d+) of \1 layers from .*{re.escape(str(local))}", result.stdout), \
        result.stdout
    from tfdp.rundir.init_from import RUN_FILES
    assert cached_files(local) == sorted(RUN_FILES)
    assert (local / "checkpoints" / "best.weights.h5").read_bytes() == fs.cat_file(
        f"{base}/checkpoints/best.weights.h5")
    saved = (tmp_path / "fine" / "config.yaml").read_text()
    assert f"init_from: {base}\n" in saved   # the bucket's run, not this host's copy: the config runs elsewhere too

    # `--checkpoint` in the bucket: `tfdp evaluate` copies it too, and finds what the run logged for that epoch.
    weights = f"{base}/checkpoints/epoch-0002/model.weights.h5"
    evaluated = run_tfdp("evaluate", *SMALL, f"--data_dir={small_dir}", f"--model_dir={tmp_path / 'fine'}",
                         f"--checkpoint={weights}", f"--set=data.cache_dir={cache}", env_extra=s3.env, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert f"tfdp: checkpoint: {weights} copied to {cache / 's3' / weights.split('://')[1]}\n" in evaluated.stdout
    row = json.loads(fs.cat_file(f"{base}/metrics/epoch-000002.jsonl"))
    assert f"loss {row['val_loss']:.4f}, top1 {row['val_top1']:.4f}" in evaluated.stdout, evaluated.stdout


def test_bucket_weights_are_copied_as_their_readers_need_them(s3, fs, tmp_path, two_epochs):
    """A timm file in the bucket configures the run as the same file on disk does (its preprocessing reaches the
    config), and is copied afresh when it changed at the same size; a checkpoint folder of a bucket run comes with
    the run's config.yaml; nothing there, or a run with no best checkpoint, is one line."""
    from tfdp.config import validate
    from tfdp.errors import UserError
    from tfdp.rundir.init_from import local_copy
    base, cache = two_epochs[0], str(tmp_path / "cache")
    timm_file = os.path.join(REPO, "tests", "fixtures", "vit_timm_mini.safetensors")
    fs.put_file(timm_file, f"{s3.bucket}/weights/vit.safetensors")
    local = local_copy(f"{s3.bucket}/weights/vit.safetensors", cache)
    assert open(local, "rb").read() == open(timm_file, "rb").read()
    model = {"name": "vit_mini_patch4_small", "num_classes": 10}
    from_bucket, from_disk = (validate({"model": {**model, "init_from": path}}).data for path in (local, timm_file))
    assert from_bucket == from_disk and from_disk != validate({"model": model}).data
    changed = bytearray(open(timm_file, "rb").read())
    changed[-1] ^= 1   # the same size, another byte: copied afresh all the same
    fs.pipe_file(f"{s3.bucket}/weights/vit.safetensors", bytes(changed))
    assert open(local_copy(f"{s3.bucket}/weights/vit.safetensors", cache), "rb").read() == changed

    folder = local_copy(f"{base}/checkpoints/epoch-0002", cache)
    assert cached_files(folder) == ["commit.json", "model.weights.h5", "state.json"]
    run = os.path.dirname(os.path.dirname(folder))
    assert cached_files(run) == ["checkpoints/epoch-0002/commit.json", "checkpoints/epoch-0002/model.weights.h5",
                                 "checkpoints/epoch-0002/state.json", "config.yaml"]

    with pytest.raises(UserError, match=rf"^model.init_from: nothing at {s3.bucket}/no-such-weights \(no object, "
                                        r"no folder\)$"):
        local_copy(f"{s3.bucket}/no-such-weights", cache)
    unfinished = f"{s3.bucket}/unfinished"
    for rel in ("config.yaml", "checkpoints/epoch-0001/model.weights.h5"):
        fs.copy(f"{base}/{rel}", f"{unfinished}/{rel}")
    fs.invalidate_cache()
    with pytest.raises(UserError, match=rf"^model.init_from: the run {unfinished} has no best checkpoint yet "):
        local_copy(unfinished, cache)


def test_a_keras_hub_preset_in_a_gcs_bucket_is_copied_whole(gcs_bucket, tmp_path):
    """gs:// through gcsfs (the GCS emulator on loopback): a keras-hub preset folder, every file byte for byte, and
    the copy reads as the preset on disk does."""
    import fsspec
    from tfdp.config import validate
    from tfdp.rundir.init_from import local_copy
    preset = os.path.join(REPO, "tests", "fixtures", "vit_kerashub_mini")
    gcs, _ = fsspec.core.url_to_fs(gcs_bucket)
    url = f"{gcs_bucket}/presets-{tmp_path.name}/vit_kerashub_mini"
    gcs.put(preset, url, recursive=True)
    local = local_copy(url, str(tmp_path / "cache"))
    assert cached_files(local) == sorted(os.listdir(preset))
    for name in os.listdir(preset):
        assert open(os.path.join(local, name), "rb").read() == open(os.path.join(preset, name), "rb").read(), name
    model = {"name": "vit_mini_patch4_small", "num_classes": 10}
    assert validate({"model": {**model, "init_from": local}}).data == validate(
        {"model": {**model, "init_from": preset}}).data
