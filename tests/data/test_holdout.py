"""`data.val_fraction`: one tree of class folders of real JPEGs (the digits), local and in a bucket (a real GCS
emulator on loopback), split per image by a seeded hash of its path."""

from __future__ import annotations

import os
import posixpath
import shutil

import pytest

from tfdp.config import DataConfig, validate
from tfdp.data import build_source
from tfdp.errors import UserError


def one_tree(digits_dir: str, root, per_class: int | None = None) -> str:
    """The digits' training images, `per_class` of each class (all: None), as DIR/<class>/<image>."""
    for cls in sorted(os.listdir(os.path.join(digits_dir, "train"))):
        os.makedirs(root / cls)
        for f in sorted(os.listdir(os.path.join(digits_dir, "train", cls)))[:per_class]:
            shutil.copy(os.path.join(digits_dir, "train", cls, f), root / cls / f)
    return str(root)


def held(tree: str, fraction: float = 0.2, seed: int = 0, splits=None):
    cfg = DataConfig(format="image_folder", dir=tree, val_fraction=fraction, val_seed=seed)
    source = build_source(cfg, splits)
    return source, {name: dict(zip(s.files, s.labels)) for name, s in source.splits.items()}


def relative(files, tree: str) -> set[str]:
    return {f.removeprefix(tree.rstrip("/") + "/") for f in files}


def test_one_tree_is_split_per_class_and_says_how(digits_dir, tmp_path, capsys):
    tree = one_tree(digits_dir, tmp_path / "tree")
    source, splits = held(tree)
    train, val = splits["train"], splits["val"]
    every = {os.path.join(tree, c, f): int(c) for c in os.listdir(tree) for f in os.listdir(os.path.join(tree, c))}
    assert source.class_names == tuple(str(i) for i in range(10))
    assert not set(train) & set(val) and {**train, **val} == every   # every image once, with its own class's label
    for label in range(10):
        n_val = sum(v == label for v in val.values())
        n_all = sum(v == label for v in every.values())
        # ~144 images a class: 0.2 of them by uniform hashes, within 4 binomial deviations (fixed files: no flake)
        assert 0.2 * n_all - 20 < n_val < 0.2 * n_all + 20, (label, n_val, n_all)
    line = [x for x in capsys.readouterr().out.splitlines() if "data.val_fraction" in x]
    assert line == [f"tfdp: data: data.val_fraction 0.2 of {tree}: {len(train):,} training and {len(val):,} "
                    f"validation images (10 classes, data.val_seed 0)"]
    # evaluation lists the validation split alone, and the same one
    assert held(tree, splits=("val",))[1] == {"val": val}


def test_images_added_move_none_and_the_seed_is_the_split(digits_dir, tmp_path):
    tree = one_tree(digits_dir, tmp_path / "tree", per_class=20)
    before = held(tree)[1]
    for cls in os.listdir(tree):   # more images in every class, under new names
        for f in sorted(os.listdir(os.path.join(tree, cls)))[:10]:
            shutil.copy(os.path.join(tree, cls, f), os.path.join(tree, cls, "new-" + f))
    after = held(tree)[1]
    assert set(before["val"]) <= set(after["val"]) and set(before["train"]) <= set(after["train"])
    assert len(after["val"]) > len(before["val"])
    other = held(tree, seed=1)[1]
    assert set(other["val"]) != set(after["val"]) and held(tree, seed=1)[1] == other


def test_a_lone_train_folder_is_the_tree_and_split_folders_are_refused(digits_dir, tmp_path):
    tree = one_tree(digits_dir, tmp_path / "data" / "train", per_class=10)
    _, splits = held(str(tmp_path / "data"))
    assert {**splits["train"], **splits["val"]} == {**held(tree)[1]["train"], **held(tree)[1]["val"]}
    os.makedirs(tmp_path / "data" / "val" / "0")
    with pytest.raises(UserError, match=r"^data.val_fraction splits one tree of class folders, but .* has both "
                                        r"'train' and 'val' split folders: set data.val_fraction: 0 to use them"):
        held(str(tmp_path / "data"))


def test_a_class_too_small_for_both_splits_is_one_line(digits_dir, tmp_path):
    tree = one_tree(digits_dir, tmp_path / "tree", per_class=2)
    _, splits = held(tree, fraction=0.01)   # no hash below 0.01: each class still gives one image to validation
    assert sorted(splits["val"].values()) == list(range(10)) and sorted(splits["train"].values()) == list(range(10))
    _, splits = held(tree, fraction=0.99)   # all below: each class still keeps one for training
    assert sorted(splits["train"].values()) == list(range(10))
    for f in os.listdir(os.path.join(tree, "3"))[1:]:
        os.remove(os.path.join(tree, "3", f))
    with pytest.raises(UserError, match=r"^data.val_fraction: class 3 in .* has 1 image\(s\); a class needs 2 or "
                                        r"more to be in both training and validation$"):
        held(tree)


@pytest.mark.parametrize("data, message", [
    ({"format": "image_folder", "val_fraction": 1.0}, "config field 'data.val_fraction': input should be less than 1"),
    ({"format": "image_folder", "val_fraction": -0.2},
     "config field 'data.val_fraction': input should be greater than or equal to 0"),
    ({"format": "tfrecord", "val_fraction": 0.2},
     "data.val_fraction splits one tree of class folders (data.format image_folder), not data.format tfrecord's"),
])
def test_a_fraction_outside_0_1_or_for_another_layout_is_one_line(data, message):
    with pytest.raises(UserError) as e:
        validate({"data": data})
    assert str(e.value).startswith(message)


def test_a_tree_in_a_bucket_splits_as_its_local_copy(digits_dir, tmp_path, gcs_bucket):
    import fsspec

    tree = one_tree(digits_dir, tmp_path / "tree", per_class=12)
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    fs.put(tree, posixpath.join(gcs_bucket.removeprefix("gs://"), "flowers"), recursive=True)
    remote = f"{gcs_bucket}/flowers"
    _, there = held(remote)
    _, here = held(tree)
    assert all(f.startswith(remote + "/") for f in there["train"])
    for split in ("train", "val"):
        assert relative(there[split], remote) == relative(here[split], tree)
