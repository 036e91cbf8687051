"""`data.format: wds`: WebDataset tar shards, written by webdataset's own `TarWriter` from the real digits.

Read through tfdp's pipeline, the shards give every image (by its decoded pixels) the label its class folder
gives it, in timm's `_info.json` layout, with dash-named shards and with a folder per split; a run trains and
evaluates from them; damaged samples are counted, a shard cut short counts what it lost, and every bad input is
one line."""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np
import pytest
import webdataset

from conftest import assert_one_line_error, run_tfdp, train_one_epoch
from tfdp.config import DataConfig, validate
from tfdp.data import build_source
from tfdp.data.layouts.webdataset import LABEL, sample_table
from tfdp.data.pipeline import Bookkeeping, CorruptCounter, eval_dataset, train_dataset
from tfdp.errors import UserError

SHARDS = 3


def write_shards(tiny_dir: str, root, name=lambda split, s: f"tiny-{split}-{s:04d}.tar",
                 splits=("train", "validation"), sample=None) -> dict[str, list[int]]:
    """tiny_dir's images as WebDataset shards (`.jpg`, `.cls`, `.json` per sample), round robin over SHARDS
    shards per split; `sample(split, number, dict)` may change a sample. Returns each shard's sample count."""
    os.makedirs(root, exist_ok=True)
    counts = {}
    for split in splits:
        folder = os.path.join(tiny_dir, "val" if split == "validation" else split)
        images = [(os.path.join(folder, cls, f), label) for label, cls in enumerate(sorted(os.listdir(folder)))
                  for f in sorted(os.listdir(os.path.join(folder, cls)))]
        counts[split] = []
        for s in range(SHARDS):
            path = os.path.join(root, name(split, s))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with webdataset.TarWriter(path) as writer:
                for number, (image, label) in enumerate(images[s::SHARDS]):
                    record = {"__key__": f"{split}/{s}-{number:04d}", "jpg": open(image, "rb").read(),
                              "cls": str(label).encode(), "json": json.dumps({"file": image}).encode()}
                    writer.write(sample(split, number, record) if sample else record)
            counts[split].append(len(images[s::SHARDS]))
    return counts


def info_file(root, counts: dict[str, list[int]], name=lambda split, s: f"tiny-{split}-{s:04d}.tar") -> None:
    """timm's `_info.json`: each split's shards and their sample counts."""
    splits = {split: {"name": split, "num_samples": sum(n), "filenames": [name(split, s) for s in range(len(n))],
                      "shard_lengths": n} for split, n in counts.items()}
    (root / "_info.json").write_text(json.dumps({"name": "tiny", "splits": splits}))


def decoded(split, cfg: DataConfig) -> dict[str, int]:
    """sha1 of each decoded validation-size image → its label, every example read once through the pipeline."""
    found = {}
    for images, labels, weights in eval_dataset(split, cfg, 8).as_numpy_iterator():
        for image, label, weight in zip(images, labels, weights):
            if weight:
                found[hashlib.sha1(image.tobytes()).hexdigest()] = int(label)
    return found


def test_shards_give_every_image_its_class_folders_label(tiny_dir, tmp_path):
    """timm's `_info.json` (its `validation` found for `val`), dash-named shards without it, and a folder of
    shards per split: the same images with the same labels as the class folders, read through the pipeline
    (and with `data.cache`); a synset file names the classes."""
    folders = DataConfig(format="image_folder", dir=tiny_dir, image_size=16)
    expected = {split: decoded(build_source(folders).split(split), folders) for split in ("train", "val")}
    timm = tmp_path / "timm"
    info_file(timm, write_shards(tiny_dir, timm))
    named = tmp_path / "named"
    write_shards(tiny_dir, named)
    (named / "synsets.txt").write_text("".join(f"digit{c}\tthe digit {c}\n" for c in range(10)))
    nested = tmp_path / "nested"
    write_shards(tiny_dir, nested, name=lambda split, s: f"{split}/{s:06d}.tar")
    for root in (timm, named, nested):
        cfg = DataConfig(format="wds", dir=str(root), image_size=16)
        source = build_source(cfg)
        for split in ("train", "val"):
            assert source.split(split).kind == "tar" and len(source.split(split).files) == SHARDS
            assert decoded(source.split(split), cfg) == expected[split], root
    cached = DataConfig(format="wds", dir=str(timm), image_size=16, cache=True)   # the bytes kept in memory
    assert decoded(build_source(cached).split("val"), cached) == expected["val"]
    assert build_source(DataConfig(format="wds", dir=str(named))).class_names == tuple(f"digit{c}" for c in range(10))
    # splits named as timm names them, by patterns: a brace range (every shard in it), shell wildcards
    patterns = DataConfig(format="wds", dir=str(timm), image_size=16, train_split="tiny-train-{0000..0002}.tar",
                          val_split="tiny-valid*-*.tar")
    source = build_source(patterns)
    assert source.split("tiny-train-{0000..0002}.tar").counts == build_source(cfg).split("train").counts
    assert decoded(source.split("tiny-valid*-*.tar"), patterns) == expected["val"]


