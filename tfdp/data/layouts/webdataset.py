"""WebDataset tar shards, read in place: `data.format: wds`.

The layout timm trains from (`timm/imagenet-1k-wds`, `--dataset wds/...`) and `webdataset`'s `TarWriter`
writes: each shard a plain tar whose consecutive members sharing a key (the path up to its name's first dot)
make one sample, here an image (`.jpg`, `.jpeg`, `.png`, `.webp`, ... : the first member TensorFlow decodes)
and its class number (`.cls`, the integer as text; or, with `data.label_key`, a field of its `.json`, as timm's
`--target-key` reads it: a sample whose number there is negative is left out, as timm skips it); other members
are left alone.

A split's shards are those timm's `_info.json` (or `_info.yaml`) lists for it, with their sample counts
(`splits: {train: {filenames: [...], shard_lengths: [...]}}`), else the `.tar` files of `DIR/<split>/`, else
those of `DIR` whose name has the split as a dash-separated part (`imagenet1k-train-0007.tar`; `val` also
finds `validation`). A split named by a pattern, as timm's `--train-split` is
(`imagenet1k-train-{0000..1023}.tar`, `train-*.tar`), is the shards it names. Class names come from a synset file
(`synsets.txt`, as the `tfrecord` layout reads it) where there is one; otherwise the classes are only numbers and
`model.num_classes` says how many.

A shard is read as TFRecord shards are (`tfdp.data.readers`): its sample table (`sample_table`: where each
image's bytes are, and its label) is made from the tar headers and the `.cls` members once the shard is local,
and the training stream shuffles table rows, reading each image where it is decoded. Shards in a bucket are
copied, or streamed through the bounded cache, as TFRecord shards are. A sample without an image, or whose
label is not an integer, stays in the table with no bytes to read, so the decoder counts it as a corrupt
image; a shard cut short keeps its whole samples and counts the rest as lost (`Split.lost`), as a cut
TFRecord shard does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import re
import tarfile

import numpy as np
import yaml

from tfdp.config import yaml_floats
from tfdp.data.layouts import IMAGE_EXTENSIONS, Source, Split, file_names, read_text
from tfdp.data.layouts.records import SPLIT_PREFIXES, read_synsets
from tfdp.data.storage import filesystem, is_remote, localize, url
from tfdp.errors import UserError, first_line

INFO_FILES = ("_info.json", "_info.yaml", "info.json")   # timm's reader tries the first and the last
IMAGE_TYPES = tuple(ext.lstrip(".") for ext in IMAGE_EXTENSIONS)
LABEL_TYPE = "cls"
# A sample table row: where the image's bytes are (offset, length), then the 0-based label.
OFFSET, LENGTH, LABEL = range(3)
ROW = 3
END_BLOCKS = 1024   # the two zero blocks that end a tar: a shard without them was cut short
INDEX_FOLDER = "wds-index"   # under data.cache_dir: the shards' sample tables (`keep_tables_in`)
WALKERS = 16   # processes that make missing sample tables at once
POOL_BYTES = 2 * 10**9   # shards whose tables are made by `WALKERS` processes, not in turn: about 2.5 s of walking
BRACES = re.compile(r"\{([^{}]*)\}")
PATTERN_SIGNS = "*?[{"   # a split named with any of these is a pattern of shard names (`pattern_shards`)
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")   # webdataset's base_plus_ext: (key, extension)
_index_dir: str | None = None   # where sample tables are kept (`keep_tables_in`)
_label_key = ""   # data.label_key: the .json field samples' labels are read from ("": their .cls)
SKIPPED = -2   # `_sample_label` of a sample whose .json number is negative: not a row of its table


def wds_source(root: str, split_names: tuple[str, ...], cache_dir: str, label_key: str = "") -> Source:
    """The splits' shards and their sample counts (from `_info`, else walked; with `label_key`, whose left-out
    samples `_info` does not count, always walked: in a bucket, each shard copied first)."""
    fs, path = filesystem(root)
    if not fs.isdir(path):
        raise UserError(f"data directory not found: {url(fs, path)}")
    keep_tables_in(cache_dir, label_key)
    info = read_info(fs, path)
    synsets, text = read_synsets(fs, path)
    splits = {}
    for name in split_names:
        shards, listed = split_shards(fs, path, info, name)
        if label_key:
            listed = {}
        if not is_remote(fs):
            make_tables(list(shards))
        counts = _counts(shards, listed, cache_dir)
        readable = counts if is_remote(fs) else tuple(min(len(sample_table(s)[0]), n) for s, n in zip(shards, counts))
        split = Split(name=name, files=shards, counts=readable, tar=True,
                      lost=tuple(c - r for c, r in zip(counts, readable)) if readable != counts else ())
        check_first_sample(split, len(synsets))
        if synsets and not is_remote(fs):
            check_labels(split, len(synsets))
        splits[name] = split
    return Source(class_names=synsets, splits=splits, class_text=text)


def split_shards(fs, root: str, info: dict, name: str) -> tuple[tuple[str, ...], dict[str, int]]:
    """(the split's shards, the sample counts `_info` gives for them): named by a pattern, listed in `_info`, or
    found by their names."""
    if any(sign in name for sign in PATTERN_SIGNS):
        shards = pattern_shards(fs, root, name)
        listed = {url(fs, posixpath.join(root, f)): n for one in (info.get("splits") or {}).values()
                  if isinstance(one, dict) for f, n in zip(one.get("filenames") or [], one.get("shard_lengths") or [])
                  if isinstance(f, str) and type(n) is int}
        return shards, {s: listed[s] for s in shards if s in listed}
    if info:
        return info_shards(fs, root, info, name)
    return find_shards(fs, root, name), {}


def read_info(fs, root: str) -> dict:
    """timm's dataset description (`_info.json` / `_info.yaml`), {} where there is none; one that is damaged
    is one line naming it."""
    for name in INFO_FILES:
        path = posixpath.join(root, name)
        if not fs.exists(path):
            continue
        try:
            info = (json.loads if name.endswith(".json") else yaml_floats.load)(read_text(fs, path))
        except (ValueError, yaml.YAMLError) as e:
            raise UserError(f"{url(fs, path)} is not {name.rpartition('.')[2].upper()}: {first_line(e, 80)}") from None
        if not isinstance(info, dict) or not isinstance(info.get("splits"), dict):
            raise UserError(f"{url(fs, path)} has no \"splits\" (timm's layout: splits: {{train: {{filenames: "
                            f"[...], shard_lengths: [...]}}}})")
        return {**info, "path": url(fs, path)}
    return {}


def info_shards(fs, root: str, info: dict, name: str) -> tuple[tuple[str, ...], dict[str, int]]:
    """(the split's shards, their sample counts) as `_info` lists them."""
    known = info["splits"]
    found = next((known[n] for n in SPLIT_PREFIXES.get(name, (name,)) if n in known), None)
    if found is None:
        raise UserError(f"{info['path']} lists no split '{name}' (it lists: {', '.join(sorted(map(str, known)))})")
    files, lengths = found.get("filenames"), found.get("shard_lengths")
    if (not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files)
            or not isinstance(lengths, list) or len(lengths) != len(files)
            or not all(type(n) is int and n >= 0 for n in lengths)):
        raise UserError(f"{info['path']}: split '{name}' needs \"filenames\" and as many \"shard_lengths\" "
                        f"(sample counts)")
    shards = tuple(url(fs, posixpath.join(root, f)) for f in files)
    missing = absent(fs, [posixpath.join(root, f) for f in files])
    if missing:
        raise UserError(f"{info['path']} lists {len(missing)} shard(s) that are not there, the first "
                        f"{url(fs, missing[0])}")
    return shards, dict(zip(shards, lengths))


def absent(fs, paths: list[str]) -> list[str]:
    """Those of `paths` that are not files: one listing per folder, not one request per shard (a thousand in a
    bucket)."""
    listed = {folder: file_names(fs, folder) for folder in sorted({posixpath.dirname(p) for p in paths})}
    return [p for p in paths if posixpath.basename(p) not in listed[posixpath.dirname(p)]]


def pattern_shards(fs, root: str, pattern: str) -> tuple[str, ...]:
    """The shards a split named as a pattern (timm's `--train-split`) names: brace ranges and lists expanded
    (`imagenet-train-{0000..1023}.tar`, webdataset's notation), then shell wildcards (`train-*.tar`) matched,
    under `root`. A range names every shard in it: one that is missing is an error, not a smaller split."""
    named = [posixpath.join(root, p) for p in expand_braces(pattern)]
    if any(ch in pattern for ch in "*?["):
        found = sorted({p for one in named for p in fs.glob(one) if p.endswith(".tar")})
        if not found:
            raise UserError(f"no WebDataset shards match '{pattern}' in {url(fs, root)}")
        return tuple(url(fs, p) for p in found)
    missing = absent(fs, named)
    if missing:
        raise UserError(f"{len(missing)} of the {len(named)} shards '{pattern}' names are not in {url(fs, root)}, "
                        f"the first {posixpath.basename(missing[0])}")
    return tuple(url(fs, p) for p in named)


def expand_braces(pattern: str) -> list[str]:
    """webdataset's brace notation: `{0000..0003}` (a range, zero-padded to its first bound's width) and `{a,b}`
    (a list), each expanded in place, left to right."""
    found = BRACES.search(pattern)
    if not found:
        return [pattern]
    inner = found[1]
    first, dots, last = inner.partition("..")
    if dots and first.isdigit() and last.isdigit():
        items = [str(i).zfill(len(first)) for i in range(int(first), int(last) + 1)]
    else:
        items = inner.split(",")
    head, tail = pattern[:found.start()], pattern[found.end():]
    return [head + item + rest for item in items for rest in expand_braces(tail)]


def find_shards(fs, root: str, name: str) -> tuple[str, ...]:
    """The split's `.tar` files: `root/<split>/*.tar`, else those of root with the split as a dash-separated
    part of their name."""
    for prefix in SPLIT_PREFIXES.get(name, (name,)):
        folder = posixpath.join(root, prefix)
        if fs.isdir(folder):
            shards = sorted(p for p in fs.ls(folder, detail=False) if p.endswith(".tar"))
            if shards:
                return tuple(url(fs, s) for s in shards)
        shards = sorted(p for p in fs.ls(root, detail=False) if p.endswith(".tar")
                        and prefix in posixpath.basename(p)[:-len(".tar")].split("-"))
        if shards:
            return tuple(url(fs, s) for s in shards)
    raise UserError(f"no WebDataset shards for split '{name}' in {url(fs, root)} (expected {name}/*.tar, "
                    f"*-{name}-*.tar or an _info.json listing them)")


def _counts(shards: tuple[str, ...], listed: dict[str, int], cache_dir: str) -> tuple[int, ...]:
    """Samples per shard: as `_info` lists them, else counted from a local copy (all such shards fetched at once)."""
    uncounted = [s for s in shards if s not in listed]
    local = localize(uncounted, cache_dir)
    make_tables(local)
    counted = {s: len(sample_table(copy)[0]) for s, copy in zip(uncounted, local)}
    return tuple(listed[s] if s in listed else counted[s] for s in shards)


def check_first_sample(split: Split, num_classes: int) -> None:
    """Fails early on tars that are not labelled images (no `.cls`, no image) or whose labels exceed the
    class list, naming what the first sample holds. Only its members are read, in a bucket too."""
    path = next((f for f, n in zip(split.files, split.counts) if n), None)
    if path is None:
        return
    fs, where = filesystem(path)
    with fs.open(where, "rb") as f:
        types, label = _first_sample(f, path)
    member = label_member()
    if not any(t in IMAGE_TYPES for t in types) or member not in types:
        reads = f".json's {_label_key}" if _label_key else ".cls"
        raise UserError(f"{path}: the first sample has no {'image' if member in types else f'.{member} label'} "
                        f"(its members: {', '.join('.' + t for t in types) or 'none'}; data.format wds reads an "
                        f"image and its {reads})")
    if label is None or (num_classes and label >= num_classes):
        shown = "not a class number" if label is None else f"outside 0..{num_classes - 1} (synsets.txt's classes)"
        field = f" (its .json's {_label_key})" if _label_key else ""
        raise UserError(f"{path}: the first sample's label{field} is {shown}")


def check_labels(split: Split, num_classes: int) -> None:
    """Every label of local shards (their tables are made anyway) within the class list, or one line naming the
    first that is not."""
    for path, count in zip(split.files, split.counts):
        labels = sample_table(path)[0][:count, LABEL]
        outside = np.flatnonzero(labels >= num_classes)
        if outside.size:
            raise UserError(f"{path}: sample {outside[0]}'s label {labels[outside[0]]} is outside 0..{num_classes - 1} "
                            f"(synsets.txt's classes); {outside.size} sample(s) of this shard are")


def _first_sample(f, path: str) -> tuple[list[str], int | None]:
    """(the member types of the first sample of the tar open as `f`, its label or None)."""
    types, label, key = [], None, None
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                found = _KEY.match(member.name) if member.isfile() else None
                if not found:
                    continue
                if key is not None and found[1] != key:
                    break
                key = found[1]
                types.append(found[2].lower())
                if types[-1] == label_member():
                    label = _sample_label(tar.extractfile(member).read())
    except tarfile.TarError as e:
        raise UserError(f"{path} is not a tar file ({first_line(e, 80)})") from None
    return types, label


def keep_tables_in(cache_dir: str, label_key: str = "") -> None:
    """Sample tables are kept in `cache_dir/wds-index` between runs, one small file per shard version (path, size,
    modification time) and `label_key` (the labels' .json field, "" for .cls): walking a shard's tar headers costs
    Python's tarfile about 0.14 ms a sample (3 minutes for ImageNet's 1.28 million, docs/benchmarks.md), which
    every run and every worker process of a host would pay."""
    global _index_dir, _label_key
    _index_dir = os.path.join(os.path.expanduser(cache_dir), INDEX_FOLDER)
    _label_key = label_key


def sample_table(path: str) -> tuple[np.ndarray, str | None]:
    """(a row per whole sample of a local tar shard, in order, `ROW` int64s each: where its image is and its
    label; how the shard is cut short, or None).

    Only the headers and the label members (`label_member`) are read. A sample lacking an image or an integer
    label gets a row with no bytes (the decoder then counts it as corrupt); one whose .json number is negative
    has no row. Kept per file version and label key, in memory (listing and building the pipeline both ask) and
    on disk (`keep_tables_in`).
    """
    stat = os.stat(path)
    return _table(path, stat.st_size, stat.st_mtime_ns, _label_key)


def make_tables(paths: list[str]) -> None:
    """The sample tables of local shards not yet on disk, made by one process per core (spawned: the walk is
    Python, held by the GIL) and kept (`keep_tables_in`), where they are more than POOL_BYTES of shards; others
    are made as they are asked. A streamed shard not fetched yet has none to make."""
    missing = [p for p in paths
               if _index_dir and os.path.exists(p) and not os.path.exists(_index_path(p, *_version(p)))]
    if len(missing) < 2 or sum(map(os.path.getsize, missing)) < POOL_BYTES:
        return
    import concurrent.futures
    import multiprocessing
    workers = min(len(missing), os.cpu_count() or 1, WALKERS)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_kept_table, missing, [_index_dir] * len(missing), [_label_key] * len(missing), chunksize=4))


