"""Dataset sources: where the examples of each split live, as a list of files.

A source only lists (local paths or bucket URLs); it reads no pixels. `tfdp.data.pipeline` turns a `Split`
into a tf.data pipeline. Each layout is one builder in `tfdp.data.SOURCES`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import posixpath
from typing import Any

import fsspec

from tfdp.data.storage import filesystem, is_remote, note_sizes, url
from tfdp.errors import UserError
from tfdp.startup.console import say

# Every format `tf.io.decode_image` decodes (TensorFlow 2.21: JPEG, PNG, GIF, BMP, WebP; GIFs and WebPs by their
# first frame), by file extension, compared without case. TIFF and HEIC are not among them.
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".jpe", ".png", ".gif", ".bmp", ".webp")
IMAGE_PATTERNS = "*.jpg, *.jpeg, *.jpe, *.png, *.gif, *.bmp, *.webp"
LISTING_THREADS = 16   # class folders of a bucket listed at once


def is_image_file(path: str) -> bool:
    return path.lower().endswith(IMAGE_EXTENSIONS)


class Ignored:
    """Files a listing left out because TensorFlow does not decode them, counted by extension, so one line
    can say what was left out and why instead of files vanishing from the count."""

    def __init__(self):
        self.by_extension: collections.Counter = collections.Counter()

    def add(self, path: str, is_dir: bool = False) -> None:
        self.by_extension["folder" if is_dir else (posixpath.splitext(path)[1].lower() or "no extension")] += 1

    @property
    def total(self) -> int:
        return sum(self.by_extension.values())

    def kinds(self) -> str:
        """How many of each extension, most first: '2 .txt, 1 .tiff'."""
        return ", ".join(f"{n} {ext}" for ext, n in sorted(self.by_extension.items(), key=lambda kv: (-kv[1], kv[0])))

    def line(self, where: str) -> str:
        """'' when nothing was ignored, else one line naming the extensions and how many of each."""
        if not self.total:
            return ""
        return (f"tfdp: data: {where}: ignored {self.total} file(s) that are not images TensorFlow decodes "
                f"({self.kinds()}; read: {IMAGE_PATTERNS})")

    def report(self, where: str) -> None:
        if self.total:
            say(self.line(where))


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
    `counts` how many each file has), or samples of a tar shard (`tar`,
    `counts` likewise; counts size the epochs and let every
    evaluation pipeline run the same number of steps). `counts` are the
    records each file really holds; `lost` the ones it was expected to hold
    (counts.json) but cuts short, as a half-finished copy leaves a shard.
    """
    name: str
    files: tuple[str, ...]
    labels: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    records: RecordFormat | None = None
    synthetic: bool = False   # examples made in the pipeline: `files` only name its parts, `counts` size them
    lost: tuple[int, ...] = ()  # per file: records counts.json lists beyond the readable ones
    tar: bool = False   # each file a WebDataset tar shard, `counts` its samples (`layouts.webdataset`)
    parquet: Any = None   # each file a Parquet file, `counts` its rows; its columns (`layouts.parquet.Columns`)
    idx: Any = None   # an IDX image file (`files`) and its label file, `counts` its images (`layouts.idx.IdxPair`)

    @property
    def num_examples(self) -> int:
        return sum(self.file_counts())

    @property
    def lost_records(self) -> int:
        return sum(self.lost)

    def damage(self) -> str:
        """The cut-short files and what each lost, in one line ('' when none)."""
        return ", ".join(f"{f} is cut short ({n} of its {c + n} records lost)"
                         for f, c, n in zip(self.files, self.counts, self.lost) if n)

    def file_counts(self) -> tuple[int, ...]:
        return (self.counts if self.records or self.synthetic or self.tar or self.parquet or self.idx
                else (1,) * len(self.files))

    @property
    def kind(self) -> str:
        """Which reader turns the files into examples (see `tfdp.data.readers`)."""
        if self.synthetic or self.records:
            return "synthetic" if self.synthetic else "records"
        return "tar" if self.tar else "parquet" if self.parquet else "idx" if self.idx else "images"

    def subset(self, indices) -> "Split":
        """The same split restricted to the files at `indices` (one input pipeline's share)."""
        pick = lambda values: tuple(values[i] for i in indices) if values else ()  # noqa: E731
        return dataclasses.replace(self, files=pick(self.files), labels=pick(self.labels),
                                   counts=pick(self.counts), lost=pick(self.lost))


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


def require_complete(split: Split) -> None:
    """Evaluation claims no count it did not evaluate: records lost from a cut-short file are an error."""
    if split.lost_records:
        listed = split.num_examples + split.lost_records
        raise UserError(f"cannot evaluate split '{split.name}': {split.damage()}; {split.lost_records} of its "
                        f"{listed} listed images are missing (copy the file again)")


