"""Data faults on real files: a shard cut short, an ImageNet tree with a label file of the other layout.

Every fault case checks the exit code, that no traceback reaches the user,
that the cause is named in one line, and what tfdp keeps.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from conftest import REPO, last_line, run_tfdp
from test_imagenet_data import listed_pairs, truth_labels
from pipelines.convert_imagenet import Item, Prepared, image_example
from support.photos import SYNSETS, write_imagenet_tree
from tfdp.config import DataConfig
from tfdp.data import build_source
from tfdp.errors import UserError

CLASSES = 3
PER_SHARD = {"train": 12, "validation": 6}
CUT = ("train-00001-of-00002", "validation-00001-of-00002")


def tiny_jpeg(i: int) -> bytes:
    """A 16x16 JPEG whose colour depends on its class, so a tiny model can learn something."""
    pixels = np.zeros((16, 16, 3), np.uint8)
    pixels[..., i % CLASSES] = 200
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


def write_shards(folder: str, corrupt: tuple[str, int] | None = None) -> dict[str, int]:
    """2 train and 2 validation shards with their full counts in counts.json; returns the counts."""
    os.makedirs(folder, exist_ok=True)
    counts = {}
    for prefix, n in PER_SHARD.items():
        for s in range(2):
            name = f"{prefix}-{s:05d}-of-00002"
            with tf.io.TFRecordWriter(os.path.join(folder, name)) as writer:
                for i in range(n):
                    data = b"not an image" if corrupt == (name, i) else tiny_jpeg(i)
                    item = Item(f"{name}-{i}.JPEG", i % CLASSES, SYNSETS[i % CLASSES][0], SYNSETS[i % CLASSES][1])
                    writer.write(image_example(item, Prepared(data, 16, 16, (16, 16))).SerializeToString())
            counts[name] = n
    with open(os.path.join(folder, "counts.json"), "w") as f:
        json.dump({"shards": counts}, f)
    with open(os.path.join(folder, "synsets.txt"), "w") as f:
        f.writelines(f"{s}\t{t}\n" for s, t in SYNSETS[:CLASSES])
    return counts


def cut_short(path: str) -> None:
    """What an interrupted copy leaves: the first part of the file, ending inside a record."""
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2 + 7])


def readable_by_tensorflow(path: str) -> int:
    """Records TensorFlow's own reader gets out of a file before it hits the cut."""
    return len(list(tf.data.TFRecordDataset(path).ignore_errors()))


@pytest.fixture(scope="module")
def shard_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    write_shards(str(root / "cut"))
    for name in CUT:
        cut_short(str(root / "cut" / name))
    write_shards(str(root / "intact"), corrupt=("validation-00000-of-00002", 2))
    return {"cut": str(root / "cut"), "intact": str(root / "intact")}


def no_traceback(result) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]


# --- (A) a TFRecord shard cut short ------------------------------------------

def test_listing_finds_a_cut_short_shard_from_its_framing(shard_dirs):
    """The readable count from the length headers is exactly what TensorFlow's reader gets; the rest is lost."""
    source = build_source(DataConfig(format="tfrecord", dir=shard_dirs["cut"]))
    for split, prefix in (("train", "train"), ("val", "validation")):
        data = source.split(split)
        readable = readable_by_tensorflow(os.path.join(shard_dirs["cut"], f"{prefix}-00001-of-00002"))
        assert 0 < readable < PER_SHARD[prefix]
        assert data.counts == (PER_SHARD[prefix], readable)
        assert data.lost == (0, PER_SHARD[prefix] - readable)
        assert data.num_examples == PER_SHARD[prefix] + readable   # epochs are sized by what can be read
        assert f"{prefix}-00001-of-00002 is cut short ({PER_SHARD[prefix] - readable} of its " \
               f"{PER_SHARD[prefix]} records lost)" in data.damage()
        assert f"{prefix}-00000" not in data.damage()
    intact = build_source(DataConfig(format="tfrecord", dir=shard_dirs["intact"])).split("train")
    assert intact.lost == () and intact.damage() == ""