def test_labels_from_a_json_field_and_negative_ones_left_out(tiny_dir, tmp_path):
    """`data.label_key` (timm's --target-key): each label from its sample's `.json` (a '/' path into it), no
    `.cls` needed; a sample whose number there is -1 (timm's "skip") is not in the split, its count from the walk
    though `_info.json` counts it; the tables of the two keys are kept apart; every other image keeps its class
    folder's label."""
    folders = DataConfig(format="image_folder", dir=tiny_dir, image_size=16)
    expected = decoded(build_source(folders).split("val"), folders)

    def in_json(split, number, record):   # every third sample of each shard skipped
        label = int(record.pop("cls"))
        skipped = number % 3 == 0
        return {**record, "json": json.dumps({"file": "x", "labels": {"in1k": -1 if skipped else label}}).encode()}
    root = tmp_path / "data"
    counts = write_shards(tiny_dir, root, sample=in_json)
    info_file(root, counts)
    cfg = DataConfig(format="wds", dir=str(root), image_size=16, label_key="labels/in1k",
                     cache_dir=str(tmp_path / "cache"))
    split = build_source(cfg).split("val")
    assert split.counts == tuple(n - (n + 2) // 3 for n in counts["validation"]) and split.lost == ()
    found = decoded(split, cfg)
    assert len(found) == sum(split.counts) and all(expected[image] == label for image, label in found.items())
    with_cls = tmp_path / "with_cls"
    write_shards(tiny_dir, with_cls)
    keyed = DataConfig(format="wds", dir=str(with_cls), cache_dir=str(tmp_path / "cache"), label_key="file")
    refused_by = "the first sample's label (its .json's file) is not a class number"
    with pytest.raises(UserError, match=re.escape(refused_by)):
        build_source(keyed, ("val",))
    plain = DataConfig(format="wds", dir=str(with_cls), image_size=16, cache_dir=str(tmp_path / "cache"))
    assert decoded(build_source(plain).split("val"), plain) == expected   # its .cls tables beside the keyed ones
    with pytest.raises(UserError, match=r"^data.label_key names a field of WebDataset samples' .json \(data.format "
                                        r"wds\), not of data.format csv's labels$"):
        validate({"data": {"format": "csv", "label_key": "label"}})


def test_shards_in_a_bucket_are_listed_from_info_without_copying_one(tiny_dir, tmp_path, gcs_bucket):
    """`_info.json`'s counts list a bucket's split, reading only each split's first sample in place; the
    pipeline then copies the shards and reads what a local copy gives."""
    import fsspec
    root = tmp_path / "data"
    info_file(root, write_shards(tiny_dir, root))
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    for name in sorted(os.listdir(root)):
        fs.pipe_file(f"{gcs_bucket.removeprefix('gs://')}/wds/{name}", (root / name).read_bytes())
    cfg = DataConfig(format="wds", dir=f"{gcs_bucket}/wds", image_size=16, cache_dir=str(tmp_path / "cache"))
    source = build_source(cfg)
    assert not os.path.exists(tmp_path / "cache")
    assert source.split("train").num_examples == 64 and source.split("val").files[0].startswith("gs://")
    local = DataConfig(format="wds", dir=str(root), image_size=16)
    assert decoded(source.split("val"), cfg) == decoded(build_source(local).split("val"), local)


def test_a_run_trains_and_evaluates_from_shards(tiny_dir, tmp_path):
    """Through the command line, on 2 replicas: trained, then evaluated by `tfdp evaluate`."""
    write_shards(tiny_dir, tmp_path / "data")
    run = tmp_path / "run"
    result = train_one_epoch("wds", tmp_path / "data", run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tfdp: data: 64 train / 40 val images" in result.stdout, result.stdout
    assert "tfdp: done: 1 epochs, validation top-1" in result.stdout
    result = run_tfdp("evaluate", f"--model_dir={run}")   # with the run's own config.yaml
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"tfdp: config: {run / 'config.yaml'}, the run's own (no --config given)" in result.stdout
    assert "40 images" in result.stdout, result.stdout


def test_damaged_samples_are_counted_and_a_cut_shard_counts_what_it_lost(tiny_dir, tmp_path):
    """A sample without its image, one whose label is not a number: counted as corrupt images, the others
    read. A shard cut short keeps its whole samples; `_info`'s count says how many it lost."""
    def damage(split, number, record):
        if split == "validation" and number == 2:
            del record["jpg"]
        if split == "validation" and number == 5:
            record["cls"] = b"seven"
        return record
    root = tmp_path / "data"
    counts = write_shards(tiny_dir, root, sample=damage)
    info_file(root, counts)
    cfg = DataConfig(format="wds", dir=str(root), image_size=16, max_bad_fraction=0.5)
    split = build_source(cfg, ("val",)).split("val")
    counter = CorruptCounter()
    weights = [w for _, _, batch in eval_dataset(split, cfg, 8, corrupt=counter).as_numpy_iterator() for w in batch]
    assert counter.value() == 2 * SHARDS and sum(weights) == 40 - 2 * SHARDS
    table, cut = sample_table(split.files[0])
    assert cut is None and table[2, LABEL] == -1 and table[5, LABEL] == -1 and table[3, LABEL] >= 0

    shard = root / "tiny-train-0001.tar"
    whole = sample_table(str(shard))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:int(whole[-3, 0]) + 100])   # into the third sample from the end's image
    train = build_source(cfg, ("train",)).split("train")
    assert train.counts[1] == len(whole) - 3 and train.lost == (0, 3, 0)
    assert "tiny-train-0001.tar is cut short (3 of its" in train.damage()


