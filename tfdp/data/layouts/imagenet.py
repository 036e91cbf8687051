"""The raw ILSVRC2012 JPEG tree, as image-net.org and Kaggle ship it.

Both layouts have `train/<wnid>/*.JPEG` and a flat `val/` folder; they differ
in where the validation labels are:

- image-net.org: `ILSVRC2012_validation_ground_truth.txt` (one ILSVRC2012_ID
  per validation image, in file-number order) plus the devkit's `meta.mat`,
  which maps those IDs to synset ids. The IDs are *not* in synset order, so
  the file cannot be used without the mapping.
- Kaggle (ImageNet Object Localization Challenge): `LOC_synset_mapping.txt`,
  `LOC_val_solution.csv` (first synset of each PredictionString), images
  under `ILSVRC/Data/CLS-LOC/`.

The layout is recognised by where `train/` is, never by a label file: users
copy `LOC_synset_mapping.txt` beside an image-net.org tree for its class
names, and it is used for class text in either layout.

Labels always index the sorted list of synset ids, so every layout (and the
TFRecord shards converted from it) gives the same image the same label.
"""

from __future__ import annotations

import csv
import io
import posixpath
import re

from tfdp.data.layouts import (Ignored, Source, Split, class_folder_split, folder_entries, is_image_file,
                               read_text)
from tfdp.data.storage import filesystem, url
from tfdp.errors import UserError

GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
DEVKIT_DIRS = ("", "ILSVRC2012_devkit_t12/data", "ILSVRC2012_devkit_t12", "devkit/data", "data")
KAGGLE_MAPPING = "LOC_synset_mapping.txt"
KAGGLE_IMAGES = "ILSVRC/Data/CLS-LOC"
VAL_NUMBER = re.compile(r"ILSVRC2012_val_(\d+)", re.IGNORECASE)


def imagenet_tree(root: str, split_names: tuple[str, ...]) -> Source:
    """Either raw layout, recognised by its folders (a label file alone may have been copied beside the other)."""
    fs, path = filesystem(root)
    if not fs.isdir(path):
        raise UserError(f"data directory not found: {root}")
    kind = layout(fs, path)
    if kind == "kaggle":
        return kaggle_tree(root, split_names)
    if kind == "ilsvrc":
        return ilsvrc_tree(root, split_names)
    raise UserError(f"no ImageNet tree in {root}: looked for train/<synset>/ (image-net.org layout, with {GROUND_TRUTH} "
                    f"and meta.mat, or val/<synset>/) and {KAGGLE_IMAGES}/train/<synset>/ (Kaggle layout, with "
                    f"{KAGGLE_MAPPING} and LOC_val_solution.csv)")


def layout(fs, root: str) -> str | None:
    """"kaggle" or "ilsvrc" by where the train/ folder is, else None.

    Folders, not label files, decide: users copy `LOC_synset_mapping.txt`
    beside an image-net.org tree for its class names.
    """
    if fs.isdir(posixpath.join(root, KAGGLE_IMAGES, "train")):
        return "kaggle"
    if fs.isdir(posixpath.join(root, "train")):
        return "ilsvrc"
    return None


def ilsvrc_tree(root: str, split_names: tuple[str, ...]) -> Source:
    fs, path = filesystem(root)
    synsets = _train_synsets(fs, posixpath.join(path, "train"))
    devkit = _find_devkit(fs, path)
    text = {**(dict(zip(*_meta_synsets(fs, devkit)[1:])) if devkit else {}), **_mapping_text(fs, path)}
    splits = {}
    for name in split_names:
        if _is_train(name):
            splits[name] = class_folder_split(fs, name, posixpath.join(path, "train"), synsets)
        elif _has_subfolders(fs, posixpath.join(path, "val")):  # already sorted into val/<wnid>/
            splits[name] = class_folder_split(fs, name, posixpath.join(path, "val"), synsets)
        else:
            if devkit is None:
                raise UserError(f"no validation labels in {root}: expected {GROUND_TRUTH} and the devkit's meta.mat "
                                f"(in {root} or {root}/ILSVRC2012_devkit_t12/data), or val/ sorted into "
                                f"val/<synset>/ folders")
            splits[name] = _ground_truth_val(fs, name, posixpath.join(path, "val"), devkit, synsets)
    return Source(class_names=synsets, splits=splits, class_text=tuple(text.get(s, s) for s in synsets))


def kaggle_tree(root: str, split_names: tuple[str, ...]) -> Source:
    fs, path = filesystem(root)
    names = _mapping_text(fs, path)
    images = posixpath.join(path, KAGGLE_IMAGES)
    synsets = _train_synsets(fs, posixpath.join(images, "train"))
    unnamed = [s for s in synsets if s not in names]
    if names and unnamed:
        raise UserError(f"{KAGGLE_MAPPING} does not list the synset folder(s) {', '.join(unnamed[:3])}")
    splits = {}
    for name in split_names:
        if _is_train(name):
            splits[name] = class_folder_split(fs, name, posixpath.join(images, "train"), synsets)
        else:
            solution = read_kaggle_solution(fs, posixpath.join(path, "LOC_val_solution.csv"))
            labels = {image_id: boxes[0][0] for image_id, boxes in solution.items() if boxes}
            splits[name] = _labelled_flat_folder(fs, name, posixpath.join(images, "val"), synsets,
                                                 lambda stem: labels.get(stem), "LOC_val_solution.csv")
    return Source(class_names=synsets, splits=splits, class_text=tuple(names.get(s, s) for s in synsets))


