"""`tfdp predict` labels real image files on every replica, one row per image (an undecodable one with its
error); image folders read every format TensorFlow decodes, say what they ignore, and name corrupt images."""

import dataclasses
import io
import json
import os
import shutil

import fsspec
import keras
import numpy as np
import pytest
import yaml
from PIL import Image

from conftest import assert_one_line_error, run_tfdp
from tfdp.config import validate
from tfdp.data import build_source
from tfdp.errors import UserError
from tfdp.data.corrupt import LOG as CORRUPT_LOG
from tfdp.data.pipeline import Bookkeeping, eval_dataset, train_dataset
from tfdp.commands.evaluate import evaluate
from tfdp.models import build_model
from tfdp.commands.predict import predict, read_rows, request
from tfdp.distribute.strategy import local_replicas, make_runtime

SETTINGS = {"model": {"name": "simple_cnn"},
            "data": {"format": "image_folder", "image_size": 16, "eval_crop_fraction": 1.0},
            # 40 validation images: never a whole number of steps of 6 (1 replica) or 12 (2 replicas)
            "train": {"batch_size_per_replica": 6},
            "distribute": {"strategy": "mirrored", "cpu_replicas": 2}}


def settings(data_dir, model_dir, **data) -> dict:
    return {**SETTINGS, "model_dir": str(model_dir), "data": {**SETTINGS["data"], "dir": data_dir, **data}}