def check_lost(split: Split, max_bad_fraction: float) -> None:
    """Training: records lost from cut-short files count against data.max_bad_fraction, like corrupt images.

    Within the bound, training goes on without them, after a warning that
    names each file; beyond it, nothing is trained.
    """
    if not split.lost_records:
        return
    listed = split.num_examples + split.lost_records
    if split.lost_records > max_bad_fraction * listed:
        raise UserError(f"split '{split.name}': {split.damage()}; {split.lost_records} of {listed} records lost is "
                        f"more than data.max_bad_fraction ({max_bad_fraction})")
    say(f"tfdp: warning: split '{split.name}': {split.damage()}; going on without the "
        f"{split.lost_records} lost record(s)", err=True)


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
    """The images in `split_dir/<class>/`, labelled by the class's index in `classes`. A bucket's class
    folders are listed concurrently: one after another, a thousand of them wait a thousand round trips."""
    files: list[str] = []
    labels: list[int] = []
    ignored = Ignored()
    folders = [posixpath.join(split_dir, cls) for cls in classes]
    for cls, folder in zip(classes, folders):
        if not fs.isdir(folder):
            raise UserError(f"class {cls} has no folder in {url(fs, split_dir)}")
    if is_remote(fs):
        with concurrent.futures.ThreadPoolExecutor(LISTING_THREADS) as pool:
            listings = list(pool.map(lambda folder: folder_entries(fs, folder), folders))
    else:
        listings = map(lambda folder: folder_entries(fs, folder), folders)
    for label, entries in enumerate(listings):
        found = 0
        for path, is_dir in entries:
            if not is_dir and is_image_file(path):
                files.append(path)
                found += 1
            else:
                ignored.add(path, is_dir)
        labels += [label] * found  # one int object per class, not one per image
    if not files:
        raise UserError(f"no images ({IMAGE_PATTERNS}) under {url(fs, split_dir)}")
    ignored.report(f"split '{name}' in {url(fs, split_dir)}")
    return Split(name=name, files=tuple(files), labels=tuple(labels))


def read_text(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A dataset's text file (a class list, a labels CSV, counts.json) whole; one that is missing or not UTF-8
    text is one line naming it."""
    try:
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"file not found: {url(fs, path)}") from None
    except UnicodeDecodeError:
        raise UserError(f"{url(fs, path)} is not UTF-8 text: a damaged or foreign file") from None


def folder_entries(fs: fsspec.AbstractFileSystem, folder: str) -> list[tuple[str, bool]]:
    """(path as the user writes it, whether it is a folder) for every entry of `folder`, sorted by name.

    A local folder is read with one `os.scandir`, whose entries already say
    whether they are folders: fsspec's `ls(detail=True)` stats every file and
    builds a dict for it, most of what listing a large tree cost
    (docs/benchmarks.md, start-up on a large tree). A symbolic link is never
    a folder here, as in fsspec's listing: a linked image is read, a linked
    folder is not entered.
    """
    if is_remote(fs):
        entries = [(url(fs, e["name"]), e["type"] == "directory", e.get("size"))
                   for e in sorted(fs.ls(folder, detail=True), key=lambda e: e["name"])]
        # The sizes are kept (a streamed share needs them); fsspec's cached listing, a dict per object
        # (about 1.4 KB each, 1.8 GB for ImageNet's training images), is let go.
        note_sizes((path, size) for path, is_dir, size in entries if not is_dir and size is not None)
        fs.dircache.pop(folder.rstrip("/"), None)
        return [(path, is_dir) for path, is_dir, _ in entries]
    with os.scandir(folder) as scan:
        entries = sorted((entry.name, entry.is_dir(follow_symlinks=False)) for entry in scan)
    prefix = folder if folder.endswith("/") else folder + "/"
    return [(prefix + entry, is_dir) for entry, is_dir in entries]


def file_names(fs: fsspec.AbstractFileSystem, folder: str) -> set[str]:
    """The names of the files in `folder` (none where it is not a folder): one listing, where a look per file
    would be a request per file in a bucket."""
    try:
        return {posixpath.basename(path) for path, is_dir in folder_entries(fs, folder) if not is_dir}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def sorted_names(labels) -> tuple[str, ...]:
    """Class names from the labels a dataset uses: sorted, as numbers where every one is an integer (so labels
    0..N-1 keep their numbers); the `csv` layout's and the `parquet` layout's string labels."""
    return tuple(sorted(labels, key=int if all(is_integer(label) for label in labels) else None))


def is_integer(label: str) -> bool:
    return label.lstrip("-").isdigit()