@pytest.mark.parametrize("damage, file, message", [
    ("{\"shards\": {\"train-00000-of-00002\": 12, \"train-0", "counts.json",
     "counts.json is not the converter's counts (not JSON: Unterminated string"),
    ("{\"shards\": {\"train-00000-of-00002\": \"12\"}}", "counts.json",
     "counts.json is not the converter's counts (its \"shards\" are not shard names with their record counts)"),
    (b"\xff\xd8\xff\xe0 a JPEG saved over it", "synsets.txt", "synsets.txt is not UTF-8 text: a damaged or foreign file"),
])
def test_a_damaged_summary_beside_the_shards_is_one_line_naming_it(shard_dirs, tmp_path, damage, file, message):
    """counts.json and synsets.txt are the converter's; one cut short by a copy, edited, or overwritten is named
    when the split is listed (trusting a wrong count would drop or invent records). Without counts.json the
    records are counted from the shards themselves, as for shards from other tools."""
    root = tmp_path / "shards"
    shutil.copytree(shard_dirs["intact"], root)
    (root / file).write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    with pytest.raises(UserError) as error:
        build_source(DataConfig(format="tfrecord", dir=str(root)))
    assert str(error.value).startswith(f"{root / file} ") and message in str(error.value), error.value
    assert "\n" not in str(error.value)
    os.remove(root / "counts.json")
    (root / "synsets.txt").write_text("".join(f"{s}\t{t}\n" for s, t in SYNSETS[:CLASSES]))
    assert build_source(DataConfig(format="tfrecord", dir=str(root))).split("train").counts == (12, 12)


COMMON = ["--config=configs/digits.yaml", "--model=simple_cnn", "--data_format=tfrecord",
          "--set=model.num_classes=3", "--batch_size_per_replica=4", "--set=data.image_size=16",
          "--set=schedule.warmup_epochs=0"]