def test_sample_tables_are_kept_between_runs_and_made_by_a_process_pool(tiny_dir, tmp_path, monkeypatch):
    """Each shard's table is walked once and kept in data.cache_dir/wds-index (whole, for the host's other
    processes); a later listing reads it, and a changed shard is walked again. Shards above POOL_BYTES are walked
    by spawned processes, to the same tables; a shard that is no tar is the same one line from there."""
    from tfdp.data.layouts import webdataset as wds_layout
    root = tmp_path / "data"
    write_shards(tiny_dir, root)
    cfg = DataConfig(format="wds", dir=str(root), cache_dir=str(tmp_path / "cache"))
    monkeypatch.setattr(wds_layout, "POOL_BYTES", 0)
    walk = wds_layout._walk

    def not_here(*args):
        raise AssertionError("walked in the listing process, not by the pool")
    monkeypatch.setattr(wds_layout, "_walk", not_here)   # the spawned processes import their own
    source = build_source(cfg)
    monkeypatch.setattr(wds_layout, "_walk", walk)
    index = tmp_path / "cache" / "wds-index"
    kept = sorted(os.listdir(index))
    assert len(kept) == 2 * SHARDS and all(name.endswith(".npz") for name in kept)
    monkeypatch.setattr(wds_layout, "POOL_BYTES", 10**12)
    walked = {f: wds_layout._walk(f, os.path.getsize(f))[0] for f in source.split("train").files}
    wds_layout._table.cache_clear()
    for f, table in walked.items():   # read back from the kept file, as a later run reads it
        np.testing.assert_array_equal(sample_table(f)[0], table)
    shard = root / "tiny-train-0000.tar"
    shard.write_bytes(shard.read_bytes()[:int(walked[str(shard)][-1, 0]) + 10])   # cut: walked again, kept anew
    build_source(cfg)
    now = sorted(os.listdir(index))
    assert len(now) == 2 * SHARDS and sample_table(str(shard))[1] is not None   # the old version's table went
    assert len(set(now) - set(kept)) == 1
    monkeypatch.setattr(wds_layout, "POOL_BYTES", 0)
    (root / "tiny-train-0001.tar").write_bytes(b"not a tar at all" * 100)
    refused(root, "tiny-train-0001.tar is not a tar file", cache_dir=str(tmp_path / "cache"))


def test_a_resumed_stream_continues_the_uninterrupted_one(tiny_dir, tmp_path):
    """The training stream is a function of (seed, position) as for TFRecord shards: started at a checkpoint's
    position, mid-epoch, it gives the uninterrupted stream's very batches (pixels and labels)."""
    write_shards(tiny_dir, tmp_path / "data")
    cfg = DataConfig(format="wds", dir=str(tmp_path / "data"), image_size=8, shuffle_buffer=16, deterministic=True)
    split = build_source(cfg, ("train",)).split("train")

    def batches(start: int, n: int) -> list:
        ds = train_dataset(split, cfg, 8, seed=3, books=Bookkeeping(start=(start, 0)))
        return list(ds.take(n).as_numpy_iterator())
    whole, resumed = batches(0, 12), batches(40, 7)   # 1.5 epochs of 64; resumed 5 batches in
    assert sorted(label for _, labels in whole[:8] for label in labels) == sorted(
        label for label in range(10) for _ in range(7 if label < 4 else 6))
    for (image, label), (image_again, label_again) in zip(whole[5:], resumed, strict=True):
        np.testing.assert_array_equal(image, image_again)
        np.testing.assert_array_equal(label, label_again)


