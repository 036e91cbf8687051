"""Raw ImageNet tree → TFRecord shards in the standard format (see tfdp/data/layouts/tfrecord.py).

    python -m pipelines.convert_imagenet --src=/data/ILSVRC2012 --out=/data/imagenet-tfrecord

Reads any layout tfdp reads (image-net.org or Kaggle tree, class folders;
local or in a bucket: gs://, s3://) and writes `train-00000-of-01024` ...
`validation-00127-of-00128` plus `synsets.txt`, `counts.json` and
`conversion_report.json`, to a local folder or a bucket.

- Parallel: one shard per task, over `--workers` processes; a progress bar.
- Resumable: each shard is written under a hidden temporary name and renamed
  when complete; finished shards are skipped on re-run, and a re-run writes
  byte-identical shards (the train list is shuffled with a fixed seed, images
  are re-encoded deterministically). For a bucket, shards are written in a
  local staging folder and each is uploaded when complete (an object appears
  whole or not at all), its summary first.
- Repairs what ILSVRC2012 really contains: CMYK JPEGs and PNG files named
  .JPEG become RGB JPEGs; greyscale JPEGs are kept (decoders expand them).
- Never drops silently: zero-byte, truncated and undecodable files are skipped,
  listed with the reason in the report, and the final counts per split and
  class are checked against the source (converted + skipped = listed).
- `--max_side` stores images downscaled so their longer side is at most that
  many pixels, as fast ImageNet loaders do: smaller files, faster decoding.
- Bounding boxes go into `image/object/bbox/*`: from Kaggle's LOC_*_solution.csv
  files, or from the ILSVRC2012 bbox XMLs (`--bbox_dir`: the unpacked
  ILSVRC2012_bbox_train_v2 / bbox_val_v3 archives). Like TensorFlow's own
  script, boxes of another class than the image's are left out.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import posixpath
import random
import shutil
import sys
import tempfile

from absl import app, flags

from tfdp.errors import atomic_write_text
from tfdp.config import DataConfig
from tfdp.data import build_source
from tfdp.data.layouts.records import shard_name
from tfdp.data.layouts import Source
from tfdp.data.storage import filesystem, is_remote
from tfdp.data.layouts.tfrecord import Item, Prepared, image_example, write_record
from tfdp.errors import UserError

REPORT = "conversion_report.json"
SPLITS = (("train", "train"), ("val", "validation"))   # (source split, shard prefix)


@dataclasses.dataclass(frozen=True)
class ShardTask:
    out_dir: str
    name: str
    items: tuple[Item, ...]
    max_side: int
    quality: int
    publish_to: str = ""   # a bucket URL the finished shard is uploaded to, from `out_dir` (then a staging folder)


class BadImage(Exception):
    """A source file that cannot become a record; the message says why."""


def convert(src: str, out: str, data_format: str = "imagenet", train_shards: int = 1024, val_shards: int = 128,
            workers: int = 0, max_side: int = 0, quality: int = 95, seed: int = 12345,
            progress: bool = True, bbox_dir: str = "") -> dict:
    """Converts the tree at `src`; returns the report (also written to `out`/conversion_report.json)."""
    out = os.path.expanduser(out)
    remote = is_remote(filesystem(out)[0])  # a bucket out of reach fails here, before any work
    source = build_source(DataConfig(format=data_format, dir=src, train_split="train", val_split="val"))
    boxes = {**_kaggle_boxes(src), **(_xml_boxes(bbox_dir) if bbox_dir else {})}
    stage = _staging_dir(out) if remote else out
    if remote:
        shutil.rmtree(stage, ignore_errors=True)  # scratch only: what counts as done is in the bucket
    os.makedirs(stage, exist_ok=True)
    _remove_stale_temporaries(stage)
    tasks = []
    for split, prefix in SPLITS:
        items = _items(source, split, boxes)
        if split == "train":
            random.Random(seed).shuffle(items)
        num_shards = train_shards if split == "train" else val_shards
        if num_shards > len(items):
            raise UserError(f"{num_shards} {prefix} shards for {len(items)} images: use at most {len(items)} shards")
        for index, chunk in enumerate(_chunks(items, num_shards)):
            tasks.append(ShardTask(stage, shard_name(prefix, index, num_shards), tuple(chunk), max_side, quality,
                                   out if remote else ""))
    _run(tasks, _finished(out), workers or os.cpu_count() or 1, progress)
    report = _finish(out, source, tasks)
    if remote:
        shutil.rmtree(stage, ignore_errors=True)
    return report


def _staging_dir(out: str) -> str:
    """The local folder where shards for a bucket are written before upload. The same for the same `out`,
    so a re-run clears what an interrupted one left (one converter per output directory at a time)."""
    return os.path.join(tempfile.gettempdir(), f"tfdp-convert-{hashlib.sha1(out.encode()).hexdigest()[:12]}")


def _remove_stale_temporaries(out: str) -> None:
    """Partial shards of an interrupted run (one converter per output directory at a time)."""
    for name in os.listdir(out):
        if name.startswith(".") and ".tmp" in name:
            os.remove(os.path.join(out, name))


def _items(source: Source, split: str, boxes: dict) -> list[Item]:
    data = source.split(split)
    text = source.class_text or source.class_names
    items = []
    for path, label in zip(data.files, data.labels):
        synset = source.class_names[label]
        own = boxes.get(posixpath.splitext(posixpath.basename(path))[0], ())
        items.append(Item(path, label, synset, text[label], tuple(tuple(b[1:]) for b in own if b[0] == synset)))
    return items


def _xml_boxes(bbox_dir: str) -> dict[str, list[tuple]]:
    """Image id → [(synset, xmin, ymin, xmax, ymax) in pixels] from ILSVRC's Pascal-VOC XML files."""
    import xml.etree.ElementTree as ElementTree

    fs, root = filesystem(bbox_dir)
    if not fs.isdir(root):
        raise UserError(f"--bbox_dir not found: {bbox_dir}")
    found = {}
    for path in sorted(p for p in fs.find(root) if p.endswith(".xml")):
        try:
            with fs.open(path, "rb") as f:
                tree = ElementTree.parse(f).getroot()
            found[posixpath.splitext(posixpath.basename(path))[0]] = [
                (obj.findtext("name"), *(float(obj.findtext(f"bndbox/{k}")) for k in ("xmin", "ymin", "xmax", "ymax")))
                for obj in tree.iter("object")]
        except (ElementTree.ParseError, TypeError, ValueError):
            raise UserError(f"{path}: not an ILSVRC bounding-box XML (annotation/object/bndbox)") from None
    return found


