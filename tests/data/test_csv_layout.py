"""`data.format: csv`: images listed with their labels in `DIR/<split>.csv`. The real digits' JPEGs, flattened into
one folder and listed in labels files, give each image the label the class folders give it; a run trains on them;
every bad labels file is one line."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil

import pytest

from conftest import assert_one_line_error, run_tfdp, train_one_epoch
from tfdp.config import DataConfig
from tfdp.data import build_source
from tfdp.errors import UserError


def write_csv(path, header, rows, encoding="utf-8"):
    with open(path, "w", newline="", encoding=encoding) as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def csv_dataset(tiny_dir: str, root, label=lambda cls: f"digit_{cls}", header=("file_name", "label")) -> str:
    """tiny_dir's images in one folder, `root/images/`, listed in train.csv and val.csv (with Excel's byte-order
    mark and an extra column, as spreadsheets write them)."""
    os.makedirs(root / "images")
    for split in ("train", "val"):
        rows = []
        for cls in sorted(os.listdir(os.path.join(tiny_dir, split))):
            for name in sorted(os.listdir(os.path.join(tiny_dir, split, cls))):
                shutil.copy(os.path.join(tiny_dir, split, cls, name), root / "images" / f"{split}-{cls}-{name}")
                rows.append((f"images/{split}-{cls}-{name}", label(cls), "a note"))
        write_csv(root / f"{split}.csv", (*header, "notes"), rows, encoding="utf-8-sig")
    return str(root)


def by_content(source, split: str) -> dict[str, int]:
    """sha1 of each listed image's bytes → its label."""
    listed = source.split(split)
    return {hashlib.sha1(open(f, "rb").read()).hexdigest(): label for f, label in zip(listed.files, listed.labels)}


def test_labels_files_list_the_images_as_their_class_folders_do(tiny_dir, tmp_path):
    """Names sorted (digit_0 … digit_9: the folders' order), as numbers where every label is an integer (0, 5, 10,
    … 45: not '10' before '5'), or in classes.txt's order; Hugging Face imagefolder's <split>/metadata.csv; a
    command that lists validation alone (evaluate) gets training's classes too."""
    folders = build_source(DataConfig(format="image_folder", dir=tiny_dir))
    named = build_source(DataConfig(format="csv", dir=csv_dataset(tiny_dir, tmp_path / "named")))
    assert named.class_names == tuple(f"digit_{c}" for c in folders.class_names)
    for split in ("train", "val"):
        assert by_content(named, split) == by_content(folders, split)
        assert named.split(split).num_examples == folders.split(split).num_examples

    numbers = csv_dataset(tiny_dir, tmp_path / "numbers", label=lambda cls: str(5 * int(cls)),
                          header=("image", "class"))
    source = build_source(DataConfig(format="csv", dir=numbers))
    assert source.class_names == tuple(str(5 * i) for i in range(10))
    assert by_content(source, "train") == by_content(folders, "train")

    (tmp_path / "numbers" / "classes.txt").write_text("".join(f"{5 * i}\n" for i in reversed(range(10))))
    reversed_order = build_source(DataConfig(format="csv", dir=numbers))
    assert {k: 9 - v for k, v in by_content(reversed_order, "val").items()} == by_content(folders, "val")
    os.remove(tmp_path / "numbers" / "classes.txt")

    # Hugging Face's imagefolder: <split>/metadata.csv, its paths starting from the split's folder
    hub_layout = tmp_path / "imagefolder"
    for split in ("train", "val"):
        rows = list(csv.reader(open(tmp_path / "named" / f"{split}.csv", encoding="utf-8-sig")))
        os.makedirs(hub_layout / split / "images")
        for image, _, _ in rows[1:]:
            shutil.copy(tmp_path / "named" / image, hub_layout / split / image)
        write_csv(hub_layout / split / "metadata.csv", ("file_name", "label"), [r[:2] for r in rows[1:]])
    imagefolder = build_source(DataConfig(format="csv", dir=str(hub_layout)))
    assert imagefolder.class_names == named.class_names
    for split in ("train", "val"):
        assert by_content(imagefolder, split) == by_content(folders, split)
        assert all(f.startswith(f"{hub_layout}/{split}/images/") for f in imagefolder.split(split).files)
    # … or its metadata.jsonl, one object per image (here with the class as a JSON number, and more fields)
    for split in ("train", "val"):
        rows = list(csv.reader(open(hub_layout / split / "metadata.csv", encoding="utf-8")))[1:]
        os.remove(hub_layout / split / "metadata.csv")
        (hub_layout / split / "metadata.jsonl").write_text("".join(
            json.dumps({"file_name": image, "Label": int(label.removeprefix("digit_")), "caption": "a digit"}) + "\n"
            for image, label in rows))
    jsonl = build_source(DataConfig(format="csv", dir=str(hub_layout)))
    assert jsonl.class_names == folders.class_names
    for split in ("train", "val"):
        assert by_content(jsonl, split) == by_content(folders, split)

    # integer labels that are no name in classes.txt index it; a semicolon-separated file (a comma-decimal locale's)
    indexed = csv_dataset(tiny_dir, tmp_path / "indexed", label=lambda cls: cls)
    names = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
    (tmp_path / "indexed" / "classes.txt").write_text("\n".join(names) + "\n")
    rows = list(csv.reader(open(tmp_path / "indexed" / "val.csv", encoding="utf-8-sig")))
    (tmp_path / "indexed" / "val.csv").write_text("".join(";".join(row) + "\n" for row in rows))
    by_index = build_source(DataConfig(format="csv", dir=indexed))
    assert by_index.class_names == names
    assert by_content(by_index, "train") == by_content(folders, "train")
    assert by_content(by_index, "val") == by_content(folders, "val")

    rows = list(csv.reader(open(tmp_path / "numbers" / "val.csv", encoding="utf-8-sig")))
    write_csv(tmp_path / "numbers" / "val.csv", rows[0], [r for r in rows[1:] if r[1] != "45"])  # no 9s to evaluate
    alone = build_source(DataConfig(format="csv", dir=numbers), splits=("val",))
    assert alone.class_names == source.class_names and set(alone.splits) == {"val"}
    assert 9 not in alone.split("val").labels