@pytest.fixture(scope="module")
def trained(small_dir, tmp_path_factory):
    """A partly trained model (some validation images right, some wrong), its config file and weights."""
    model_dir = tmp_path_factory.mktemp("predict-run")
    raw = settings(small_dir, model_dir)
    cfg = validate(raw)
    keras.utils.set_random_seed(1)
    model = build_model(cfg.model, cfg.data)
    model.compile(optimizer=keras.optimizers.Adam(0.003),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    split = build_source(cfg.data).split("train")
    images = eval_dataset(split, cfg.data, 32).unbatch().map(lambda x, y, w: (x, y))
    model.fit(images.shuffle(400, seed=1).batch(32).repeat().take(20), verbose=0)  # about 3/4 right
    weights = str(model_dir / "w.weights.h5")
    model.save_weights(weights)
    config_file = model_dir / "config.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    return cfg, str(config_file), weights


def top1_accuracy(rows, root):
    """Share of rows whose first class is the image's class folder."""
    right = [row["predictions"][0]["name"] == os.path.basename(os.path.dirname(row["path"])) for row in rows]
    return float(np.mean(right))


def test_predict_on_the_validation_split_gives_evaluate_top1(trained, small_dir, tmp_path):
    cfg, _, weights = trained
    runtime = make_runtime(cfg.distribute)  # 2 replicas
    result = evaluate(cfg, runtime, checkpoint=weights)
    out = str(tmp_path / "val.jsonl")
    summary = predict(cfg, runtime, weights, request(cfg, os.path.join(small_dir, "val"), out, top_k=3))
    rows = read_rows(out)
    assert summary == {**summary, "images": 40, "failed": 0}
    assert len(rows) == 40 == result["examples"] and len({r["path"] for r in rows}) == 40
    accuracy = top1_accuracy(rows, small_dir)
    print(f"predict top-1 {accuracy:.4f}, evaluate top-1 {result['top1']:.4f}")
    assert 0.0 < accuracy < 1.0  # partly trained: a wrong, lost or doubled row would show
    assert accuracy == pytest.approx(result["top1"], abs=1e-6)
    for row in rows:
        probabilities = [p["probability"] for p in row["predictions"]]
        assert len(probabilities) == 3 and probabilities == sorted(probabilities, reverse=True)
        assert row["error"] is None and all(p["name"] == str(p["class"]) for p in row["predictions"])  # folders 0..9


def test_two_replicas_give_the_rows_of_one_including_a_last_partial_batch(trained, small_dir, tmp_path):
    """40 images in steps of 6 (1 replica) and 12 (2 replicas): both end on a batch padded with blanks."""
    cfg, _, weights = trained
    val = os.path.join(small_dir, "val")
    predict(cfg, make_runtime(local_replicas(1)), weights, request(cfg, val, str(tmp_path / "one.jsonl")))
    predict(cfg, make_runtime(cfg.distribute), weights, request(cfg, val, str(tmp_path / "two.csv")))
    one, two = read_rows(str(tmp_path / "one.jsonl")), read_rows(str(tmp_path / "two.csv"))
    assert [r["path"] for r in one] == [r["path"] for r in two] == sorted(r["path"] for r in one)
    assert len(one) == 40
    for a, b in zip(one, two):
        assert [p["class"] for p in a["predictions"]] == [p["class"] for p in b["predictions"]]
        np.testing.assert_allclose([p["probability"] for p in a["predictions"]],
                                   [p["probability"] for p in b["predictions"]], atol=2e-6)


def image_bytes(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def odd_folder(small_dir, tmp_path_factory):
    """Images as users have them: PNG, grayscale and CMYK JPEG, BMP, WebP, GIF, an upper-case extension,
    a nested folder, garbage and a truncated JPEG named .jpg, and a text file."""
    root = tmp_path_factory.mktemp("odd-images")
    digit = Image.open(os.path.join(small_dir, "val", "3", sorted(os.listdir(os.path.join(small_dir, "val", "3")))[0]))
    photo = digit.convert("RGB").resize((40, 32))
    good = {"a.png": image_bytes(photo, "PNG"), "gray.jpg": image_bytes(photo.convert("L"), "JPEG"),
            "cmyk.jpg": image_bytes(photo.convert("CMYK"), "JPEG"), "b.bmp": image_bytes(photo, "BMP"),
            "c.webp": image_bytes(photo, "WEBP"), "d.gif": image_bytes(photo, "GIF"),
            "UPPER.JPEG": image_bytes(photo, "JPEG"), "nested/deeper/e.jpg": image_bytes(photo, "JPEG")}
    bad = {"corrupt.jpg": b"this is not an image at all",
           "truncated.jpg": image_bytes(photo, "JPEG")[:120]}
    for name, data in {**good, **bad, "notes.txt": b"not an image"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return str(root), sorted(good), sorted(bad)


def test_every_file_gets_a_row_and_a_corrupt_one_names_its_error(trained, odd_folder, tmp_path):
    """The real command line: one row per image file in the folder tree, in path order."""
    _, config_file, weights = trained
    root, good, bad = odd_folder
    out = tmp_path / "odd.jsonl"
    result = run_tfdp("predict", f"--config={config_file}", f"--checkpoint={weights}", f"--input={root}",
                      f"--output={out}", "--top_k=2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(str(out))
    paths = [os.path.relpath(r["path"], root) for r in rows]
    assert paths == sorted(good + bad)
    by_name = dict(zip(paths, rows))
    for name in good:
        assert by_name[name]["error"] is None and len(by_name[name]["predictions"]) == 2, by_name[name]
    assert "Unknown image file format" in by_name["corrupt.jpg"]["error"]
    assert "Invalid JPEG data" in by_name["truncated.jpg"]["error"]
    assert not by_name["corrupt.jpg"]["predictions"]
    assert "ignored 1 file(s) that are not images TensorFlow decodes (1 .txt;" in result.stdout
    assert f"tfdp: predict: {len(good + bad)} image(s) → {out} (2 could not be decoded)" in result.stdout
    for name in bad:
        assert f"tfdp: warning: corrupt image {os.path.join(root, name)}: " in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("case", ["empty folder", "glob matching nothing", "missing parent", "unwritable folder",
                                  "unknown extension", "top_k above the classes"])
def test_bad_requests_are_one_line(trained, odd_folder, tmp_path, case):
    _, config_file, weights = trained
    root = odd_folder[0]
    (tmp_path / "empty").mkdir()
    flags = {"input": root, "output": str(tmp_path / "p.jsonl"), "top_k": "5"}
    expected = {
        "empty folder": ({"input": str(tmp_path / "empty")}, "no images ("),
        "glob matching nothing": ({"input": f"{root}/*.tiff"}, "no images ("),
        "missing parent": ({"output": str(tmp_path / "no" / "p.jsonl")}, "does not exist"),
        "unwritable folder": ({"output": "/proc/p.jsonl"}, "is not writable"),
        "unknown extension": ({"output": str(tmp_path / "p.txt")}, "unknown format '.txt'"),
        "top_k above the classes": ({"top_k": "11"}, "--top_k=11 must be between 1 and the model's 10 classes"),
    }[case]
    flags.update(expected[0])
    result = run_tfdp("predict", f"--config={config_file}", f"--checkpoint={weights}",
                      *(f"--{k}={v}" for k, v in flags.items()))
    assert_one_line_error(result, 2, expected[1])
    assert not os.path.exists(tmp_path / "p.jsonl")


def test_top_k_defaults_to_five_or_every_class_of_a_smaller_model(odd_folder, tmp_path):
    """As timm's inference script: no flag on a 3-class model gives its 3 classes, on a 10-class one 5; a top_k
    the user asks for beyond the classes is still refused."""
    root = odd_folder[0]
    out = str(tmp_path / "p.jsonl")
    three = validate({**settings(root, tmp_path / "m"), "model": {"name": "simple_cnn", "num_classes": 3}})
    assert request(three, root, out).top_k == 3
    assert request(validate(settings(root, tmp_path / "m")), root, out).top_k == 5
    with pytest.raises(UserError, match="--top_k=5 must be between 1 and the model's 3 classes"):
        request(three, root, out, top_k=5)


def test_images_in_a_bucket(trained, odd_folder, gcs_bucket, tmp_path):
    cfg, _, weights = trained
    root, good, bad = odd_folder
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    fs.put(root + "/", gcs_bucket.removeprefix("gs://") + "/incoming", recursive=True)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=str(tmp_path / "cache")))
    out = str(tmp_path / "bucket.csv")
    summary = predict(cfg, make_runtime(cfg.distribute), weights, request(cfg, f"{gcs_bucket}/incoming", out, 1))
    rows = read_rows(out)
    assert [r["path"] for r in rows] == [f"{gcs_bucket}/incoming/{name}" for name in sorted(good + bad)]
    assert summary["failed"] == 2 and sum(1 for r in rows if r["error"]) == 2
    local = read_rows_of_folder(cfg, weights, root, tmp_path)
    assert [r["predictions"] for r in rows] == [r["predictions"] for r in local]


def test_images_in_a_bucket_larger_than_the_cache_go_through_in_chunks(trained, odd_folder, gcs_bucket, tmp_path):
    """data.cache_limit below the images' bytes (room for two chunks, each holding the largest image): the
    rows of the whole copy (corrupt images named too), the cache never above the limit, nothing left in it."""
    from test_streaming import DiskPeak
    cfg, _, weights = trained
    root, good, bad = odd_folder
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    fs.put(root + "/", gcs_bucket.removeprefix("gs://") + "/chunked", recursive=True)
    job = request(cfg, f"{gcs_bucket}/chunked", str(tmp_path / "chunked.csv"), 1)
    limit = 2 * max(job.sizes)
    assert limit < sum(job.sizes)   # so the images cannot be copied whole
    cache = tmp_path / "cache"
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=str(cache), cache_limit=limit))
    with DiskPeak(cache) as disk:
        summary = predict(cfg, make_runtime(cfg.distribute), weights, job)
    assert summary["chunks"] >= 3 and summary["failed"] == 2
    assert 0 < disk.peak <= limit
    assert not [f for f in cache.rglob("*") if f.is_file()]
    rows = read_rows(job.output)
    assert [r["path"] for r in rows] == [f"{gcs_bucket}/chunked/{name}" for name in sorted(good + bad)]
    local = read_rows_of_folder(cfg, weights, root, tmp_path)
    assert [(r["predictions"], bool(r["error"])) for r in rows] == [(r["predictions"], bool(r["error"])) for r in local]
    too_small = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_limit=2 * max(job.sizes) - 1))
    with pytest.raises(UserError, match=r"^data.cache_limit \(\d+ bytes\) is too small to stream these images: "
                                        r"the largest is \d+ bytes, and two chunks of images must fit$"):
        predict(too_small, make_runtime(cfg.distribute), weights, job)