def _kaggle_boxes(src: str) -> dict[str, list[tuple]]:
    from tfdp.data.layouts.imagenet import layout, read_kaggle_solution

    fs, root = filesystem(src)
    if not fs.isdir(root) or layout(fs, root) != "kaggle":
        return {}
    found = {}
    for split in ("train", "val"):
        path = posixpath.join(root, f"LOC_{split}_solution.csv")
        if fs.exists(path):
            found.update(read_kaggle_solution(fs, path))
    return found


def _chunks(items: list, n: int) -> list[list]:
    """n contiguous, near-equal chunks (sizes differ by at most one)."""
    size, extra = divmod(len(items), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(n)]


def _run(tasks: list[ShardTask], finished: set[str], workers: int, progress: bool) -> None:
    from tqdm import tqdm

    todo = [t for t in tasks if t.name not in finished]
    total = sum(len(t.items) for t in tasks)
    with tqdm(total=total, initial=total - sum(len(t.items) for t in todo), unit="img", disable=not progress,
              desc="convert", file=sys.stderr) as bar:
        if workers == 1:
            for task in todo:
                convert_shard(task)
                bar.update(len(task.items))
            return
        context = multiprocessing.get_context("spawn")  # a caller's TensorFlow (tests, notebooks) is not fork-safe
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = {pool.submit(convert_shard, t): t for t in todo}
            for future in concurrent.futures.as_completed(futures):
                future.result()
                bar.update(len(futures[future].items))


def _sidecar_name(name: str) -> str:
    return f".{name}.json"


def _sidecar(out_dir: str, name: str) -> str:
    return os.path.join(out_dir, _sidecar_name(name))


def _finished(out: str) -> set[str]:
    """The shards an earlier run completed in `out` (local or a bucket): those with their summary beside them."""
    fs, root = filesystem(out)
    if not fs.isdir(root):
        return set()
    names = {posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
    return {n for n in names if _sidecar_name(n) in names}


def convert_shard(task: ShardTask) -> None:
    """Writes one shard under a temporary name, its summary beside it, then renames it into place (without
    TensorFlow: a worker process imports none)."""
    final = os.path.join(task.out_dir, task.name)
    tmp = os.path.join(task.out_dir, f".{task.name}.tmp-{os.getpid()}")
    per_class: collections.Counter = collections.Counter()
    bad = []
    with open(tmp, "wb") as shard:
        for item in task.items:
            try:
                image = prepare_image(_read(item.path), task.max_side, task.quality)
            except BadImage as e:
                bad.append({"file": item.path, "synset": item.synset, "reason": str(e)})
                continue
            write_record(shard, image_example(item, image).SerializeToString(deterministic=True))  # sorted keys
            per_class[item.synset] += 1
    summary = {"examples": sum(per_class.values()), "per_class": dict(sorted(per_class.items())), "bad": bad}
    atomic_write_text(_sidecar(task.out_dir, task.name), json.dumps(summary, indent=1))
    os.replace(tmp, final)
    if task.publish_to:
        _publish(task)


def _publish(task: ShardTask) -> None:
    """Uploads a finished shard from the staging folder, its summary first, and removes the local copies.

    An object store shows each object whole or not at all (a multipart upload
    too), and a shard counts as done only beside its summary, so an upload cut
    short is redone on re-run, never read half-written.
    """
    fs, root = filesystem(task.publish_to)
    for name in (_sidecar_name(task.name), task.name):
        local = os.path.join(task.out_dir, name)
        fs.put_file(local, posixpath.join(root, name))
        os.remove(local)


def _read(path: str) -> bytes:
    fs, inner = filesystem(path)
    with fs.open(inner, "rb") as f:
        return f.read()


def prepare_image(data: bytes, max_side: int = 0, quality: int = 95) -> Prepared:
    """The image as a JPEG the pipeline can decode; the source bytes unchanged when already fine."""
    from PIL import Image

    if not data:
        raise BadImage("zero-byte file")
    try:
        image = Image.open(io.BytesIO(data))
        image_format = image.format
        image.load()  # decodes every pixel: truncated files fail here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage(f"cannot decode ({e})") from None
    source_size = image.size
    too_big = max_side and max(image.size) > max_side
    if image_format == "JPEG" and image.mode in ("RGB", "L") and not too_big:
        return Prepared(data, image.height, image.width, source_size)
    image = image.convert("RGB") if image.mode != "L" else image
    if too_big:
        scale = max_side / max(image.size)
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                             Image.BICUBIC, reducing_gap=3.0)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return Prepared(out.getvalue(), image.height, image.width, source_size)