def test_cut_short_shards_in_training_and_evaluation(shard_dirs, tmp_path):
    """Training names the shards and counts the loss against data.max_bad_fraction; evaluation refuses a shortfall."""
    cut, intact = shard_dirs["cut"], shard_dirs["intact"]
    lost = {p: PER_SHARD[p] - readable_by_tensorflow(os.path.join(cut, f"{p}-00001-of-00002")) for p in PER_SHARD}
    model_dir = str(tmp_path / "run")

    # Within the bound: trains on every readable record, warns naming each shard, counts the loss in the summary.
    ok = run_tfdp("train", *COMMON, f"--data_dir={cut}", f"--model_dir={model_dir}", "--epochs=1",
                  "--set=data.max_bad_fraction=0.5", timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    no_traceback(ok)
    for prefix, split in (("train", "train"), ("validation", "val")):
        warning = [line for line in ok.stderr.splitlines() if line.startswith(f"tfdp: warning: split '{split}': ")]
        assert len(warning) == 1, ok.stderr[-3000:]
        assert f"{prefix}-00001-of-00002 is cut short ({lost[prefix]} of its {PER_SHARD[prefix]} records lost)" \
            in warning[0]
    summary = last_line(ok.stdout)
    assert summary.startswith("tfdp: done: 1 epochs")
    assert (f"; {lost['train'] + lost['validation']} record(s) lost from cut-short shard(s) "
            f"train-00001-of-00002, validation-00001-of-00002") in summary
    assert os.path.exists(os.path.join(model_dir, "metrics.jsonl"))

    # Beyond the bound: nothing is trained; one line names the shard and the count.
    strict = run_tfdp("train", *COMMON, f"--data_dir={cut}", f"--model_dir={tmp_path / 'strict'}", "--epochs=1",
                      "--set=data.max_bad_fraction=0.01", timeout=300)
    assert strict.returncode == 2
    no_traceback(strict)
    assert last_line(strict.stderr).startswith("tfdp: error: split 'train': ")
    assert (f"train-00001-of-00002 is cut short ({lost['train']} of its 12 records lost); {lost['train']} of 24 "
            f"records lost is more than data.max_bad_fraction (0.01)") in last_line(strict.stderr)
    assert not os.path.exists(tmp_path / "strict" / "metrics.jsonl")

    # Evaluation never claims images it did not evaluate: a shortfall is an error naming shard and number ...
    short = run_tfdp("evaluate", *COMMON, f"--data_dir={cut}", f"--model_dir={model_dir}", timeout=300)
    assert short.returncode == 2
    no_traceback(short)
    assert last_line(short.stderr) == (
        f"tfdp: error: cannot evaluate split 'val': {cut}/validation-00001-of-00002 is cut short "
        f"({lost['validation']} of its 6 records lost); {lost['validation']} of its 12 listed images are missing "
        f"(copy the file again)")
    assert "over" not in short.stdout

    # ... and the count printed is the number the metrics cover: 11 of 12, one image being undecodable.
    whole = run_tfdp("evaluate", *COMMON, f"--data_dir={intact}", f"--model_dir={model_dir}", timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    no_traceback(whole)
    assert last_line(whole.stdout).startswith("tfdp: evaluate: ")
    assert last_line(whole.stdout).endswith(" over 11 images (1 of the 12 listed could not be decoded)")


# --- (B) ImageNet layouts recognised by their folders -------------------------

def copy_mapping(kaggle: str, tree: str) -> None:
    """What users do for the class names: LOC_synset_mapping.txt beside train/ and val/."""
    shutil.copy(os.path.join(kaggle, "LOC_synset_mapping.txt"), tree)


def sort_val(tree: str, truth: dict) -> None:
    """val/ sorted into val/<synset>/ (as many scripts do), and no devkit: labels come from the folders."""
    for name, synset in truth["val"].items():
        os.makedirs(os.path.join(tree, "val", synset), exist_ok=True)
        os.replace(os.path.join(tree, "val", name), os.path.join(tree, "val", synset, name))
    shutil.rmtree(os.path.join(tree, "ILSVRC2012_devkit_t12"))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    small = dict(num_classes=CLASSES, train_per_class=2, val_per_class=2, size=(64, 48))
    trees = {name: str(root / name) for name in ("classic", "classic+mapping", "sorted", "sorted+mapping", "kaggle")}
    truth = write_imagenet_tree(trees["kaggle"], layout="kaggle", **small)
    for name in ("classic", "classic+mapping", "sorted", "sorted+mapping"):
        assert write_imagenet_tree(trees[name], layout="ilsvrc", **small) == truth
        if "mapping" in name:
            copy_mapping(trees["kaggle"], trees[name])
        if name.startswith("sorted"):
            sort_val(trees[name], truth)
    return trees, truth


def test_each_layout_labels_every_image_as_it_says(layouts):
    trees, truth = layouts
    for name, tree in trees.items():
        source = build_source(DataConfig(format="imagenet", dir=tree))
        assert source.class_names == tuple(s for s, _ in SYNSETS[:CLASSES]), name
        for split in ("train", "val"):
            assert listed_pairs(source, split) == truth_labels(truth, split), (name, split)
        # Class text from the devkit or the mapping file; only a sorted tree without either falls back to ids.
        expected_text = SYNSETS[0][0] if name == "sorted" else "tench, Tinca tinca"
        assert source.class_text[0] == expected_text, name


def test_classic_tree_with_the_mapping_file_converts(layouts, tmp_path):
    """The converter's command line on the tree that failed with 'no train/ folder in .../ILSVRC/Data/CLS-LOC'."""
    trees, truth = layouts
    out = str(tmp_path / "out")
    result = run_tfdp_module("pipelines.convert_imagenet", f"--src={trees['classic+mapping']}", f"--out={out}",
                             "--train_shards=1", "--val_shards=1", "--workers=1")
    assert result.returncode == 0, result.stderr[-3000:]
    no_traceback(result)
    assert last_line(result.stdout).startswith(f"convert_imagenet: {len(truth['train'])} train and "
                                               f"{len(truth['val'])} validation images in {out}")
    source = build_source(DataConfig(format="tfrecord", dir=out))
    for split, prefix in (("train", "train"), ("val", "validation")):
        pairs = {}
        for record in tf.data.TFRecordDataset(source.split(split).files):
            feature = tf.train.Example.FromString(record.numpy()).features.feature
            pairs[feature["image/filename"].bytes_list.value[0].decode()] = (
                feature["image/class/label"].int64_list.value[0] - 1)
            assert feature["image/object/bbox/xmin"].float_list.value == []  # no Kaggle boxes for this tree
        assert pairs == truth_labels(truth, split), prefix
    with open(os.path.join(out, "synsets.txt")) as f:
        assert f.readline() == f"{SYNSETS[0][0]}\ttench, Tinca tinca\n"


def test_a_tree_of_no_layout_says_what_was_looked_for(layouts, tmp_path):
    trees, _ = layouts
    odd = tmp_path / "odd"
    shutil.copytree(os.path.join(trees["classic"], "val"), odd / "images")
    copy_mapping(trees["kaggle"], str(odd))
    with pytest.raises(UserError) as error:
        build_source(DataConfig(format="imagenet", dir=str(odd)))
    message = str(error.value)
    assert "\n" not in message
    assert message == (f"no ImageNet tree in {odd}: looked for train/<synset>/ (image-net.org layout, with "
                       "ILSVRC2012_validation_ground_truth.txt and meta.mat, or val/<synset>/) and "
                       "ILSVRC/Data/CLS-LOC/train/<synset>/ (Kaggle layout, with LOC_synset_mapping.txt and "
                       "LOC_val_solution.csv)")
    result = run_tfdp_module("pipelines.convert_imagenet", f"--src={odd}", f"--out={tmp_path / 'out'}")
    assert result.returncode == 2
    no_traceback(result)
    assert last_line(result.stderr) == f"convert_imagenet: error: {message}"
    assert not os.path.exists(tmp_path / "out")


def run_tfdp_module(module: str, *args: str):
    """Runs one of the project's command-line modules (python -m ...) in a fresh process."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=dict(os.environ))
