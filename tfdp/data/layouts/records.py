"""TFRecord shards in the standard ImageNet format.

Shards are named `train-00000-of-01024` and `validation-00000-of-00128`,
each a sequence of tf.train.Example in the format `tfdp.data.layouts.tfrecord`
defines (TensorFlow's official `build_imagenet_data.py` format).

tfdp's converter (`pipelines/convert_imagenet.py`) writes this format and,
beside the shards, `synsets.txt` (the class list in label order) and
`counts.json`. Shards from other tools work too: the class list is then read
from a synset file if one is present, and record counts from the shards'
length headers.

Shards in a bucket stay remote in the `Split`: each input pipeline copies
only its own share to the local cache when it is built (`readers.payloads`),
so a worker never fetches another worker's shards. Only shards without a
`counts.json` entry are copied up front, because counting reads them.

Local shards are checked against `counts.json` when the split is listed, from
their framing alone (12-byte headers and seeks): a shard cut short keeps its
readable records in `Split.counts` and its loss in `Split.lost`, so training
and evaluation know (and name) the damage before reading any image.
"""

from __future__ import annotations

import fnmatch
import json
import posixpath

from tfdp.data.layouts import Source, Split, read_text
from tfdp.data.storage import filesystem, is_remote, localize, url
from tfdp.data.layouts.tfrecord import IMAGENET_RECORDS, count_records, first_record, readable_records
from tfdp.errors import UserError, first_line

SYNSET_FILES = ("synsets.txt", "LOC_synset_mapping.txt", "imagenet_metadata.txt", "imagenet_lsvrc_2015_synsets.txt")
COUNTS_FILE = "counts.json"
SPLIT_PREFIXES = {"val": ("validation", "val"), "validation": ("validation", "val")}


def shard_name(prefix: str, index: int, total: int) -> str:
    return f"{prefix}-{index:05d}-of-{total:05d}"


def tfrecord_source(root: str, split_names: tuple[str, ...], cache_dir: str) -> Source:
    fs, path = filesystem(root)
    if not fs.isdir(path):
        raise UserError(f"data directory not found: {root}")
    synsets, text = read_synsets(fs, path)
    known = _read_counts(fs, path)
    splits = {}
    for name in split_names:
        shards = tuple(url(fs, s) for s in _find_shards(fs, path, name))
        counts = _shard_counts(shards, known, cache_dir)
        readable = counts if is_remote(fs) else tuple(map(_readable_count, shards, counts))
        splits[name] = Split(name=name, files=shards, counts=readable, records=IMAGENET_RECORDS,
                             lost=tuple(c - r for c, r in zip(counts, readable)) if readable != counts else ())
        check_first_record(splits[name], len(synsets))
    return Source(class_names=synsets, splits=splits, class_text=text)


def _shard_counts(shards: tuple[str, ...], known: dict[str, int], cache_dir: str) -> tuple[int, ...]:
    """Records per shard: from counts.json, else counted from a local copy (all such shards fetched at once)."""
    uncounted = [s for s in shards if not known.get(posixpath.basename(s))]
    counted = {s: count_records(local) for s, local in zip(uncounted, localize(uncounted, cache_dir))}
    return tuple(known.get(posixpath.basename(s)) or counted[s] for s in shards)


def _readable_count(path: str, expected: int) -> int:
    """Complete records in a local shard, at most `expected` (counts.json's count).

    A shard cut short (an interrupted copy) is found here, when the split is
    listed, from its framing alone; its loss then counts against training's
    bad-record bound and fails evaluation (`sources.check_lost`,
    `sources.require_complete`) instead of going silently missing.
    """
    return min(readable_records(path)[0], expected)


def read_synsets(fs, root: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(synset ids in label order, their names) from the first synset file found, else empty.

    The file's order is the label order: the converter writes its classes so (a labels file's classes need not be
    in sorted order: `data.format: csv` orders numbers as numbers, or by its classes.txt), and ImageNet's own lists
    are already sorted, as its labels are."""
    for name in SYNSET_FILES:
        path = posixpath.join(root, name)
        if fs.exists(path):
            # the converter's "id<TAB>name" (an id may hold spaces: a labels file's class names), or ImageNet's
            # "n01440764 tench, Tinca tinca"
            rows = [line.split("\t", 1) if "\t" in line else line.split(None, 1)
                    for line in read_text(fs, path).splitlines() if line.strip()]
            return (tuple(row[0].strip() for row in rows),
                    tuple(row[1].strip() if len(row) > 1 else row[0].strip() for row in rows))
    return (), ()


def check_first_record(split: Split, num_classes: int) -> None:
    """Fails early on shards of another format (missing features, 0-based labels, too many classes)."""
    import tensorflow as tf

    fmt = split.records
    path = next((f for f, n in zip(split.files, split.counts) if n), split.files[0])  # not one cut short to nothing
    first = first_record(path)
    if first is None:
        return
    try:
        example = tf.train.Example.FromString(first)
    except Exception:  # protobuf's DecodeError
        raise UserError(f"{path}: the first record is not a tf.train.Example") from None
    features = example.features.feature
    for key in (fmt.image_key, fmt.label_key):
        if key not in features:
            raise UserError(f"{path}: records have no '{key}' feature (found: {', '.join(sorted(features))})")
    label = features[fmt.label_key].int64_list.value[0] + fmt.label_offset
    if label < 0 or (num_classes and label >= num_classes):
        raise UserError(f"{path}: label {label} is outside 0..{(num_classes or 1) - 1} "
                        f"(stored value {label - fmt.label_offset}; this format expects 1-based labels)")


def _find_shards(fs, root: str, split_name: str) -> list[str]:
    names = sorted(posixpath.basename(p) for p in fs.ls(root, detail=False))
    for prefix in SPLIT_PREFIXES.get(split_name, (split_name,)):
        shards = [n for n in names if fnmatch.fnmatch(n, f"{prefix}-*") and ".tmp" not in n]
        if shards:
            return [posixpath.join(root, n) for n in shards]
    raise UserError(f"no TFRecord shards for split '{split_name}' in {url(fs, root)} "
                    f"(expected {shard_name(SPLIT_PREFIXES.get(split_name, (split_name,))[0], 0, 1024)} ...)")


def _read_counts(fs, root: str) -> dict[str, int]:
    """counts.json's records per shard (the converter's summary); one that is damaged is one line naming it,
    since trusting it would drop or invent records."""
    path = posixpath.join(root, COUNTS_FILE)
    if not fs.exists(path):
        return {}
    try:
        found = json.loads(read_text(fs, path))
    except ValueError as e:
        reason = f"not JSON: {first_line(e, 80)}"
    else:
        shards = found.get("shards", {}) if isinstance(found, dict) else None
        if isinstance(shards, dict) and all(type(n) is int and n >= 0 for n in shards.values()):
            return shards
        reason = "its \"shards\" are not shard names with their record counts"
    raise UserError(f"{url(fs, path)} is not the converter's counts ({reason}): mend it, or remove it and tfdp "
                    f"counts each shard's records itself")