def _finish(out: str, source: Source, tasks: list[ShardTask]) -> dict:
    """Counts per split and class from the shard summaries, checked against the source listing."""
    shards, bad, counts = {}, [], {}
    for (split, prefix) in SPLITS:
        listed = collections.Counter(source.class_names[label] for label in source.split(split).labels)
        converted: collections.Counter = collections.Counter()
        skipped: collections.Counter = collections.Counter()
        for task in (t for t in tasks if t.name.startswith(prefix + "-")):
            summary = json.loads(_read_text(out, _sidecar_name(task.name)))
            shards[task.name] = summary["examples"]
            converted.update(summary["per_class"])
            skipped.update(b["synset"] for b in summary["bad"])
            bad.extend(summary["bad"])
        for synset in listed:
            if converted[synset] + skipped[synset] != listed[synset]:
                raise UserError(f"{prefix} class {synset}: {converted[synset]} converted + {skipped[synset]} skipped "
                                f"!= {listed[synset]} in the source")
        counts[prefix] = {"examples": sum(converted.values()), "skipped": sum(skipped.values()),
                          "per_class": dict(sorted(converted.items()))}
    text = source.class_text or source.class_names
    _write_text(out, "synsets.txt", "".join(f"{s}\t{t}\n" for s, t in zip(source.class_names, text)))
    _write_text(out, "counts.json", json.dumps({"shards": shards, "splits": counts}, indent=1))
    report = {"splits": counts, "bad_files": bad}
    _write_text(out, REPORT, json.dumps(report, indent=1))
    return report


def _read_text(out: str, name: str) -> str:
    fs, root = filesystem(out)
    return fs.cat_file(posixpath.join(root, name)).decode("utf-8")


def _write_text(out: str, name: str, text: str) -> None:
    """Replaces `out`/`name` at once: renamed into place locally, one object put in a bucket."""
    fs, root = filesystem(out)
    if is_remote(fs):
        fs.pipe_file(posixpath.join(root, name), text.encode("utf-8"))
    else:
        atomic_write_text(os.path.join(out, name), text)


FLAGS = flags.FLAGS
flags.DEFINE_string("src", None, "Raw tree: image-net.org or Kaggle layout, or class folders (local or a bucket).")
flags.DEFINE_string("out", None, "Output directory for the shards (local or a bucket: gs://..., s3://...).")
flags.DEFINE_enum("format", "imagenet", ["imagenet", "image_folder", "csv"],
                  "Layout of --src (csv: labels files, as data.format csv).")
flags.DEFINE_integer("train_shards", 1024, "Number of train shards.")
flags.DEFINE_integer("val_shards", 128, "Number of validation shards.")
flags.DEFINE_integer("workers", 0, "Processes (0: one per CPU).")
flags.DEFINE_integer("max_side", 0, "Downscale images so the longer side is at most this (0: keep).")
flags.DEFINE_integer("quality", 95, "JPEG quality for re-encoded images (CMYK, PNG, downscaled).")
flags.DEFINE_integer("seed", 12345, "Seed of the train-list shuffle.")
flags.DEFINE_string("bbox_dir", "", "ILSVRC2012 bounding-box XMLs (unpacked bbox archives), searched recursively.")


def main(argv) -> None:
    del argv
    try:
        if not FLAGS.src or not FLAGS.out:
            raise UserError("--src and --out are required")
        report = convert(FLAGS.src, FLAGS.out, FLAGS.format, FLAGS.train_shards, FLAGS.val_shards, FLAGS.workers,
                         FLAGS.max_side, FLAGS.quality, FLAGS.seed, bbox_dir=FLAGS.bbox_dir)
    except UserError as e:
        print(f"convert_imagenet: error: {e}", file=sys.stderr)
        sys.exit(2)
    splits = report["splits"]
    print(f"convert_imagenet: {splits['train']['examples']} train and {splits['validation']['examples']} validation "
          f"images in {FLAGS.out}; skipped {len(report['bad_files'])} bad file(s), listed in "
          f"{os.path.join(FLAGS.out, REPORT)}", flush=True)


if __name__ == "__main__":
    app.run(main)
