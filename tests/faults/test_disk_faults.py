"""Full and read-only disks: small real file systems the tests mount themselves (tmpfs),
so ENOSPC and EROFS come from the kernel, not from a mock. Skipped, with the reason, only where the
machine forbids mounting."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_one_line_error, run_tfdp, stopped

FAST = ["--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=16",
        "--batch_size_per_replica=32", "--set=log.tensorboard=false"]


@contextlib.contextmanager
def tmpfs(path, size: str = "16m", read_only: bool = False):
    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_read_only(path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def digest(folder) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder))}


def fill(folder, leave: int) -> str:
    """Fills the file system of `folder` until only about `leave` bytes are free."""
    path = os.path.join(folder, "filler")
    with open(path, "wb") as f:
        free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
        f.write(b"\0" * max(free - leave, 0))
    return path


@pytest.mark.slow
def test_full_disk_during_training_keeps_the_last_checkpoint_and_resumes_once_freed(tmp_path, digits_dir):
    with tmpfs(tmp_path / "disk") as disk:
        model_dir = disk / "run"
        args = ["train", *FAST, f"--data_dir={digits_dir}", f"--model_dir={model_dir}", "--epochs=3",
                "--set=train.checkpoint_every_steps=0"]
        proc = subprocess.Popen([sys.executable, "-m", "tfdp", *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        epoch1 = model_dir / "checkpoints" / "epoch-0001"
        deadline = time.time() + 300
        while not (epoch1 / "state.json").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        with stopped(proc):  # held while the disk fills up
            kept = digest(epoch1)
            filler = fill(disk, leave=200_000)  # room for the small files, not for a checkpoint
        out, err = proc.communicate(timeout=300)
        result = subprocess.CompletedProcess(args, proc.returncode, out, err)
        line = assert_one_line_error(result, 2, "no space left on the device while writing", str(model_dir / "checkpoints"),
                                     "MB free")
        assert "needed about" in line
        assert digest(epoch1) == kept  # the previous complete checkpoint, byte for byte
        leftovers = [os.path.join(r, n) for r, ds, fs in os.walk(model_dir) for n in fs + ds if ".tmp" in n]
        assert leftovers == []  # no partial files

        os.remove(filler)
        again = run_tfdp(*args, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "tfdp: resuming at epoch 2 of 3" in again.stdout
        assert "tfdp: done: 3 epochs" in again.stdout


def test_model_dir_that_is_a_file(tmp_path, digits_dir):
    (tmp_path / "run").write_text("not a folder")
    result = run_tfdp("train", *FAST, f"--data_dir={digits_dir}", f"--model_dir={tmp_path}/run", timeout=120)
    assert_one_line_error(result, 2, f"model_dir {tmp_path}/run is a file, not a folder")


def test_read_only_model_dir_and_read_only_checkpoints_folder(tmp_path, digits_dir):
    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        result = run_tfdp("train", *FAST, f"--data_dir={digits_dir}", f"--model_dir={ro}/run", timeout=120)
        assert_one_line_error(result, 2, "cannot write to model_dir", "read-only")
    with tmpfs(tmp_path / "rw") as rw:
        with tmpfs(rw / "run" / "checkpoints") as checkpoints:
            remount_read_only(checkpoints)
            result = run_tfdp("train", *FAST, f"--data_dir={digits_dir}", f"--model_dir={rw}/run", timeout=120)
            assert_one_line_error(result, 2, f"{checkpoints}", "read-only")
            assert not (rw / "run" / "metrics.jsonl").exists()  # nothing trained, nothing half-written


def test_export_and_report_into_read_only_folders(tmp_path, digits_dir):
    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        result = run_tfdp("export", *FAST, f"--data_dir={digits_dir}", f"--model_dir={tmp_path}/run",
                          f"--export_dir={ro}/export", timeout=120)
        assert_one_line_error(result, 2, "cannot write to the export folder", "read-only")
    with tmpfs(tmp_path / "done") as run:
        (run / "metrics.jsonl").write_text('{"epoch": 1, "loss": 1.0, "val_loss": 1.0, "val_top1": 0.5, '
                                           '"top1": 0.5, "lr": 0.1, "seconds": 1.0, "images_per_sec": 10.0}\n')
        remount_read_only(run)
        result = run_tfdp("report", str(run), timeout=60)
        assert_one_line_error(result, 2, "cannot write to the report folder", "read-only")


@pytest.mark.parametrize("mode", ["copied whole", "streamed"])
def test_a_full_disk_while_fetching_is_one_line_and_nothing_half_written_is_read(gcs_bucket, tmp_path, mode):
    """The cache's disk holds a third of the images; data.cache_limit is above that (the whole share, so it
    is copied whole; or half of it, so it streams): the fetch that hits the full disk ends the input in one
    line naming the object (the disk, not the bucket: no retries, no restart status); its partial download
    is gone and every file left there is whole."""
    import dataclasses

    import fsspec

    from test_streaming import BATCH, _config, _small_tree
    from tfdp.data.pipeline import data_errors, train_dataset
    from tfdp.errors import UserError
    split, total = _small_tree(gcs_bucket, "filling-" + mode.replace(" ", "-"))
    with tmpfs(tmp_path / "disk", size="1m") as disk:
        fill(disk, leave=total // 3)
        limit = total if mode == "copied whole" else total // 2
        cfg = dataclasses.replace(_config(disk / "cache", limit), remote_timeout=30.0)
        started = time.monotonic()
        with pytest.raises(UserError) as error, data_errors():
            for _ in train_dataset(split, cfg, BATCH, seed=7).take(3 * 40 // BATCH):
                pass
        message = str(error.value)
        assert message.startswith("no space left on the device of "), message
        assert f"{gcs_bucket}/filling-" in message and " free" in message and "\n" not in message
        assert time.monotonic() - started < 30   # at once, not after the bucket's retries
        fs, _ = fsspec.core.url_to_fs(gcs_bucket)
        # Fetches still in flight when the error ended the input finish on their pool's threads, each removing its
        # own partial download as it ends (storage.fetch's `finally`): wait for them, not for ever.
        deadline = time.monotonic() + 20
        while True:
            left = [os.path.join(folder, name) for folder, _, names in os.walk(disk / "cache") for name in names]
            if not [p for p in left if ".tmp-" in p] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not [p for p in left if ".tmp-" in p]
        for path in left:
            remote = path.split(os.sep + "gs" + os.sep, 1)[1]
            assert os.path.getsize(path) == fs.size(remote), path