def test_the_converter_turns_labels_files_into_shards_with_the_same_labels(tiny_dir, tmp_path):
    """`python -m pipelines.convert_imagenet --format=csv`: the shards hold every listed image once, under the label
    and class name the csv listing gives it, class names with spaces and classes.txt's order (not sorted) kept."""
    import tensorflow as tf
    from pipelines.convert_imagenet import convert
    data = csv_dataset(tiny_dir, tmp_path / "data", label=lambda cls: f"digit {cls}")
    (tmp_path / "data" / "classes.txt").write_text("".join(f"digit {c}\n" for c in (3, 1, 4, 0, 5, 9, 2, 6, 8, 7)))
    convert(data, str(tmp_path / "shards"), data_format="csv", train_shards=2, val_shards=1, workers=1,
            progress=False)
    listed = build_source(DataConfig(format="csv", dir=data))
    shards = build_source(DataConfig(format="tfrecord", dir=str(tmp_path / "shards")))
    assert shards.class_names == listed.class_names
    for split in ("train", "val"):
        stored = {}
        for record in tf.data.TFRecordDataset(list(shards.split(split).files)):
            example = tf.train.Example.FromString(record.numpy()).features.feature
            stored[hashlib.sha1(example["image/encoded"].bytes_list.value[0]).hexdigest()] = (
                example["image/class/label"].int64_list.value[0] - 1,
                example["image/class/synset"].bytes_list.value[0].decode())
        assert stored == {digest: (label, listed.class_names[label])
                          for digest, label in by_content(listed, split).items()}


