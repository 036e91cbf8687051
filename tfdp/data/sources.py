"""Dataset sources: where the examples of each split live, as a list of files.

A source only lists (local paths or bucket URLs); it reads no pixels. `tfdp.data.pipeline` turns a `Split`
into a tf.data pipeline. Each layout is one builder in `tfdp.data.SOURCES`.
"""

from __future__ import annotations

import dataclasses
import posixpath

import fsspec

from tfdp.data.storage import filesystem, url
from tfdp.errors import UserError

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """Where the encoded image and the label sit in a serialized tf.train.Example."""
    image_key: str
    label_key: str
    label_offset: int = 0   # added to the stored label: -1 for ImageNet's 1-based shards


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a dataset, as files.

    Either each file is one encoded image (`labels` gives its 0-based label),
    or each file holds serialized examples (`records` says how to read them,
    `counts` how many each file has; counts size the epochs and let every
    evaluation pipeline run the same number of steps).
    """
    name: str
    files: tuple[str, ...]
    labels: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    records: RecordFormat | None = None
    synthetic: int = 0      # examples generated on the fly; no files

    @property
    def num_examples(self) -> int:
        if self.synthetic:
            return self.synthetic
        return sum(self.counts) if self.records else len(self.files)

    def file_counts(self) -> tuple[int, ...]:
        return self.counts if self.records else (1,) * len(self.files)

    def subset(self, indices) -> "Split":
        """The same split restricted to the files at `indices` (one input pipeline's share)."""
        pick = lambda values: tuple(values[i] for i in indices) if values else ()  # noqa: E731
        return dataclasses.replace(self, files=pick(self.files), labels=pick(self.labels),
                                   counts=pick(self.counts))


@dataclasses.dataclass(frozen=True)
class Source:
    """A dataset: class ids in label order (synset ids for ImageNet), readable names, splits."""
    class_names: tuple[str, ...]
    splits: dict[str, Split]
    class_text: tuple[str, ...] = ()

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
    fs, root = filesystem(root)
    if not fs.isdir(root):
        raise UserError(f"data directory not found: {url(fs, root)}")
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
        splits[name] = class_folder_split(fs, name, split_dir, classes)
    return Source(class_names=class_names or (), splits=splits)


def class_folder_split(fs: fsspec.AbstractFileSystem, name: str, split_dir: str, classes: tuple[str, ...]) -> Split:
    """The images in `split_dir/<class>/`, labelled by the class's index in `classes`."""
    files: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        folder = posixpath.join(split_dir, cls)
        if not fs.isdir(folder):
            raise UserError(f"class {cls} has no folder in {url(fs, split_dir)}")
        for path in sorted(fs.ls(folder, detail=False)):
            if path.lower().endswith(IMAGE_EXTENSIONS):
                files.append(url(fs, path))
                labels.append(label)
    if not files:
        raise UserError(f"no images (*.JPEG, *.jpg, *.png) under {url(fs, split_dir)}")
    return Split(name=name, files=tuple(files), labels=tuple(labels))
