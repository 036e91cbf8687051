"""Dataset sources: where the examples of each split live, as a list of files.

A source only lists; it reads no pixels. `tfdp.data.pipeline` turns a `Split`
into a tf.data pipeline. Each layout is one builder in `tfdp.data.SOURCES`.
"""

from __future__ import annotations

import dataclasses
import posixpath

import fsspec

from tfdp.errors import UserError

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a dataset: one encoded image per file, with its 0-based label."""
    name: str
    files: tuple[str, ...]
    labels: tuple[int, ...]

    @property
    def num_examples(self) -> int:
        return len(self.files)


@dataclasses.dataclass(frozen=True)
class Source:
    class_names: tuple[str, ...]
    splits: dict[str, Split]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise UserError(f"dataset has no split '{name}' (it has: {', '.join(sorted(self.splits))})")
        return self.splits[name]


def image_folder(root: str, split_names: tuple[str, ...]) -> Source:
    """`root/<split>/<class>/<image>`: labels are the class folders in sorted order.

    Both splits must list the same classes, or a label would mean different
    things in training and validation.
    """
    fs, root = fsspec.core.url_to_fs(root)
    if not fs.isdir(root):
        raise UserError(f"data directory not found: {root}")
    splits: dict[str, Split] = {}
    class_names: tuple[str, ...] | None = None
    for name in split_names:
        split_dir = posixpath.join(root, name)
        if not fs.isdir(split_dir):
            raise UserError(f"data directory {root} has no '{name}' split folder")
        classes = tuple(sorted(posixpath.basename(e["name"].rstrip("/"))
                               for e in fs.ls(split_dir, detail=True) if e["type"] == "directory"))
        if not classes:
            raise UserError(f"no class folders in {split_dir}")
        if class_names is not None and classes != class_names:
            raise UserError(f"split '{name}' has different class folders than '{split_names[0]}' in {root}")
        class_names = classes
        splits[name] = _list_split(fs, name, split_dir, classes)
    return Source(class_names=class_names or (), splits=splits)


def _list_split(fs: fsspec.AbstractFileSystem, name: str, split_dir: str, classes: tuple[str, ...]) -> Split:
    files: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        for path in sorted(fs.ls(posixpath.join(split_dir, cls), detail=False)):
            if path.lower().endswith(IMAGE_EXTENSIONS):
                files.append(path)
                labels.append(label)
    if not files:
        raise UserError(f"no images (*.JPEG, *.jpg, *.png) under {split_dir}")
    return Split(name=name, files=tuple(files), labels=tuple(labels))