def _mapping_text(fs, root: str) -> dict[str, str]:
    """Synset → class text from `LOC_synset_mapping.txt` in `root`, in either layout; empty without one."""
    path = posixpath.join(root, KAGGLE_MAPPING)
    if not fs.exists(path):
        return {}
    rows = (line.split(None, 1) for line in read_text(fs, path).splitlines() if line.strip())
    return {row[0]: (row[1].strip() if len(row) > 1 else row[0]) for row in rows}


def read_kaggle_solution(fs, path: str) -> dict[str, list[tuple[str, float, float, float, float]]]:
    """ImageId → [(synset, xmin, ymin, xmax, ymax) in pixels] from a LOC_*_solution.csv file."""
    rows = csv.DictReader(io.StringIO(read_text(fs, path)))
    if rows.fieldnames is None or not {"ImageId", "PredictionString"} <= set(rows.fieldnames):
        raise UserError(f"{path}: expected the columns ImageId,PredictionString")
    out = {}
    for row in rows:
        fields = row["PredictionString"].split()
        if len(fields) % 5:
            raise UserError(f"{path}: malformed PredictionString for {row['ImageId']}")
        out[row["ImageId"]] = [(fields[i], *map(float, fields[i + 1:i + 5])) for i in range(0, len(fields), 5)]
    return out


def _is_train(split_name: str) -> bool:
    return split_name.startswith("train")


def _has_subfolders(fs, folder: str) -> bool:
    return fs.isdir(folder) and any(e["type"] == "directory" for e in fs.ls(folder, detail=True))


def _train_synsets(fs, train_dir: str) -> tuple[str, ...]:
    if not fs.isdir(train_dir):
        raise UserError(f"no train/ folder in {posixpath.dirname(train_dir)} (expected train/<synset>/*.JPEG)")
    synsets = tuple(sorted(posixpath.basename(e["name"].rstrip("/")) for e in fs.ls(train_dir, detail=True)
                           if e["type"] == "directory"))
    if not synsets:
        raise UserError(f"no synset folders in {train_dir}")
    return synsets


def _labelled_flat_folder(fs, name: str, folder: str, synsets: tuple[str, ...], synset_of, label_file: str) -> Split:
    """A flat folder of images whose synsets come from a label file, keyed by file stem."""
    if not fs.isdir(folder):
        raise UserError(f"validation folder not found: {url(fs, folder)}")
    index = {s: i for i, s in enumerate(synsets)}
    files, labels = [], []
    ignored = Ignored()
    for path, is_dir in folder_entries(fs, folder):
        if is_dir or not is_image_file(path):
            ignored.add(path, is_dir)
            continue
        stem = posixpath.splitext(posixpath.basename(path))[0]
        synset = synset_of(stem)
        if synset is None:
            raise UserError(f"{label_file} has no label for {posixpath.basename(path)}")
        if synset not in index:
            raise UserError(f"{label_file} labels {posixpath.basename(path)} as {synset}, which is not a training class")
        files.append(path)
        labels.append(index[synset])
    if not files:
        raise UserError(f"no images in {url(fs, folder)}")
    ignored.report(f"split '{name}' in {url(fs, folder)}")
    return Split(name=name, files=tuple(files), labels=tuple(labels))


def _find_devkit(fs, root: str) -> str | None:
    for sub in DEVKIT_DIRS:
        folder = posixpath.join(root, sub) if sub else root
        if fs.exists(posixpath.join(folder, GROUND_TRUTH)):
            return folder
    return None


def _meta_synsets(fs, devkit: str) -> tuple[dict[int, str], tuple[str, ...], tuple[str, ...]]:
    """(ILSVRC2012_ID → synset, synsets, words) for the 1,000 leaf classes in the devkit's meta.mat."""
    import scipy.io  # the devkit's metadata is a MATLAB file

    path = posixpath.join(devkit, "meta.mat")
    if not fs.exists(path):
        raise UserError(f"{GROUND_TRUTH} needs the devkit's meta.mat beside it (not found: {url(fs, path)})")
    try:
        with fs.open(path, "rb") as f:
            meta = scipy.io.loadmat(io.BytesIO(f.read()), squeeze_me=True)["synsets"]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read {url(fs, path)}: {e}") from None
    leaves = [m for m in meta if int(m["num_children"]) == 0]
    ids = {int(m["ILSVRC2012_ID"]): str(m["WNID"]) for m in leaves}
    return ids, tuple(str(m["WNID"]) for m in leaves), tuple(str(m["words"]) for m in leaves)


def _ground_truth_val(fs, name: str, val_dir: str, devkit: str, synsets: tuple[str, ...]) -> Split:
    ids, _, _ = _meta_synsets(fs, devkit)
    lines = read_text(fs, posixpath.join(devkit, GROUND_TRUTH)).split()
    try:
        truth = [ids[int(line)] for line in lines]
    except (ValueError, KeyError) as e:
        raise UserError(f"{GROUND_TRUTH}: {e} is not an ILSVRC2012_ID in meta.mat") from None

    def synset_of(stem: str) -> str | None:
        match = VAL_NUMBER.fullmatch(stem)
        number = int(match.group(1)) if match else 0
        return truth[number - 1] if 0 < number <= len(truth) else None

    return _labelled_flat_folder(fs, name, val_dir, synsets, synset_of, GROUND_TRUTH)