def read_rows_of_folder(cfg, weights, root, tmp_path):
    out = str(tmp_path / "local.csv")
    predict(cfg, make_runtime(cfg.distribute), weights, request(cfg, root, out, 1))
    return read_rows(out)


# --- image folders as users have them ---------------------------------------

def test_folder_listing_reads_every_decodable_format_and_says_what_it_ignores(odd_folder, tmp_path, capsys):
    root, good, bad = odd_folder
    tree = tmp_path / "tree"
    for split in ("train", "val"):
        shutil.copytree(root, tree / split / "cls", ignore=shutil.ignore_patterns("nested"))
    source = build_source(validate(settings(str(tree), tmp_path / "m")).data)
    names = sorted(os.path.basename(f) for f in source.split("train").files)
    assert names == sorted(os.path.basename(n) for n in good + bad if "/" not in n)
    assert {".bmp", ".webp", ".gif", ".png"} <= {os.path.splitext(n)[1] for n in names}
    out = capsys.readouterr().out
    assert f"split 'train' in {tree}/train: ignored 1 file(s) that are not images TensorFlow decodes (1 .txt;" in out


def corrupt_copy(small_dir, root, train_bad="0/zz-corrupt.jpg", val_bad="1/zz-corrupt.jpg"):
    shutil.copytree(small_dir, root)
    (root / "train" / train_bad).write_bytes(b"\xff\xd8\xff\xe0 broken JPEG header")
    (root / "val" / val_bad).write_bytes(b"GIF89a not really")
    (root / "train" / "1" / "README.txt").write_text("labels were checked by hand")
    return root


