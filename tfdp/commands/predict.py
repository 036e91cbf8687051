"""`tfdp predict`: a trained model's top-k classes for every image in a folder, file, pattern or bucket prefix.

The model is a run's checkpoint, or (`pretrained`, `--init_from` with no run: `tfdp.commands.from_weights`)
pretrained weights as they are, with their own classes; then no training data is read. The images go through
evaluation's preprocessing (`tfdp.data.preprocess.eval_transform`: central crop of `data.eval_crop_fraction`,
`data.eval_image_size`, resized as `data.eval_interpolation` says; mean/std inside the model) and are spread over the
strategy's replicas as evaluation spreads its split: padded to whole steps so every replica gets full
batches, each image carried with its number, so no image is lost or counted twice whatever the replica
count. The rows are made from the listing, not from what the pipeline returns: an image that cannot be
read or decoded leaves the pipeline (one parallel map with `ignore_errors`, as fast as evaluation's, and
the pipeline never stops), its number does not come back, and its row gets TensorFlow's reason, from
decoding that one file again (`tfdp.data.corrupt.decode_error`). (A per-image guard inside the
pipeline, each image decoded in a dataset of its own with a fallback element, keeps the failure in the
stream but decodes at about half the rate: `benchmarks/predict_decode.py`.) The output (JSONL or CSV, by
its extension) is written atomically once every image has its row. What the user asked for is checked
(`request`) before TensorFlow is even imported, so a bad request is one line at once. Images in a bucket
are copied to data.cache_dir first; when they take more than data.cache_limit, they go through in
consecutive chunks of at most half the limit each, the next downloading while one is predicted and each
deleted once predicted (`Downloads`).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from tfdp.config import Config
from tfdp.data import build_source
from tfdp.data.corrupt import LOG as CORRUPT_LOG, decode_error
from tfdp.data.layouts import IMAGE_PATTERNS, Ignored, is_image_file
from tfdp.data.storage import cache_paths, filesystem, is_remote, is_remote_url, localize, url
from tfdp.errors import UserError, first_line
from tfdp.startup.console import say

if TYPE_CHECKING:  # TensorFlow loads only once the request is known to be good
    from tfdp.distribute.strategy import Runtime

GLOB_CHARACTERS = "*?["


# --- the request -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Request:
    """What to predict and where the rows go, checked."""
    files: tuple[str, ...]   # the images, sorted: local paths or bucket URLs, as the rows name them
    output: str              # absolute path of the JSONL or CSV file
    write: Callable          # (rows, top_k) → the file's text
    top_k: int | None        # None: min(5, the model's classes), once they are known
    sizes: tuple[int, ...] = ()   # each bucket object's bytes, from the listing (local files: none)


DEFAULT_TOP_K = 5


def request(cfg: Config, inputs: str | None, output: str | None, top_k: int | None = None,
            classes_known: bool = True) -> Request:
    """The checked request: a writable output of a known format, top_k within the classes, at least one
    image. No TensorFlow here. Without a top_k, min(5, classes), as timm's inference script: a 3-class model
    needs no flag; a top_k the user asked for beyond the classes is still refused (`classes_known` False: the
    classes are the weights', known once they are read: checked then, in `predict`)."""
    write = check_output(output)
    if classes_known:
        top_k = resolved_top_k(top_k, cfg.model.num_classes)
    files, sizes = list_images(inputs)
    return Request(tuple(files), os.path.abspath(os.path.expanduser(output)), write, top_k, tuple(sizes))


def check_output(output: str | None) -> Callable[[list[dict], int], str]:
    """The writer for `output`'s extension, after proving a file can be written beside it: one line
    before any model is built if not."""
    if not output:
        raise UserError("predict needs --output=FILE.jsonl or FILE.csv")
    extension = os.path.splitext(output)[1].lower()
    if extension not in WRITERS:
        raise UserError(f"--output {output}: unknown format '{extension or '(no extension)'}' "
                        f"(one of: {', '.join(sorted(WRITERS))})")
    if is_remote_url(output):
        raise UserError(f"--output {output}: write the predictions to a local file (copy it to the bucket after)")
    path = os.path.abspath(os.path.expanduser(output))
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise UserError(f"--output {output} is a folder; name a file in it (predictions{extension})")
    if not os.path.isdir(parent):
        raise UserError(f"cannot write {output}: its folder {parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".tfdp-write-check-"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {output}: its folder {parent} is not writable "
                        f"({os.strerror(e.errno or 0).lower()})") from None
    return WRITERS[extension]


def resolved_top_k(top_k: int | None, num_classes: int) -> int:
    """`top_k`, or min(5, the classes) without one; checked against the classes."""
    if top_k is None:
        top_k = min(DEFAULT_TOP_K, num_classes)
    check_top_k(top_k, num_classes)
    return top_k


def check_top_k(top_k: int, num_classes: int) -> None:
    if not 1 <= top_k <= num_classes:
        raise UserError(f"--top_k={top_k} must be between 1 and the model's {num_classes} classes (model.num_classes)")


def list_images(spec: str | None) -> tuple[list[str], list[int]]:
    """The images `spec` names, sorted, and their sizes when they are in a bucket: a file (whatever its
    extension), every image under a folder or bucket prefix (recursively), or every image a glob pattern
    matches (`**` crosses folders). Files TensorFlow does not decode are counted by extension in one line."""
    if not spec:
        raise UserError("predict needs --input=FOLDER, FILE, 'PATTERN' or a gs:// / s3:// prefix")
    fs, path = filesystem(spec)
    ignored = Ignored()
    candidates: dict[str, int] = {}
    if any(c in path for c in GLOB_CHARACTERS):
        for match in fs.glob(path):
            candidates.update(_sizes(fs, match) if fs.isdir(match) else {match: _size(fs, match)})
    elif fs.isdir(path):
        candidates = _sizes(fs, path)
    elif fs.isfile(path):
        return [url(fs, path)], [_size(fs, path)]
    else:
        raise UserError(f"--input {spec}: no such file or folder")
    images, sizes = [], []
    for candidate in sorted(candidates):
        if is_image_file(candidate):
            images.append(url(fs, candidate))
            sizes.append(candidates[candidate])
        else:
            ignored.add(candidate)
    if not images:
        also = f"; {ignored.total} other file(s) there ({ignored.kinds()})" if ignored.total else ""
        raise UserError(f"--input {spec}: no images ({IMAGE_PATTERNS}){also}")
    ignored.report(f"--input {spec}")
    return images, (sizes if is_remote(fs) else [])


def _sizes(fs, folder: str) -> dict[str, int]:
    """Every file under `folder` with its size (a bucket lists both at once; locally the size is not needed)."""
    if not is_remote(fs):
        return dict.fromkeys(fs.find(folder), 0)
    return {p: int(info.get("size") or 0) for p, info in fs.find(folder, detail=True).items()}


def _size(fs, path: str) -> int:
    return int(fs.size(path) or 0) if is_remote(fs) else 0


def chunks(sizes: tuple[int, ...], count: int, limit: int) -> list[range]:
    """The images as consecutive ranges whose bucket objects take at most half of `limit` each, so one range
    is read while the next downloads; one range for local files or images that fit whole."""
    if not sizes or sum(sizes) <= limit:
        return [range(count)]
    half = limit // 2
    if (largest := max(sizes)) > half:
        raise UserError(f"data.cache_limit ({_human(limit)}) is too small to stream these images: the largest is "
                        f"{_human(largest)}, and two chunks of images must fit")
    found, start, held = [], 0, 0
    for i, size in enumerate(sizes):
        if held + size > half:
            found.append(range(start, i))
            start, held = i, 0
        held += size
    return found + [range(start, count)]


def _human(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size} bytes"


def class_names(cfg: Config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(class ids, readable names) in label order, from the training data's listing (class folders, synset
    files): what the model's outputs mean. Empty when the data cannot be listed here (or names no
    classes): the rows then name classes by number."""
    if cfg.data.format == "synthetic":
        return (), ()
    try:
        source = build_source(cfg.data, splits=(cfg.data.val_split,))
    except UserError as e:
        say(f"tfdp: predict: no class names ({first_line(e)}); classes are named by number")
        return (), ()
    if source.num_classes and source.num_classes != cfg.model.num_classes:
        raise UserError(f"the data has {source.num_classes} classes but model.num_classes is {cfg.model.num_classes}")
    text = source.class_text if source.class_text and source.class_text != source.class_names else ()
    return source.class_names, text


# --- the pipeline ------------------------------------------------------------

# train.loss → the tf.math function that turns the model's outputs into class probabilities
PROBABILITIES = {"softmax": "softmax", "bce": "sigmoid"}


def predict(cfg: Config, runtime: "Runtime", checkpoint: str | None, job: Request, pretrained=None) -> dict:
    """Writes `job.output` with one row per image of `job.files`; returns a summary (images, failed, seconds).
    `pretrained` (`tfdp.commands.from_weights.Pretrained`): the model and its classes from model.init_from's
    weights, not from a checkpoint, and no training data listed."""
    import tensorflow as tf

    from tfdp.errors import atomic_write_text
    from tfdp.rundir.checkpoints import CheckpointStore
    from tfdp.data import dali
    from tfdp.data.pipeline import data_errors, evaluation_decoding
    from tfdp.data.storage import limit_bytes
    from tfdp.rundir.checkpoints import load_checkpoint
    from tfdp.train.task import ClassificationTask

    if runtime.num_workers > 1:
        raise UserError("predict runs on one host's replicas: use distribute.strategy mirrored or one_device")
    if pretrained is not None:
        cfg, names, text = pretrained.cfg, pretrained.names, pretrained.text
    else:
        names, text = class_names(cfg)
    files, top_k = list(job.files), resolved_top_k(job.top_k, cfg.model.num_classes)
    parts = chunks(job.sizes, len(files), limit_bytes(cfg.data))
    task = ClassificationTask(cfg, runtime)
    with runtime.strategy.scope():
        model = task.build_model("serve")
        if pretrained is not None:
            pretrained.load(model)
    if pretrained is None:
        path = checkpoint or CheckpointStore(os.path.expanduser(cfg.model_dir)).best_weights
        if not os.path.exists(path):
            from tfdp.commands.from_weights import no_checkpoint
            raise no_checkpoint(path)
        load_checkpoint(model, path, cfg)

    global_batch = cfg.train.batch_size_per_replica * runtime.num_replicas
    probabilities = getattr(tf.math, PROBABILITIES[cfg.train.loss])
    decoder = dali.choose(cfg.data, list(runtime.devices))
    if decoder == "dali":
        say("tfdp: data: images decoded and cropped by DALI on each replica's device (data.decoder)")
    # What an image the pipeline left out failed: the decoder's own check (with DALI, the one before it).
    check = evaluation_decoding(dataclasses.replace(cfg.data, decoder=decoder))[0]

    @tf.function
    def step(iterator):
        def replica(numbers, images):
            values, indices = tf.math.top_k(probabilities(tf.cast(model(images, training=False), tf.float32)), top_k)
            return numbers, values, indices
        return runtime.strategy.run(replica, args=next(iterator))

    def predict_part(local: list[str], bar) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Image number within `local` → its top-k (values, class indices)."""
        dataset = task.build_predict_inputs(local, global_batch, decoder)
        best = {}
        iterator = iter(dataset)
        with data_errors():   # DALI stopped by an image that passed its check: one line
            for _ in range(-(-len(local) // global_batch)):
                results = [np.concatenate([np.asarray(t) for t in runtime.strategy.experimental_local_results(part)])
                           for part in step(iterator)]
                for number, values, indices in zip(*results):
                    if number >= 0:
                        best[int(number)] = (values, indices)
                bar.update(int(np.sum(results[0] >= 0)))
        return best

    best: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    errors: dict[int, str] = {}
    CORRUPT_LOG.clear()  # this run's warnings: the first few of its own images
    start = time.monotonic()
    with _progress(len(files)) as bar, Downloads(files, parts, cfg.data.cache_dir) as downloads:
        for part, local in downloads:
            found = predict_part(local, bar)
            best.update({part[k]: v for k, v in found.items()})
            errors.update({part[k]: e for k, e in undecoded(local, found, check).items()})
    seconds = time.monotonic() - start
    for k, error in sorted(errors.items()):
        CORRUPT_LOG.record(files[k], error)
    rows = [_row(files[k], best.get(k), errors.get(k), names, text) for k in range(len(files))]
    atomic_write_text(job.output, job.write(rows, top_k))
    say(f"tfdp: predict: {len(files)} image(s) → {job.output}"
        + (f" ({len(errors)} could not be decoded)" if errors else "")
        + f", {len(files) / max(seconds, 1e-9):.0f} images/s on {runtime.num_replicas} replica(s)")
    return {"images": len(files), "failed": len(errors), "seconds": seconds, "chunks": len(parts)}


class Downloads:
    """The images of each range in `parts`, local: the next range downloads while one is read. With more
    than one range (bucket images larger than data.cache_limit), a range's copies are deleted once read, so
    the cache holds at most two ranges, each within half the limit."""

    def __init__(self, files: list[str], parts: list[range], cache_dir: str):
        import concurrent.futures
        self.files, self.parts, self.cache_dir = files, parts, cache_dir
        self.streamed = len(parts) > 1
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tfdp-predict-fetch")
        self._next = None

    def _fetch(self, part: range):
        return self._pool.submit(localize, [self.files[k] for k in part], self.cache_dir)

    def __enter__(self):
        return self

    def __iter__(self):
        self._next = self._fetch(self.parts[0])
        for i, part in enumerate(self.parts):
            local = self._next.result()
            self._next = self._fetch(self.parts[i + 1]) if i + 1 < len(self.parts) else None
            yield part, local
            if self.streamed:
                self._evict(part)

    def _evict(self, part: range) -> None:
        remote = [self.files[k] for k in part if is_remote_url(self.files[k])]   # copies, never the user's files
        for path in cache_paths(remote, self.cache_dir):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def __exit__(self, *exc):
        if self._next is not None:
            self._next.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)


def undecoded(local: list[str], predicted, transform) -> dict[int, str]:
    """Image number → why it could not be read or decoded, for every image of `local` the pipeline did not
    return."""
    from tfdp.startup.console import stderr_to_devnull
    with stderr_to_devnull():  # libjpeg's own complaint ("Improper call to JPEG library"): the reason is enough
        return {k: decode_error(local[k], transform) for k in range(len(local)) if k not in predicted}


class _progress:
    """tqdm's bar on a terminal; elsewhere nothing until the summary line."""

    def __init__(self, total: int):
        self.total = total
        self.bar = None

    def __enter__(self):
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, unit="img", desc="tfdp predict", file=sys.stderr)
        return self

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


