"""Parquet files of images and labels, as the Hugging Face Hub keeps most datasets: `data.format: parquet`.

`datasets`' `push_to_hub` writes `DIR/data/<split>-00000-of-00004.parquet`, the Hub's own conversion
`DIR/<config>/<split>/0000.parquet`; `DIR/<split>/*.parquet` and `DIR/<split>-*.parquet` are found too (`val`
also finds `validation`). The image column is the one `datasets`' features (the schema's `huggingface`
metadata) call an `Image`, a struct of the encoded `bytes` and the file's `path`, else a struct or binary column
named `image` or `img`; the label column is the `ClassLabel`, whose names are the classes, else an integer
column named `label`, `labels`, `class` or `category` (the classes then only numbers), or a string column so
named (a dataset made from a table of names, not cast to a `ClassLabel`): its classes are the sorted names of
the training and validation files, both read whichever split a command lists (as `data.format: csv` sorts its
labels), so a run and its evaluation give each index one meaning. Listing reads each file's footer (its row
count and schema) and, for string labels, that column alone, not the images, in a bucket too.

A row of a Parquet file cannot be read alone: its image is in a compressed page among a row group's. So each
input pipeline's files, once local (copied from a bucket as shards are), are unpacked once into WebDataset tar
shards in `data.cache_dir/parquet-tars` (an image and its `.cls` per row, written whole under a temporary name),
and read as `data.format: wds` reads its shards: the same sample tables, stream positions, shuffling, corrupt
counting and DALI path. A row without an image or a label stays a sample with nothing to decode, so it is
counted as a corrupt image. The price is disk: a second copy of the pipeline's share.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io
import json
import os
import posixpath
import tarfile

from tfdp.data.layouts import LISTING_THREADS, Source, Split, sorted_names
from tfdp.data.layouts.records import SPLIT_PREFIXES
from tfdp.data.layouts.webdataset import drop_other_versions, keep_tables_in, version_name
from tfdp.data.storage import filesystem, is_remote, url
from tfdp.errors import UserError, first_line

IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "labels", "class", "category")
UNPACKED = "parquet-tars"   # under data.cache_dir
# Encoded images' first bytes → the extension their tar member gets (TensorFlow decodes by content anyway).
MAGIC = ((b"\xff\xd8", "jpg"), (b"\x89PNG", "png"), (b"GIF8", "gif"), (b"BM", "bmp"), (b"RIFF", "webp"))


@dataclasses.dataclass(frozen=True)
class Columns:
    """Where a file's image bytes and label are."""
    image: str
    image_in_struct: bool   # `datasets`' Image: a struct whose `bytes` field holds the encoded image
    label: str
    label_is_text: bool = False   # class names, indexed by `classes`
    classes: tuple[str, ...] = ()   # the sorted names of a text label column (`text_classes`)


def parquet_source(root: str, split_names: tuple[str, ...], cache_dir: str,
                   labelled_splits: tuple[str, ...] = ()) -> Source:
    """Each of `split_names`' files and their columns; text labels are indexed into the sorted names of
    `labelled_splits` (training's and validation's) wherever their files exist."""
    fs, path = filesystem(root)
    if not fs.isdir(path):
        raise UserError(f"data directory not found: {url(fs, path)}")
    keep_tables_in(cache_dir)   # the unpacked shards' sample tables
    splits, class_names = {}, None
    names_in = functools.cache(lambda column: text_classes(fs, path, column, (*split_names, *labelled_splits)))
    for name in split_names:
        files = find_files(fs, path, name)
        with concurrent.futures.ThreadPoolExecutor(LISTING_THREADS if is_remote(fs) else 1) as pool:
            footers = list(pool.map(lambda f: footer(fs, f), files))
        columns, names = footers[0][1], footers[0][2]
        for f, (_, other, _) in zip(files, footers):
            if other != columns:
                raise UserError(f"{url(fs, f)} keeps its images or labels in other columns than {url(fs, files[0])}")
        if columns.label_is_text:
            names = names_in(columns.label)
            columns = dataclasses.replace(columns, classes=names)
        if class_names is not None and names != class_names:
            raise UserError(f"split '{name}' names other classes than '{split_names[0]}' in {url(fs, path)}")
        class_names = names
        splits[name] = Split(name=name, files=tuple(url(fs, f) for f in files),
                             counts=tuple(rows for rows, _, _ in footers), parquet=columns)
    return Source(class_names=class_names or (), splits=splits)