@pytest.mark.parametrize("cache", [False, True])
def test_the_training_stream_names_the_corrupt_image_it_skipped(small_dir, tmp_path, cache):
    """Two replicas, shuffled epochs, a resumed stream: the name comes from replaying the stream's order."""
    root = corrupt_copy(small_dir, tmp_path / "data")
    cfg = validate(settings(str(root), tmp_path / "m", cache=cache, max_bad_fraction=0.05)).data
    split = build_source(cfg).split("train")
    CORRUPT_LOG.clear()
    import tensorflow as tf
    ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)
    ds = train_dataset(split, cfg, 16, seed=7, input_context=ctx, books=Bookkeeping(start=(500, 0), num_classes=10))
    for _ in ds.take(2 * 321 // 8 + 2):  # two data epochs from the middle of the second
        pass
    assert list(CORRUPT_LOG.entries) == [str(root / "train" / "0" / "zz-corrupt.jpg")]
    assert "Invalid JPEG data" in CORRUPT_LOG.entries[str(root / "train" / "0" / "zz-corrupt.jpg")]
    CORRUPT_LOG.clear()


def test_a_training_run_names_corrupt_images_and_ignored_files(small_dir, tmp_path, capsys):
    """`tfdp train --config=FILE`, run in this process (inprocess): what the run says and writes; the
    console of the real process is test_the_console_says_each_corrupt_image_once_and_nothing_from_library_internals'."""
    from support.inprocess import train_in_process
    root = corrupt_copy(small_dir, tmp_path / "data")
    model_dir = tmp_path / "run"
    config_file = tmp_path / "config.yaml"
    raw = settings(str(root), model_dir, max_bad_fraction=0.05)
    config_file.write_text(yaml.safe_dump({**raw, "train": {**raw["train"], "epochs": 1}}))
    capsys.readouterr()
    try:
        _, stdout = train_in_process(f"--config={config_file}")
        # the run's list ends with the run: an image this process meets afterwards is not written into it
        listed_at_the_end = (model_dir / "corrupt_images.txt").read_text()
        CORRUPT_LOG.record(str(tmp_path / "met-after-the-run.jpg"), "Invalid JPEG data")
        assert (model_dir / "corrupt_images.txt").read_text() == listed_at_the_end
    finally:
        CORRUPT_LOG.clear()  # the process's log of corrupt images: the tests after this one start from none
    stderr = capsys.readouterr().err
    train_bad, val_bad = root / "train" / "0" / "zz-corrupt.jpg", root / "val" / "1" / "zz-corrupt.jpg"
    assert f"split 'train' in {root}/train: ignored 1 file(s) that are not images TensorFlow decodes (1 .txt;" \
        in stdout
    assert f"tfdp: warning: corrupt image {train_bad}: Invalid JPEG data" in stderr
    assert f"tfdp: warning: corrupt image {val_bad}: " in stderr
    listed = dict(line.split("\t") for line in (model_dir / "corrupt_images.txt").read_text().splitlines())
    assert set(listed) == {str(train_bad), str(val_bad)}
    assert "Unknown image file format" in listed[str(val_bad)] or "GIF" in listed[str(val_bad)]
    assert json.loads((model_dir / "metrics.jsonl").read_text().splitlines()[-1])["corrupt_images"] == 1


@pytest.mark.full(reason="four `tfdp` processes, about 25 CPU-s: the stderr filter is tests/test_cli.py's "
                         "test_native_library_lines_are_filtered_and_the_last_line_survives_os_exit; a corrupt image "
                         "named in training is test_a_training_run_names_corrupt_images_and_ignored_files' check, in "
                         "prediction test_every_file_gets_a_row_and_a_corrupt_one_names_its_error's")
def test_the_console_says_each_corrupt_image_once_and_nothing_from_library_internals(small_dir, tmp_path):
    """Train (two epochs: every corrupt image is met twice), evaluate and predict on folders with an empty and a
    truncated JPEG, and export (LiteRT's check): stderr holds tfdp's own lines only (no libjpeg message, no Keras
    warning with its source line, no LiteRT delegate note), one warning per corrupt image and command."""
    root = corrupt_copy(small_dir, tmp_path / "data")
    empty, truncated = root / "train" / "2" / "empty.jpg", root / "train" / "3" / "truncated.jpg"
    good = sorted((root / "train" / "3").iterdir())[0].read_bytes()
    empty.write_bytes(b"")
    truncated.write_bytes(good[:len(good) // 2])
    val_truncated = root / "val" / "2" / "a-truncated.jpg"   # not the last file of the split: named mid-stream
    val_truncated.write_bytes(good[:len(good) // 2])
    config_file = tmp_path / "config.yaml"
    raw = settings(str(root), tmp_path / "run", max_bad_fraction=0.05)
    config_file.write_text(yaml.safe_dump({**raw, "train": {**raw["train"], "epochs": 2}}))
    train_bad = [root / "train" / "0" / "zz-corrupt.jpg", empty, truncated]
    val_bad = [root / "val" / "1" / "zz-corrupt.jpg", val_truncated]
    val_last = root / "val" / "9" / "zz-last.jpg"   # the split's last file: no later image shows its gap
    val_last.write_bytes(b"")
    commands = {
        "train": (("train",), train_bad + val_bad),
        "evaluate": (("evaluate",), val_bad + [val_last]),
        "predict": (("predict", f"--input={root / 'train'}", f"--output={tmp_path / 'p.jsonl'}"), train_bad),
        "export": (("export", "--format=saved_model,litert", "--verify_images=30"), []),
    }
    for name, (args, bad) in commands.items():
        result = run_tfdp(*args, f"--config={config_file}")
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert all(line.startswith("tfdp: ") for line in lines), (name, lines)
        for path in bad:
            assert sum(line.startswith(f"tfdp: warning: corrupt image {path}: ") for line in lines) == 1, (name, lines)
        assert len(lines) == len(bad), (name, lines)


def test_the_corrupt_list_names_the_first_few_and_keeps_every_one(tmp_path, capsys):
    """A resumed run's file keeps what its earlier attempt listed; warnings stop after MAX_WARNINGS."""
    from tfdp.data.corrupt import MAX_WARNINGS, CorruptLog
    listing = tmp_path / "corrupt_images.txt"
    listing.write_text("/d/earlier.jpg\tInvalid JPEG data, size 9\n")
    log = CorruptLog()
    log.write_to(str(listing))
    for i in range(MAX_WARNINGS + 3):
        log.record(f"/d/{i}.jpg", "Invalid JPEG data")
    log.record("/d/0.jpg", "met again")
    warnings = capsys.readouterr().err.splitlines()
    assert warnings[:MAX_WARNINGS] == [f"tfdp: warning: corrupt image /d/{i}.jpg: Invalid JPEG data"
                                       for i in range(MAX_WARNINGS)]
    assert warnings[MAX_WARNINGS:] == [f"tfdp: warning: more than {MAX_WARNINGS} corrupt images; the rest are "
                                       f"not named here: all of them are listed in {listing}"]
    lines = listing.read_text().splitlines()
    assert lines == ["/d/earlier.jpg\tInvalid JPEG data, size 9"] + [f"/d/{i}.jpg\tInvalid JPEG data"
                                                                      for i in range(MAX_WARNINGS + 3)]
