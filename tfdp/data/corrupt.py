"""Corrupt images by name: the first few in a warning, all of them in a file.

The pipeline counts an image that fails to decode from the gap it leaves in
the stream (`tfdp.data.batching.tallied`) and goes on without it. Counting
alone leaves the user hunting for the file, so when a gap appears the
pipeline asks which files the missing stream positions held (replaying the
stream's order, see `tfdp.data.naming.StreamNames`), decodes each once more
here to get TensorFlow's reason, and records it in `LOG`: the first
MAX_WARNINGS as warnings, every one in the file the trainer points the log at
(`model_dir/corrupt_images.txt`). `tfdp predict` records its undecodable
images here too, besides giving each its row. TensorFlow is imported only
where an image is decoded: commands load this module before TensorFlow's
start-up is quieted (`tfdp.startup.console`).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import weakref

from tfdp.errors import first_line

MAX_WARNINGS = 5
CORRUPT_FILE = "corrupt_images.txt"


def corrupt_images_file(model_dir: str, worker_index: int = 0) -> str:
    """Where a run's corrupt images are listed: one file per worker, each names its own share's."""
    name = CORRUPT_FILE if worker_index == 0 else f"corrupt_images.worker-{worker_index}.txt"
    return os.path.join(model_dir, name)


def decode_error(path: str, transform) -> str:
    """Why `transform` (encoded bytes, index → image) fails on the file at `path`: TensorFlow's first line.

    Runs once per corrupt image (`decodes`), so the message is the one the
    pipeline met (a truncated JPEG, an unknown format, an unreadable file).
    """
    import tensorflow as tf
    try:
        decodes(path, transform)
    except (tf.errors.OpError, ValueError) as e:
        line = re.sub(r"\s*\[Op:\w+\]( name:.*)?$", "", first_line(e))
        return _CHECKED.sub(r"\1", line) or type(e).__name__
    return "could not be decoded in the pipeline (decodes when read again: a file changed or an I/O error?)"


def decodes(path: str, transform) -> None:
    """Decodes the file at `path` with `transform` once, in a `tf.function` of its own; raises what it meets.

    Not eagerly: an eager op that fails aborts the rendezvous TensorFlow's
    eager ops share, and an op another thread is running at that moment on
    another device fails with this image's error instead (measured: building
    a `prefetch_to_device` stream on a second CPU failed in 310 of 440 tries
    beside a thread decoding a truncated JPEG eagerly, in none of 309 with
    the decode in a function). The pipeline calls this from its
    `tf.py_function` while other streams are being built: DALI's per-replica
    streams, the evaluation's, the next round's.
    """
    import tensorflow as tf
    with _LOCK:
        decode = _DECODES.get(transform)
        if decode is None:
            alive = weakref.ref(transform)   # the cache holds the transform weakly: its function must too
            decode = _DECODES[transform] = tf.function(
                lambda file: alive()(tf.io.read_file(file), tf.constant(0, tf.int64)), reduce_retracing=True)
    decode(tf.constant(path))


_LOCK = threading.Lock()
_DECODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # transform → its decode's tf.function


# A failed `tf.debugging.Assert` of tfdp's own (data.decoder dali's check) says only its message.
_CHECKED = re.compile(r"^assertion failed: \[(.*)\]$")


def name_trailing(files: list[str], missing: int, transform, log: "CorruptLog") -> None:
    """Names the corrupt images at the end of a finite stream (an evaluation's share), which no later image
    shows as a gap: from the last file backwards, each that fails to decode is recorded, until one decodes or
    `missing` are named. At most `missing` + 1 images are decoded again."""
    import tensorflow as tf
    for path in reversed(files):
        if missing <= 0 or path in log.entries:
            return
        try:
            decodes(path, transform)
            return
        except (tf.errors.OpError, ValueError):
            log.record(path, decode_error(path, transform))
            missing -= 1


class CorruptLog:
    """The corrupt images this process met, in the order met, each once, with the reason."""

    def __init__(self):
        self._lock = threading.Lock()
        self.entries: dict[str, str] = {}   # met by this run in this process: path → reason
        self.earlier: dict[str, str] = {}   # listed in the file before (a resumed run's earlier attempts)
        self.file: str | None = None

    def write_to(self, path: str) -> None:
        """A run's list: what `path` already names (the same run, resumed), then every image recorded from
        now on, the file rewritten atomically at each; images met by an earlier run in this process are
        forgotten."""
        with self._lock:
            self.file, self.entries, self.earlier = path, {}, {}
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    rows = (line.rstrip("\n").split("\t", 1) for line in f if line.strip())
                    self.earlier = {row[0]: (row[1] if len(row) > 1 else "") for row in rows}

    def close(self) -> None:
        """The run is over: what the process meets from now on is no longer its to list (another run, or any
        pipeline after it in this process, would otherwise write into a file that may be gone)."""
        with self._lock:
            self.file = None

    def clear(self) -> None:
        with self._lock:
            self.entries, self.earlier, self.file = {}, {}, None

    def record(self, path: str, error: str) -> None:
        with self._lock:
            if path in self.entries:
                return
            self.entries[path] = error
            count = len(self.entries)
            if count <= MAX_WARNINGS:
                _warn(f"corrupt image {path}: {error}")
            elif count == MAX_WARNINGS + 1:
                where = f": all of them are listed in {self.file}" if self.file else ""
                _warn(f"more than {MAX_WARNINGS} corrupt images; the rest are not named here{where}")
            if self.file:
                self._write()

    def _write(self) -> None:
        from tfdp.errors import atomic_write_text
        listed = {**self.earlier, **self.entries}
        atomic_write_text(self.file, "".join(f"{p}\t{e}\n" for p, e in listed.items()))


def _warn(message: str) -> None:
    sys.stderr.write(f"tfdp: warning: {message}\n")
    sys.stderr.flush()


LOG = CorruptLog()