def refused(root, *fragments, splits=("train",), **data) -> None:
    with pytest.raises(UserError) as error:
        build_source(DataConfig(format="wds", dir=str(root), **data), splits)
    text = str(error.value)
    assert "\n" not in text and all(f in text for f in fragments), text


def test_every_bad_dataset_is_one_line(tiny_dir, tmp_path):
    root = tmp_path / "data"
    counts = write_shards(tiny_dir, root, splits=("train",))
    refused(root, "no WebDataset shards for split 'val' in", "*-val-*.tar", splits=("val",))
    refused(root, "1 of the 4 shards 'tiny-train-{0000..0003}.tar' names are not in", "the first tiny-train-0003.tar",
            splits=("tiny-train-{0000..0003}.tar",))
    refused(root, "no WebDataset shards match 'tiny-val-*.tar' in", splits=("tiny-val-*.tar",))
    (root / "_info.json").write_text("{not json")
    refused(root, "_info.json is not JSON")
    (root / "_info.json").write_text(json.dumps({"name": "x"}))
    refused(root, "_info.json has no \"splits\"")
    info_file(root, counts)
    refused(root, "_info.json lists no split 'val' (it lists: train)", splits=("val",))
    info = json.loads((root / "_info.json").read_text())
    info["splits"]["train"]["shard_lengths"] = [1]
    (root / "_info.json").write_text(json.dumps(info))
    refused(root, "split 'train' needs \"filenames\" and as many \"shard_lengths\"")
    info_file(root, {"train": counts["train"] + [5]})
    refused(root, "lists 1 shard(s) that are not there, the first", "tiny-train-0003.tar")
    os.remove(root / "_info.json")

    (root / "synsets.txt").write_text("".join(f"d{c}\n" for c in range(3)))   # fewer classes than the labels
    labels = sample_table(str(root / "tiny-train-0000.tar"))[0][:, LABEL]
    outside = np.flatnonzero(labels >= 3)
    refused(root, f"tiny-train-0000.tar: sample {outside[0]}'s label {labels[outside[0]]} is outside 0..2 "
                  f"(synsets.txt's classes); {len(outside)} sample(s) of this shard are")
    (root / "synsets.txt").write_text("".join(f"d{c}\n" for c in range(10)))
    first = root / "tiny-train-0000.tar"
    data = first.read_bytes()
    with webdataset.TarWriter(str(first)) as writer:
        writer.write({"__key__": "x", "jpg": b"x", "cls": b"12"})
    refused(root, "tiny-train-0000.tar: the first sample's label is outside 0..9 (synsets.txt's classes)")
    with webdataset.TarWriter(str(first)) as writer:
        writer.write({"__key__": "x", "jpg": b"x", "cls": b"-1"})
    refused(root, "tiny-train-0000.tar: the first sample's label is not a class number")
    first.write_bytes(data)
    os.remove(root / "synsets.txt")
    (root / "tiny-train-0000.tar").write_bytes(b"not a tar at all" * 100)
    refused(root, "tiny-train-0000.tar is not a tar file")

    unlabelled = tmp_path / "unlabelled"
    write_shards(tiny_dir, unlabelled, splits=("train",), sample=lambda s, n, r: {k: v for k, v in r.items()
                                                                                 if k != "cls"})
    refused(unlabelled, "the first sample has no .cls label (its members: .jpg, .json; data.format wds reads")
    refused(unlabelled, "the first sample's label (its .json's label) is not a class number", label_key="label")
    no_json = tmp_path / "no_json"
    write_shards(tiny_dir, no_json, splits=("train",), sample=lambda s, n, r: {k: v for k, v in r.items()
                                                                             if k != "json"})
    refused(no_json, "the first sample has no .json label (its members: .cls, .jpg; data.format wds reads an image "
                     "and its .json's label)", label_key="label")


def test_the_data_service_refuses_shards_in_one_line(tiny_dir, tmp_path):
    write_shards(tiny_dir, tmp_path / "data")
    result = run_tfdp("train", "--config=configs/digits.yaml", "--data_format=wds", f"--data_dir={tmp_path / 'data'}",
                      f"--model_dir={tmp_path / 'run'}", "--set=data.service_address=grpc://localhost:5050")
    assert_one_line_error(result, 2, "data.format wds cannot be read through the tf.data service")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