def test_a_run_trains_and_evaluates_from_labels_files(tiny_dir, tmp_path):
    """Through the command line: the images listed, trained on 2 replicas, evaluated."""
    data = csv_dataset(tiny_dir, tmp_path / "data")
    result = train_one_epoch("csv", data, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tfdp: data: 64 train / 40 val images, 10 classes" in result.stdout, result.stdout
    assert "tfdp: done: 1 epochs, validation top-1" in result.stdout


def test_every_bad_labels_file_is_one_line(tiny_dir, tmp_path):
    data = tmp_path / "data"
    csv_dataset(tiny_dir, data)
    train = list(csv.reader(open(data / "train.csv", encoding="utf-8-sig")))
    header, rows = train[0], train[1:]

    def refused(*fragments, header=header, rows=rows, raw=None, splits=None, write=True):
        if raw is not None:
            (data / "train.csv").write_bytes(raw)
        elif write:
            write_csv(data / "train.csv", header, rows)
        with pytest.raises(UserError) as error:
            build_source(DataConfig(format="csv", dir=str(data)), splits=splits)
        text = str(error.value)
        assert "\n" not in text and all(f in text for f in fragments), text

    where = f"{data}/train.csv"
    refused(f"{where}: its header (file_name,notes) must name one label column (label, class, category); it has none",
            header=("file_name", "notes"), rows=[(r[0], r[2]) for r in rows])
    refused("must name one label column (label, class, category); it has label and class",
            header=(*header, "class"), rows=[(*r, "x") for r in rows])
    refused(f"{where}, line 3: no label", rows=[rows[0], (rows[1][0], " ", "")] + rows[2:])
    refused(f"{where}, line 2: image '../escape.jpg' is not a path inside the data directory",
            rows=[("../escape.jpg", "digit_0", "")] + rows[1:])
    refused(f"{where}, line 2: image 's3://elsewhere/x.jpg' is not a path inside",
            rows=[("s3://elsewhere/x.jpg", "digit_0", "")] + rows[1:])
    refused(f"{where}, line 4: images/notes.txt is not an image TensorFlow decodes",
            rows=rows[:2] + [("images/notes.txt", "digit_0", "")] + rows[3:])
    refused(f"{where}, line 5: 1 field(s), where the header has 3", rows=rows[:3] + [(rows[3][0],)] + rows[4:])
    refused(f"{where}: 2 of its 66 images are not in {data} (first: images/gone.jpg, line 3)",
            rows=[rows[0], ("images/gone.jpg", "digit_1", ""), *rows[1:], ("nowhere/x.png", "digit_2", "")])
    refused(f"{where} lists no images", rows=[])
    refused(f"{where} is not UTF-8 text", raw=b"file_name,label\n\xff\xfe\x00bad,1\n")
    write_csv(data / "train.csv", header, rows)
    (data / "classes.txt").write_text("digit_0\ndigit_1\n")
    refused(f"{data}/classes.txt lacks 8 label(s) the csv files use (first: digit_2)")
    (data / "classes.txt").write_text("digit_0\ndigit_1\n")
    os.rename(data / "val.csv", data / "val.csv.kept")
    refused(f"{data}/classes.txt lacks 10 label(s) the csv files use (first: 0), which are neither its names nor "
            f"indices into its 2 lines", rows=[(r[0], r[1][-1], r[2]) for r in rows], splits=("train",))
    os.rename(data / "val.csv.kept", data / "val.csv")
    write_csv(data / "train.csv", header, rows)
    (data / "classes.txt").write_text("digit_0\ndigit_0\n")
    refused(f"{data}/classes.txt names digit_0 more than once")
    os.remove(data / "classes.txt")
    os.remove(data / "val.csv")
    refused(f"data.format csv: no val.csv (nor val.jsonl, val/metadata.csv or .jsonl) in {data}")
    assert build_source(DataConfig(format="csv", dir=str(data)), splits=("train",)).split("train").num_examples == 64

    # through the command line: the same line, exit 2, before TensorFlow loads
    result = run_tfdp("train", "--config=configs/digits.yaml", "--data_format=csv", f"--data_dir={data}",
                      f"--model_dir={tmp_path / 'run'}")
    assert_one_line_error(result, 2, f"data.format csv: no val.csv (nor val.jsonl, val/metadata.csv or .jsonl) in {data}")

    # a JSON Lines file's own faults
    os.remove(data / "train.csv")
    lines = [json.dumps({"file_name": image, "label": label}) for image, label, _ in rows]
    where = f"{data}/train.jsonl"

    def refused_jsonl(fragment, lines):
        (data / "train.jsonl").write_text("\n".join(lines) + "\n")
        refused(fragment, raw=None, splits=("train",), write=False)
    refused_jsonl(f"{where}, line 2: not JSON (", lines[:1] + ["{file_name: x}"] + lines[1:])
    refused_jsonl(f"{where}, line 1: not a JSON object (each line holds one image's fields)", ["[1, 2]"] + lines)
    refused_jsonl(f"{where}, line 3: its label must be a class name or number, not 2.5",
                  lines[:2] + [json.dumps({"file_name": rows[0][0], "label": 2.5})] + lines[2:])
    refused_jsonl(f"{where}, line 2: no label", lines[:1] + [json.dumps({"file_name": rows[0][0]})] + lines[1:])
    refused_jsonl(f"{where}: its first object's keys (file_name,class,label) must name one label key (label, class, "
                  f"category); it has label and class", [json.dumps({"file_name": rows[0][0], "class": 1, "label": 1})] + lines)
