"""`data.format: parquet`: images and labels in Parquet files as `datasets` writes them for the Hugging Face Hub
(an `Image` struct of bytes and path, a `ClassLabel`, their features in the schema's `huggingface` metadata),
written here with pyarrow from the real digits. Read through the pipeline, every image gets its class folder's
label; a run trains from them; a row without an image is a corrupt image; every bad file is one line."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import train_one_epoch
from test_wds_layout import decoded
from tfdp.config import DataConfig
from tfdp.data import build_source
from tfdp.data.layouts.parquet import unpack
from tfdp.data.pipeline import CorruptCounter, eval_dataset
from tfdp.errors import UserError

FILES = 2


def write_parquet(tiny_dir: str, root, names=lambda split, i, n: f"data/{split}-{i:05d}-of-{n:05d}.parquet",
                  features: bool = True, row=None, text_labels: bool = False) -> None:
    """tiny_dir's images in Parquet files, FILES per split, in row groups of 8 (datasets' own are of 100);
    `row(split, number, image, label)` may change a row; `text_labels`: each label its class's name (a string
    column, as `datasets` writes one not cast to a ClassLabel)."""
    classes = sorted(os.listdir(os.path.join(tiny_dir, "train")))
    label = ({"dtype": "string", "_type": "Value"} if text_labels else
             {"names": [f"digit {c}" for c in classes], "_type": "ClassLabel"})
    meta = {b"huggingface": json.dumps({"info": {"features": {"image": {"_type": "Image"}, "label": label}}})}
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                        ("label", pa.string() if text_labels else pa.int64())], metadata=meta if features else None)
    for split in ("train", "validation"):
        folder = os.path.join(tiny_dir, "val" if split == "validation" else split)
        rows = [(open(os.path.join(folder, c, f), "rb").read(), f, label) for label, c in enumerate(classes)
                for f in sorted(os.listdir(os.path.join(folder, c)))]
        for i in range(FILES):
            mine = [row(split, n, *r) if row else r for n, r in enumerate(rows[i::FILES])]
            table = pa.table({"image": [None if image is None else {"bytes": image, "path": path}
                                        for image, path, _ in mine],
                              "label": [f"digit {classes[label]}" if text_labels and label is not None else label
                                        for _, _, label in mine]}, schema=schema)
            path = root / names(split, i, FILES)
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, path, row_group_size=8)


def test_parquet_files_give_every_image_its_class_folders_label(tiny_dir, tmp_path):
    """`datasets`' layout (data/<split>-*.parquet) and the Hub's conversion (<config>/<split>/NNNN.parquet): the
    class names from the ClassLabel; the images, unpacked into tar shards once, as the class folders give them."""
    folders = DataConfig(format="image_folder", dir=tiny_dir, image_size=16)
    pushed, converted = tmp_path / "pushed", tmp_path / "converted"
    write_parquet(tiny_dir, pushed)
    write_parquet(tiny_dir, converted, names=lambda split, i, n: f"default/{split}/{i:04d}.parquet")
    for root in (pushed, converted):
        cfg = DataConfig(format="parquet", dir=str(root), image_size=16, cache_dir=str(tmp_path / "cache"))
        source = build_source(cfg)
        assert source.class_names == tuple(f"digit {c}" for c in range(10))
        for split in ("train", "val"):
            assert source.split(split).kind == "parquet" and source.split(split).num_examples in (64, 40)
            assert decoded(source.split(split), cfg) == decoded(build_source(folders).split(split), folders)
    unpacked = tmp_path / "cache" / "parquet-tars"
    kept = set(os.listdir(unpacked))
    assert len(kept) == 2 * 2 * FILES   # one shard per file, kept
    changed = converted / "default" / "train" / "0000.parquet"   # written again: unpacked anew, its old shard gone
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))
    unpack(str(changed), source.split("train").parquet, str(tmp_path / "cache"))
    now = set(os.listdir(unpacked))
    assert len(now) == len(kept) and len(now - kept) == 1


def test_string_labels_index_the_sorted_names_of_both_splits(tiny_dir, tmp_path):
    """A string label column (no ClassLabel): the classes are the sorted names of the training and validation
    files, whichever split is listed, and every image gets its class folder's label; a name only validation has
    is a class of both listings."""
    folders = DataConfig(format="image_folder", dir=tiny_dir, image_size=16)
    write_parquet(tiny_dir, tmp_path / "data", text_labels=True)
    cfg = DataConfig(format="parquet", dir=str(tmp_path / "data"), image_size=16, cache_dir=str(tmp_path / "cache"))
    source = build_source(cfg)
    assert source.class_names == tuple(f"digit {c}" for c in range(10))
    for split in ("train", "val"):
        assert decoded(source.split(split), cfg) == decoded(build_source(folders).split(split), folders)
    validation = tmp_path / "data" / "data" / "validation-00000-of-00002.parquet"
    table = pq.read_table(validation)
    labels = table.column("label").to_pylist()
    pq.write_table(table.set_column(1, "label", pa.array(["a new class"] + labels[1:], pa.string())), validation)
    for listed in (("train",), ("val",)):
        assert build_source(cfg, listed).class_names == ("a new class", *(f"digit {c}" for c in range(10)))


def test_a_run_trains_from_parquet_and_a_row_without_an_image_is_corrupt(tiny_dir, tmp_path):
    def no_image(split, number, image, path, label):
        return (None, path, label) if split == "validation" and number == 3 else (image, path, label)
    write_parquet(tiny_dir, tmp_path / "data", row=no_image)
    cfg = DataConfig(format="parquet", dir=str(tmp_path / "data"), image_size=16, max_bad_fraction=0.5,
                     cache_dir=str(tmp_path / "cache"))
    counter = CorruptCounter()
    weights = [w for _, _, batch in eval_dataset(build_source(cfg, ("val",)).split("val"), cfg, 8,
                                                 corrupt=counter).as_numpy_iterator() for w in batch]
    assert counter.value() == FILES and sum(weights) == 40 - FILES
    result = train_one_epoch("parquet", tmp_path / "data", tmp_path / "run", "--set=data.max_bad_fraction=0.1",
                             f"--set=data.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tfdp: data: 64 train / 40 val images, 10 classes" in result.stdout, result.stdout
    assert "tfdp: done: 1 epochs, validation top-1" in result.stdout


def test_every_bad_parquet_dataset_is_one_line(tiny_dir, tmp_path):
    def refused(root, *fragments):
        with pytest.raises(UserError) as error:
            build_source(DataConfig(format="parquet", dir=str(root)), ("train",))
        assert "\n" not in str(error.value) and all(f in str(error.value) for f in fragments), str(error.value)
    refused(tmp_path, "no Parquet files for split 'train' in", "data/train-*.parquet")
    root = tmp_path / "data"
    write_parquet(tiny_dir, root, features=False)   # no features: the columns found by their names
    assert build_source(DataConfig(format="parquet", dir=str(root)), ("train",)).class_names == ()
    first = root / "data" / "train-00000-of-00002.parquet"
    pq.write_table(pa.table({"picture": [b"x"], "label": [1]}), first)
    refused(root, "train-00000-of-00002.parquet has no image column (a datasets Image, or one named image, img; "
                  "it has picture, label)")
    pq.write_table(pa.table({"image": [b"x"], "target": [1]}), first)
    refused(root, "has no integer or string label column", "it has image (binary), target (int64)")
    pq.write_table(pa.table({"image": [b"x"], "label": [0.5]}), first)
    refused(root, "has no integer or string label column", "label (double)")
    pq.write_table(pa.table({"image": [1.5], "label": [1]}), first)
    refused(root, "column image holds double, not encoded images")
    first.write_bytes(b"PAR1 but not really")
    refused(root, "train-00000-of-00002.parquet is not a Parquet file")