# --- the output --------------------------------------------------------------

def _row(path: str, best, error: str | None, names: tuple[str, ...], text: tuple[str, ...]) -> dict:
    if best is None:
        return {"path": path, "predictions": [], "error": error}
    values, indices = best
    predictions = []
    for value, index in zip(values.tolist(), indices.tolist()):
        entry = {"class": int(index), "name": names[index] if names else str(index)}
        if text:
            entry["text"] = text[index]
        entry["probability"] = round(float(value), 6)
        predictions.append(entry)
    return {"path": path, "predictions": predictions, "error": None}


def _jsonl(rows: list[dict], top_k: int) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def _csv(rows: list[dict], top_k: int) -> str:
    """One line per image: path, error, then class/name/probability for ranks 1..top_k (empty on an error)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    with_text = any("text" in p for row in rows for p in row["predictions"])
    per_rank = ("class", "name", "text", "probability") if with_text else ("class", "name", "probability")
    writer.writerow(["path", "error"] + [f"{field}_{r}" for r in range(1, top_k + 1) for field in per_rank])
    for row in rows:
        cells = [row["path"], row["error"] or ""]
        for p in row["predictions"]:
            cells += [p.get(field, "") for field in per_rank]
        writer.writerow(cells + [""] * (2 + top_k * len(per_rank) - len(cells)))
    return out.getvalue()


# output extension → the text of the file
WRITERS: dict[str, Callable[[list[dict], int], str]] = {".jsonl": _jsonl, ".csv": _csv}


def read_rows(path: str) -> list[dict]:
    """The rows of a predictions file (JSONL or CSV) as `predict` wrote them (tests, notebooks)."""
    with open(path, encoding="utf-8") as f:
        if path.lower().endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        rows = []
        for cells in csv.DictReader(f):
            ranks = sorted({int(k.rsplit("_", 1)[1]) for k in cells if k.startswith("class_")})
            predictions = [{"class": int(cells[f"class_{r}"]), "name": cells[f"name_{r}"],
                            "probability": float(cells[f"probability_{r}"])} for r in ranks if cells[f"class_{r}"]]
            rows.append({"path": cells["path"], "predictions": predictions, "error": cells["error"] or None})
        return rows