def _kept_table(path: str, index_dir: str, label_key: str) -> None:
    keep_tables_in(os.path.dirname(index_dir), label_key)
    sample_table(path)


def _version(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def version_name(path: str, size: int, mtime_ns: int, salt: str = "") -> str:
    """A local file's version as a file name (its real path, with `salt`, hashed; its size; its modification
    time): what a file made from it once is kept under."""
    digest = hashlib.sha1(f"{os.path.realpath(path)}{salt}".encode()).hexdigest()[:20]
    return f"{digest}-{size}-{mtime_ns}"


def drop_other_versions(kept: str) -> None:
    """Removes what was kept beside `kept` (`version_name`) for other versions of the same file: a shard or Parquet
    file that changed leaves no stale table or copy in data.cache_dir. A process still reading an older version
    holds its table in memory; another process may have removed a file first."""
    folder, name = os.path.split(kept)
    digest = name.split("-", 1)[0]
    for other in os.listdir(folder):
        if other.startswith(f"{digest}-") and other != name and ".tmp-" not in other:
            try:
                os.remove(os.path.join(folder, other))
            except OSError:
                pass


def _index_path(path: str, size: int, mtime_ns: int) -> str:
    salt = f"|label_key={_label_key}" if _label_key else ""   # .cls tables keep the names they always had
    return os.path.join(_index_dir, f"{version_name(path, size, mtime_ns, salt)}.npz")


@functools.lru_cache(maxsize=8192)   # ImageNet's 1,024 training shards: 30 KB each
def _table(path: str, size: int, mtime_ns: int, label_key: str) -> tuple[np.ndarray, str | None]:
    index = _index_path(path, size, mtime_ns) if _index_dir else None
    if index and os.path.exists(index):
        try:
            with np.load(index) as kept:
                table, cut = kept["table"], str(kept["cut"]) or None
            if table.ndim == 2 and table.shape[1] == ROW:
                table.flags.writeable = False
                return table, cut
        except (OSError, ValueError, KeyError):   # a damaged index: made again
            pass
    table, cut = _walk(path, size)
    if index:
        os.makedirs(os.path.dirname(index), exist_ok=True)
        temporary = f"{index}.tmp-{os.getpid()}.npz"
        np.savez(temporary, table=table, cut=np.str_(cut or ""))
        os.replace(temporary, index)   # whole or not at all: the host's other workers read it
        drop_other_versions(index)
    return table, cut


def _walk(path: str, size: int) -> tuple[np.ndarray, str | None]:
    rows: list[list[int]] = []
    cut = None
    key, image, label = None, None, None

    def close():
        if key is not None and label != SKIPPED:
            rows.append([image[0], image[1], label] if image and label is not None else [0, 0, -1])

    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                found = _KEY.match(member.name) if member.isfile() else None
                if not found:
                    continue
                if member.offset_data + member.size > size:
                    cut = f"member {member.name} runs past the end"
                    break
                if found[1] != key:
                    close()
                    key, image, label = found[1], None, None
                kind = found[2].lower()
                if kind in IMAGE_TYPES and image is None:
                    image = (member.offset_data, member.size)
                elif kind == label_member():
                    label = _sample_label(tar.extractfile(member).read())
            end = tar.offset
    except tarfile.TarError as e:
        if not rows and key is None:
            raise UserError(f"{path} is not a tar file ({first_line(e, 80)})") from None
        cut = f"a header is damaged ({first_line(e, 80)})"
    else:
        if cut is None and size - end < END_BLOCKS:   # tarfile ends quietly at a header cut short
            cut = "its end-of-archive blocks are missing"
    if cut is None:
        close()   # the last sample is whole: nothing of the shard is missing after it
    table = np.array(rows, np.int64).reshape(-1, ROW)
    table.flags.writeable = False   # shared by every caller
    return table, cut


def _label(data: bytes) -> int | None:
    try:
        label = int(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return label if label >= 0 else None


def label_member() -> str:
    """The member type a sample's label is read from: `.cls`, or `.json` with data.label_key."""
    return "json" if _label_key else LABEL_TYPE


def _sample_label(data: bytes) -> int | None:
    """A sample's class number from its label member: the `.cls` text, or the `.json` field data.label_key names
    (timm's `get_field`: the key itself, else a '/'-separated path into nested objects), an integer (or its
    text); None where there is none; SKIPPED where the number is negative."""
    if not _label_key:
        return _label(data)
    try:
        value = json.loads(data)
        path = [_label_key] if isinstance(value, dict) and _label_key in value else _label_key.split("/")
        for part in path:
            value = value[part]
        label = None if isinstance(value, bool) or not isinstance(value, (int, str)) else int(value)
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return label if label is None or label >= 0 else SKIPPED


def read_range(path, row):
    """The image bytes a sample table row locates in the local tar `path`, read with one `pread` inside the
    decoding map (`tf.numpy_function`: TensorFlow has no op that reads a byte range of a plain file without
    reading, or skipping through, everything before it; its fixed-length record reader did, 2 ms per image in
    a 40 MB shard). A row with no bytes (a sample without an image or a label) and a shard cut since its table
    was made are errors of this op, which the decoding map counts as corrupt images."""
    import tensorflow as tf

    data = tf.numpy_function(_pread, [path, row[OFFSET], row[LENGTH]], tf.string, stateful=False)
    return tf.reshape(data, [])


def _pread(path: bytes, offset: np.int64, length: np.int64) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, int(length), int(offset))
    finally:
        os.close(fd)
    if not length or len(data) != length:
        raise ValueError(f"{path.decode(errors='replace')}: no image at byte {offset} (the sample has none, or the "
                         f"shard was cut)")
    return data