def text_classes(fs, root: str, column: str, splits: tuple[str, ...]) -> tuple[str, ...]:
    """The sorted names (as numbers where all are integers) in the text label column of every file of `splits`
    that has files; only that column is read."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    files = [f for split in dict.fromkeys(splits) for f in _files_or_none(fs, root, split)]

    def names(path: str) -> set[str]:
        with fs.open(path, "rb") as f:
            labels = pq.read_table(f, columns=[column]).column(column)
        return set(pc.unique(labels).drop_null().to_pylist())
    with concurrent.futures.ThreadPoolExecutor(LISTING_THREADS if is_remote(fs) else 1) as pool:
        found = set().union(*pool.map(names, files))
    return sorted_names(found)


def _files_or_none(fs, root: str, split: str) -> list[str]:
    try:
        return find_files(fs, root, split)
    except UserError:
        return []


def find_files(fs, root: str, name: str) -> list[str]:
    """The split's Parquet files under `root`, as `datasets` and the Hub lay them out."""
    for prefix in SPLIT_PREFIXES.get(name, (name,)):
        for pattern in (f"data/{prefix}-*.parquet", f"{prefix}/*.parquet", f"{prefix}-*.parquet",
                        f"*/{prefix}/*.parquet"):
            found = sorted(fs.glob(posixpath.join(root, pattern)))
            if found:
                return found
    raise UserError(f"no Parquet files for split '{name}' in {url(fs, root)} (expected data/{name}-*.parquet, "
                    f"{name}/*.parquet or {name}-*.parquet)")


def footer(fs, path: str) -> tuple[int, Columns, tuple[str, ...]]:
    """(rows, the image and label columns, the class names `datasets` gives them) from a Parquet file's footer."""
    import pyarrow.parquet as pq
    try:
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid and its kin: the file is no Parquet
        raise UserError(f"{url(fs, path)} is not a Parquet file ({first_line(e, 80)})") from None
    features = _features(schema)
    where = url(fs, path)
    image = next((n for n, f in features.items() if isinstance(f, dict) and f.get("_type") == "Image"), None)
    image = image or next((n for n in IMAGE_COLUMNS if n in schema.names), None)
    if image is None:
        raise UserError(f"{where} has no image column (a datasets Image, or one named {', '.join(IMAGE_COLUMNS)}; "
                        f"it has {', '.join(schema.names)})")
    in_struct = _is_struct(schema.field(image).type)
    if not in_struct and not _is_binary(schema.field(image).type):
        raise UserError(f"{where}: column {image} holds {schema.field(image).type}, not encoded images")
    label = next((n for n, f in features.items() if isinstance(f, dict) and f.get("_type") == "ClassLabel"), None)
    label = label or next((n for n in LABEL_COLUMNS if n in schema.names), None)
    text = label is not None and _is_text(schema.field(label).type)
    if label is None or not (text or _is_integer(schema.field(label).type)):
        columns = ", ".join(f"{n} ({schema.field(n).type})" for n in schema.names)
        raise UserError(f"{where} has no integer or string label column (a datasets ClassLabel, or one named "
                        f"{', '.join(LABEL_COLUMNS)}; it has {columns})")
    names = tuple(str(n) for n in (features.get(label) or {}).get("names") or ())
    return meta.num_rows, Columns(image, in_struct, label, label_is_text=text), names


def _features(schema) -> dict:
    """`datasets`' feature descriptions kept in the schema's metadata ({} where there are none)."""
    try:
        return json.loads((schema.metadata or {}).get(b"huggingface", b"{}"))["info"]["features"] or {}
    except (ValueError, KeyError, TypeError):
        return {}


def _is_struct(kind) -> bool:
    import pyarrow as pa
    return pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0


def _is_binary(kind) -> bool:
    import pyarrow as pa
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _is_integer(kind) -> bool:
    import pyarrow as pa
    return pa.types.is_integer(kind)


def _is_text(kind) -> bool:
    import pyarrow as pa
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def unpacked(paths: list[str], columns: Columns, cache_dir: str) -> list[str]:
    """The WebDataset shard each local Parquet file is unpacked into (`unpack`), made where not there yet."""
    return [unpack(p, columns, cache_dir) for p in paths]


def unpack(path: str, columns: Columns, cache_dir: str) -> str:
    """`path`'s rows as a tar shard in `cache_dir/parquet-tars`, one per file version: each row's image (as
    `NNNNNNNNN.jpg`, `.png`, ... by its first bytes) and label (`.cls`); a row lacking either keeps what it has,
    or an empty `.none` member, so that row numbers and samples stay one to one."""
    import pyarrow.parquet as pq
    stat = os.stat(path)
    name = version_name(path, stat.st_size, stat.st_mtime_ns, salt=f"|{columns}")
    out = os.path.join(os.path.expanduser(cache_dir), UNPACKED, f"{name}.tar")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    temporary = f"{out}.tmp-{os.getpid()}"
    row = 0
    index = {name: i for i, name in enumerate(columns.classes)} if columns.label_is_text else None
    with tarfile.open(temporary, "w", format=tarfile.USTAR_FORMAT) as tar:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256, columns=[columns.image, columns.label]):
            images = batch.column(columns.image)
            if columns.image_in_struct:
                images = images.field("bytes")
            labels = batch.column(columns.label).to_pylist()
            if index is not None:   # every name is in `classes`, which were read from these files
                labels = [None if label is None else index[label] for label in labels]
            for image, label in zip(images.to_pylist(), labels):
                members = ([(_extension(image), image)] if image else []) + (
                    [("cls", str(label).encode())] if label is not None and label >= 0 else [])
                for kind, data in members or [("none", b"")]:
                    info = tarfile.TarInfo(f"{row:09d}.{kind}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                row += 1
    os.replace(temporary, out)
    drop_other_versions(out)
    return out


def _extension(image: bytes) -> str:
    return next((ext for magic, ext in MAGIC if image.startswith(magic)), "jpg")
