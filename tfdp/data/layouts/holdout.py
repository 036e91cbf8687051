"""`data.val_fraction`: one tree of class folders (`DIR/<class>/<image>`, local or in a bucket), split into training
and validation images, as Keras' `image_dataset_from_directory(validation_split=...)`, torchvision's `ImageFolder`
with a random split and Hugging Face's `imagefolder` take a single tree.

Each image's split is decided by itself alone: a hash of `data.val_seed` and its path relative to the tree
(`<class>/<file>`, the same for a local copy and a bucket's) gives it a number in [0, 1), and numbers below
`data.val_fraction` are validation. Not by position in a listing: an image added to the tree takes its own place and
moves no other, so a run that resumes after images were added validates on the images it validated on before, and
none of them is trained on. Per class, the share is data.val_fraction up to chance (the hashes are uniform); a class
whose hashes put none of its images in validation (a small class, a small fraction) gives its lowest-numbered image
to it, and one they put all in validation keeps its highest-numbered one for training, so every class is in both
splits. A class of one image cannot be: one line says so.

The seed is `data.val_seed`, not `train.seed`: runs that differ in their training seed validate on the same images,
and their accuracies compare.
"""

from __future__ import annotations

import hashlib
import posixpath

from tfdp.data.layouts import Source, Split, class_folder_split
from tfdp.data.storage import filesystem, url
from tfdp.errors import UserError
from tfdp.startup.console import say


def held_out(root: str, names: tuple[str, ...], train_split: str, val_split: str, fraction: float,
             seed: int) -> Source:
    """The class-folder tree at `root` (or at `root/<train_split>` where only that split folder is there) as the
    splits `train_split` and `val_split` (those of them in `names`), `fraction` of each class's images held out for
    validation."""
    if not 0 < fraction < 1:
        raise UserError(f"data.val_fraction must be between 0 and 1 (0: off), got {fraction}")
    fs, path = filesystem(root)
    if not fs.isdir(path):
        raise UserError(f"data directory not found: {url(fs, path)}")
    tree = tree_root(fs, path, train_split, val_split)
    classes = tuple(sorted(posixpath.basename(e["name"].rstrip("/"))
                           for e in fs.ls(tree, detail=True) if e["type"] == "directory"))
    if not classes:
        raise UserError(f"no class folders in {url(fs, tree)} (data.val_fraction splits DIR/<class>/<image>)")
    listed = class_folder_split(fs, train_split, tree, classes)
    train, val = partition(listed, url(fs, tree).rstrip("/") + "/", classes, fraction, seed, url(fs, tree))
    say(f"tfdp: data: data.val_fraction {fraction:g} of {url(fs, tree)}: {len(train):,} training and {len(val):,} "
        f"validation images ({len(classes)} classes, data.val_seed {seed})")
    splits = {train_split: as_split(train_split, train), val_split: as_split(val_split, val)}
    return Source(class_names=classes, splits={n: s for n, s in splits.items() if n in names})


def tree_root(fs, path: str, train_split: str, val_split: str) -> str:
    """The class-folder tree to split: `path`, or `path/<train_split>` where `path` holds that split folder alone.
    Both split folders there: the data is split already, and one line says so."""
    has_train = fs.isdir(posixpath.join(path, train_split))
    if has_train and fs.isdir(posixpath.join(path, val_split)):
        raise UserError(f"data.val_fraction splits one tree of class folders, but {url(fs, path)} has both "
                        f"'{train_split}' and '{val_split}' split folders: set data.val_fraction: 0 to use them, or "
                        f"point data.dir at one tree")
    return posixpath.join(path, train_split) if has_train else path


def share(seed: int, relative: str) -> float:
    """A file's number in [0, 1): the first 8 bytes of SHA-256 of the seed and its path relative to the tree."""
    digest = hashlib.sha256(f"{seed}/{relative}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def partition(listed: Split, prefix: str, classes: tuple[str, ...], fraction: float, seed: int,
              where: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(training, validation) (path, label) pairs of `listed`, class by class, each in the listing's order (see the
    module's docstring); `prefix`: the tree's path, cut from each file's to hash it."""
    by_class: dict[int, list[tuple[float, int, str]]] = {}
    for place, (path, label) in enumerate(zip(listed.files, listed.labels)):
        by_class.setdefault(label, []).append((share(seed, path.removeprefix(prefix)), place, path))
    train, val = [], []
    for label, cls in enumerate(classes):
        ranked = sorted(by_class.get(label, []))
        if len(ranked) < 2:
            raise UserError(f"data.val_fraction: class {cls} in {where} has {len(ranked)} image(s); a class needs 2 "
                            f"or more to be in both training and validation")
        held = min(max(sum(number < fraction for number, _, _ in ranked), 1), len(ranked) - 1)
        val += [(place, path, label) for _, place, path in ranked[:held]]
        train += [(place, path, label) for _, place, path in ranked[held:]]
    return [(path, label) for _, path, label in sorted(train)], [(path, label) for _, path, label in sorted(val)]


def as_split(name: str, pairs: list[tuple[str, int]]) -> Split:
    return Split(name=name, files=tuple(path for path, _ in pairs), labels=tuple(label for _, label in pairs))
