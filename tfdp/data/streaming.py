"""A training stream from a bucket through a bounded local cache (`data.cache_limit`).

`storage.localize` copies a pipeline's whole share before the first step: a
share larger than the local disk cannot train at all, and a large one waits
for its last byte before its first step. When the share is larger than
`data.cache_limit`, the training stream is fed through a `Stream` instead:

- The stream's order is a pure function of the seed and the position
  (`tfdp.data.order.epoch_payloads`), and building it reads no file (the
  readers, told the share is streamed, name records by shard and record
  number, not byte offset), so the stream builds the very payload stream the
  reader takes a second time (`open_stream` is handed the function that
  builds it) and its fetcher thread walks it (`follow`): it knows every file
  the reader will open, in order, from the stream's start position on (a
  resumed stream fetches nothing before it).
- The fetcher downloads each file once it is needed, in parallel threads,
  under a temporary name renamed when complete (`storage.fetch`), while the
  bytes of the files held (present or downloading) stay within the limit.
  It walks as far ahead as the limit allows: the limit is the window, and
  the first step waits for the first files, not for the share.
- A gate in front of the decoder (a `tf.py_function` per payload) waits for
  the payload's file, reads its bytes and releases it; a file is deleted when
  every read the fetcher has counted for it so far is done, so a file in use
  is never evicted, and a file read again later is fetched again then.
- The fetcher starts when the dataset is first iterated, and again from the
  stream's start at each new iteration (Keras may start an iterator, leave it
  and start another): only the newest iteration reads, and what an older one
  held is deleted. A stream built again for the same files (a new image size)
  replaces the old one at its own first read in the same way.
- A download that keeps failing is retried with backoff for RETRY_TIMEOUTS
  times `data.remote_timeout`; then the stream ends and its last element
  raises the one-line error (`ending`, which the decoding stage appends
  after it drops failed elements as corrupt images with `ignore_errors`, so
  an error raised by the gate itself would be swallowed): the restart
  status when the bucket stopped answering (the same command resumes from
  the last checkpoint), a user error when an object was deleted or changed
  size after the data was listed.

Evaluation streams its split the same way (`endless=False`: one pass in the
split's own order, which needs no seed, that ends cleanly). A training run
holds both streams at once (the training stream keeps its window full while
validation runs), so `data.cache_limit` is theirs together: the validation
stream may hold VALIDATION_PART of it and the training stream the rest
(`Part`). The tf.data service still copies its files whole (`localize`), as
does `data.cache`, which keeps the whole share in memory anyway; `tfdp
predict` goes through bucket images larger than the limit in chunks of its
own (`tfdp.commands.predict.Downloads`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import struct
import tempfile
import threading
import time
from typing import Any, Callable, ContextManager, Iterator

import numpy as np
import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.data import storage
from tfdp.data.layouts import Split
from tfdp.data.layouts.tfrecord import HEADER_BYTES, INTERLEAVE_CYCLE, LENGTH, record_offsets
from tfdp.data.layouts.webdataset import sample_table
from tfdp.errors import UserError, first_line

RETRY_TIMEOUTS = 6         # a failing download is retried for this many data.remote_timeout
FIRST_RETRY_S, LAST_RETRY_S = 0.5, 10.0
STALL_CHECK_S = 1.0        # how often a waiting reader looks for a stream that cannot move
STALL_CHECKS = 5           # ... and how many looks in a row find it stuck before it is an error
ORDER_BATCH = 4096         # payloads the fetcher takes from its copy of the stream at a time
VALIDATION_PART = 0.25     # of data.cache_limit: what a training run's validation stream may hold
ERROR_TAG = "tfdp-data-error: "   # what `pipeline.data_errors` turns into a one-line error
RESTART_TAG = "tfdp-data-unreachable: "   # ... and into the restart status: the bucket stopped answering

OPEN_STREAMS: dict[tuple, "Stream"] = {}   # (cache dir, files) → the stream now feeding them (tests read it)


@dataclasses.dataclass(frozen=True)
class Kind:
    """How one kind of split is streamed."""
    # local file → what reading a payload of it needs (records: their byte offsets)
    index: Callable[[str], Any]
    # (local file, payload's second element, index) → the bytes the decoder takes
    read: Callable[[str, int, Any], bytes]
    # (bytes, payload's second element) → the payload as the decoder takes it (`data.cache`'s shape)
    payload: Callable[[tf.Tensor, tf.Tensor], Any]
    # files of the share (sorted by size, largest first) → bytes that must fit in the cache at once
    at_once: Callable[[list[int]], int]


def _read_record(path: str, number: int, offsets: np.ndarray) -> bytes:
    with open(path, "rb") as f:
        f.seek(int(offsets[number]))
        header = f.read(HEADER_BYTES)
        return f.read(LENGTH.unpack(header[:LENGTH.size])[0])


def _read_sample(path: str, number: int, table: np.ndarray) -> bytes:
    """A tar sample's label (4 bytes, little-endian) and then its image bytes: the gate's one string carries
    both (`_labelled` parts them)."""
    offset, length, label = (int(v) for v in table[number])
    with open(path, "rb") as f:
        f.seek(offset)
        return LABEL_BYTES.pack(label) + f.read(length)


def _labelled(data: tf.Tensor, number: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    return (tf.strings.substr(data, LABEL_BYTES.size, -1),
            tf.io.decode_raw(tf.strings.substr(data, 0, LABEL_BYTES.size), tf.int32)[0])


def _read_file(path: str, label: int, index: Any) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _records_at_once(sizes: list[int]) -> int:
    """The interleave reads INTERLEAVE_CYCLE shards side by side, so that many must fit."""
    return sum(sizes[:INTERLEAVE_CYCLE])


KINDS: dict[str, Kind] = {
    "records": Kind(lambda path: record_offsets(path)[0], _read_record, lambda data, number: data,
                    _records_at_once),
    "tar": Kind(lambda path: sample_table(path)[0], _read_sample, _labelled, _records_at_once),
    "images": Kind(lambda path: None, _read_file, lambda data, label: (data, label), lambda sizes: sizes[0]),
}
LABEL_BYTES = struct.Struct("<i")


@dataclasses.dataclass(frozen=True)
class Part:
    """What share of data.cache_limit one stream may hold, and what to call it in an error."""
    fraction: float = 1.0
    name: str = ""   # "training", "validation": the stream's own share of a limit two streams split

    def of(self, limit: int) -> int:
        return int(limit * self.fraction)

    def divided(self, streams: int) -> "Part":
        """Each of `streams` training streams' share, when one process reads several (`tfdp.train.input_streams`)."""
        if streams == 1:
            return self
        return Part(self.fraction / streams, self.name or "training")

    def describe(self, limit: int) -> str:
        """How a message names this stream's room: the limit, or its share of it."""
        if self.fraction == 1:
            return f"data.cache_limit ({_human(limit)})"
        return (f"the {self.name} stream's {self.fraction:.0%} of data.cache_limit "
                f"({_human(self.of(limit))} of {_human(limit)})")


WHOLE = Part()


def run_parts(train_remote: bool, val_remote: bool) -> tuple[Part, Part]:
    """(training's, validation's) share of data.cache_limit in a run that trains: streams in a bucket
    split it (VALIDATION_PART for validation), a local split needs none."""
    if not (train_remote and val_remote):
        return WHOLE, WHOLE
    return (Part(1 - VALIDATION_PART, "training"), Part(VALIDATION_PART, "validation"))


def open_stream(share: Split, cfg: DataConfig, payloads: Callable[[bool], tf.data.Dataset], ordered: bool, *,
                endless: bool = True, part: Part = WHOLE) -> "Feed":
    """`share`'s payloads as the later stages read them (`Feed`), through the bounded cache (`part` of it)
    when the share is streamed from a bucket.

    `payloads(streamed)` builds the share's payloads (`tfdp.data.order`);
    the stream decides whether they are streamed, so it builds them itself:
    once for the reader and, when streamed, once more for its fetcher to
    follow. Nothing is streamed for local files, the tf.data service,
    `data.cache`, an order drawn at random where the stream runs (`ordered`
    false: the fetcher could not follow it), or a share within the limit
    (copied whole, by the readers, as always). `endless`: a training stream,
    which ends only when fetching failed; else one pass, which ends when the
    split does."""
    return _stream_for(share, cfg, ordered, endless, part).feed(payloads, cfg)


def _stream_for(share: Split, cfg: DataConfig, ordered: bool, endless: bool, part: Part) -> "Stream | NoStream":
    """The stream that feeds `share` from a bucket through the bounded cache, or NO_STREAM (`open_stream`)."""
    urls = tuple(share.files)
    if (share.kind not in KINDS or not ordered or cfg.cache or cfg.service_address
            or not urls or not storage.is_remote_url(urls[0])):
        return NO_STREAM
    sizes = storage.object_sizes(urls)
    local = dict(zip(urls, storage.cache_paths(urls, cfg.cache_dir)))
    there = storage.on_disk(local)
    total = storage.limit_bytes(cfg, sum(there.values()))
    limit = part.of(total)
    if sum(sizes.values()) <= limit:
        return NO_STREAM
    needed = KINDS[share.kind].at_once(sorted(sizes.values(), reverse=True))
    if needed > limit:
        what = "its largest file" if share.kind == "images" else "the largest shards the interleave reads at once"
        raise UserError(f"{part.describe(total)} is smaller than {what} in {cfg.dir} "
                        f"({_human(needed)}): raise data.cache_limit")
    key = (os.path.expanduser(cfg.cache_dir), urls)
    previous = OPEN_STREAMS.pop(key, NO_STREAM)
    kept = previous.holding()   # the stream replaced deletes its own at this one's first read
    for u in there:   # stale copies: the stream keeps what it holds within the limit
        if local[u] not in kept:
            with contextlib.suppress(FileNotFoundError):
                os.remove(local[u])
    stream = OPEN_STREAMS[key] = Stream(share.kind, {local[u]: (u, sizes[u]) for u in urls}, limit,
                                        cfg.remote_timeout, endless, part.describe(total), previous)
    return stream


def _human(size: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def close_all() -> None:
    """Stops every open stream and deletes what each holds (a finished run, a test)."""
    while OPEN_STREAMS:
        OPEN_STREAMS.popitem()[1].close()


@dataclasses.dataclass(frozen=True)
class Feed:
    """What the stages after the bounded cache take from it, as plain values, so none calls back into it:
    the payloads (read through the gate when streamed), the config decoding reads them with, what follows the
    decoded examples (`Stream.ending`; None when nothing is streamed), and url → a local copy of it, to name a
    corrupt image by (`tfdp.data.naming.corrupt_namer`)."""
    payloads: tf.data.Dataset
    decoding: DataConfig
    ending: tf.data.Dataset | None
    local_copy: Callable[[str], ContextManager[str]]


class NoStream:
    """A share not streamed: its payloads as the readers build them, from local copies."""

    def feed(self, payloads: Callable[[bool], tf.data.Dataset], cfg: DataConfig) -> Feed:
        """The payloads built once, not streamed: the readers copy the files whole (`storage.localize`); a
        corrupt image is named from its copy in data.cache_dir."""
        return Feed(payloads(False), cfg, None, functools.partial(self.local_copy, cache_dir=cfg.cache_dir))

    def holding(self) -> set[str]:
        return set()

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def local_copy(self, url: str, cache_dir: str) -> Iterator[str]:
        yield storage.localize([url], cache_dir)[0]


NO_STREAM = NoStream()


class StreamFailed(Exception):
    """The stream cannot go on; its message is the one-line error."""


class Stream(NoStream):
    """One training stream's files: fetched ahead in the stream's order, within `limit` bytes, read through
    the gate and deleted once read. `high_water` is the most bytes it ever held (downloads included) and
    `fetched` the objects it downloaded, in order."""

    def __init__(self, kind: str, files: dict[str, tuple[str, int]], limit: int, remote_timeout: float,
                 endless: bool = True, room: str = "", previous: NoStream = NO_STREAM):
        self.kind, self.limit, self.endless = KINDS[kind], limit, endless
        self.room = room or f"data.cache_limit ({_human(limit)})"   # what the messages call the limit
        self.url = {path: url for path, (url, _) in files.items()}
        self.size = {path: size for path, (_, size) in files.items()}
        self.retry_s = RETRY_TIMEOUTS * remote_timeout
        self.high_water, self.fetched = 0, []
        self._cond = threading.Condition()
        self._need: collections.Counter = collections.Counter()   # reads counted by the fetcher, not yet done
        self._index: dict[str, Any] = {}       # files present → what reading them needs
        self._downloading: set[str] = set()
        self._held = 0                          # bytes of files present or downloading
        self._walked = 0                        # payloads the fetcher has counted
        self._waiting_for: str | None = None    # the file the fetcher waits to have room for
        self._reading = 0
        self._error: str | None = None
        self._unreachable = False   # the error is the bucket's silence, not the data's fault: a restart may cure it
        self._stopped = False
        self._closed = threading.Event()
        # The stream this one replaces (the same files, rebuilt: a new image size, say). Its reader may still
        # drain what it prefetched, so it is closed, and this one starts fetching, at this one's first read.
        self.previous = previous
        self._order: tf.data.Dataset | None = None
        # Each iteration of the dataset (Keras may start more than one; only the newest is read) is a
        # generation of its own: its fetcher walks the order from the start, and what the last one held goes.
        self._generation = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(storage.DOWNLOAD_THREADS, "tfdp-stream-fetch")

    def feed(self, payloads: Callable[[bool], tf.data.Dataset], cfg: DataConfig) -> Feed:
        """The payloads built twice, streamed: the readers name the files where the stream will fetch them,
        records by number. One copy is read through the gate, the other walked by the fetcher to learn the
        order the files are read in (the order is a pure function of seed and position, so both are the same
        stream). The gate hands the decoder a file's bytes, as `data.cache` does, not its path."""
        read = payloads(True)
        self.follow(payloads(True))
        return Feed(self.gated(read), dataclasses.replace(cfg, cache=True), self.ending(),
                    functools.partial(self.local_copy, cache_dir=cfg.cache_dir))

    # --- the fetcher ---------------------------------------------------------

    def follow(self, order: tf.data.Dataset) -> None:
        """Fetches the files of `order` (the reader's payloads, built again) in its order, from the start of
        each iteration of the gated dataset (`_begin`)."""
        self._order = order.map(lambda *payload: payload[0]).batch(ORDER_BATCH)

    def _begin(self) -> np.int64:
        """A new iteration of the dataset: the stream this one replaces, and the last iteration's files, go
        (two would hold twice the limit); a fetcher starts at the stream's first payload."""
        self.previous.close()
        self.previous = NO_STREAM
        with self._cond:
            self._generation += 1
            self._need.clear()
            self._walked, self._waiting_for = 0, None
            for path in list(self._index):
                self._evict(path)
            self._cond.notify_all()
            generation = self._generation
        threading.Thread(target=self._walk, args=(self._order, generation), daemon=True,
                         name="tfdp-stream-order").start()
        return np.int64(generation)

    def holding(self) -> set[str]:
        """The files this stream holds: present or downloading."""
        with self._cond:
            return set(self._index) | self._downloading

    def _walk(self, paths: tf.data.Dataset, generation: int) -> None:
        try:
            for batch in paths.as_numpy_iterator():
                for path in batch:
                    if not self._admit(path.decode(), generation):
                        return
        except Exception as e:  # noqa: BLE001 - whatever stops the walk ends the stream with its reason
            self._fail(f"cannot follow the input stream's order: {first_line(e)}")

    def _admit(self, path: str, generation: int) -> bool:
        """Counts one more read of `path`, fetching it first if it is not held: when there is room."""
        with self._cond:
            if self._generation != generation:
                return False
            self._need[path] += 1
            if path not in self._index and path not in self._downloading:
                self._waiting_for = path
                while self._held + self.size[path] > self.limit and not self._over(generation):
                    self._cond.wait()
                if self._over(generation):
                    return False
                self._waiting_for = None
                self._held += self.size[path]
                self.high_water = max(self.high_water, self._held)
                self._downloading.add(path)
                self._pool.submit(self._fetch, path, generation)
            self._walked += 1
            self._cond.notify_all()
            return True

    def _over(self, generation: int) -> bool:
        return self._stopped or self._error is not None or self._generation != generation

    def _fetch(self, path: str, generation: int) -> None:
        url, delay, deadline = self.url[path], FIRST_RETRY_S, time.monotonic() + self.retry_s
        while not self._stopped:
            try:
                storage.fetch(url, path)
                if os.path.getsize(path) != self.size[path]:
                    return self._fail(f"{url} changed after the data was listed: {os.path.getsize(path)} bytes "
                                      f"now, {self.size[path]} listed")
                index = self.kind.index(path)
                break
            except UserError as e:   # the object vanished, or the local disk is full: no retry helps
                return self._fail(str(e))
            except FileNotFoundError:
                return self._fail(f"{url} is no longer in the bucket (deleted after the data was listed)")
            except Exception as e:  # noqa: BLE001 - the drivers' errors: retried, then reported in one line
                if time.monotonic() + delay > deadline:
                    return self._fail(f"cannot download {url} (retried for {self.retry_s:g} s, {RETRY_TIMEOUTS} "
                                      f"times data.remote_timeout): {first_line(e)}", unreachable=True)
                if self._closed.wait(delay):
                    break
                delay = min(2 * delay, LAST_RETRY_S)
        with self._cond:
            self._downloading.discard(path)
            self._index[path] = None if self._stopped else index
            if self._stopped or (generation != self._generation and not self._need[path]):
                self._evict(path)
            else:
                self.fetched.append(url)
            self._cond.notify_all()

    def _evict(self, path: str) -> None:
        if path in self._index:
            del self._index[path]
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            self._held -= self.size[path]
            self._cond.notify_all()

    def _fail(self, message: str, unreachable: bool = False) -> None:
        with self._cond:
            if self._error is None:
                self._error, self._unreachable = message, unreachable
            self._cond.notify_all()

    def close(self) -> None:
        """Stops fetching and deletes what this stream holds, once its downloads under way are done (a stream
        built anew replaces it)."""
        with self._cond:
            self._stopped = True
            self._closed.set()
            for path in list(self._index):
                self._evict(path)
            self._cond.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # --- the reader ----------------------------------------------------------

    def gated(self, ds: tf.data.Dataset) -> tf.data.Dataset:
        """Payloads (path, x) → the decoder's payloads of the file's bytes, each read when its file is there.

        The stream ends where the fetcher failed (`ending` then raises why).
        """
        def begin(_):
            return tf.reshape(tf.py_function(self._begin, [], tf.int64), [])

        def numbered(generation):
            return ds.enumerate().map(lambda number, payload: (generation, number, payload))

        def alive(generation, number, payload):
            return tf.reshape(tf.numpy_function(self._alive, [], tf.bool, stateful=True), [])

        def read(generation, number, payload):
            data = tf.py_function(self._read, [generation, number, payload[0], payload[1]], tf.string)
            return self.kind.payload(tf.reshape(data, []), payload[1])
        return tf.data.Dataset.range(1).map(begin).flat_map(numbered).take_while(alive).map(
            read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def ending(self) -> tf.data.Dataset:
        """What follows the decoded examples (`tfdp.data.decoding.decoded_examples`): nothing, or the
        fetcher's error, if it failed, raised after `ignore_errors`, so it reaches the user. An endless stream
        ends only when fetching failed (or was stopped); a pass that ended without an error ends there."""
        def failed(_):
            return tf.reshape(tf.py_function(self._check, [], tf.bool), [])
        return tf.data.Dataset.range(1).filter(failed)

    def _alive(self) -> np.bool_:
        return np.bool_(self._error is None and not self._stopped)

    def _check(self) -> np.bool_:
        """At the stream's end: raises why it failed; False (nothing more) after a whole pass."""
        if self._error is None and not self.endless:
            return np.bool_(False)
        raise StreamFailed((RESTART_TAG if self._unreachable else ERROR_TAG)
                           + (self._error or "the input stream was closed"))

    def _read(self, generation, number, path, x) -> bytes:
        path, generation = path.numpy().decode(), int(generation)
        index = self._acquire(generation, int(number), path)
        try:
            return self.kind.read(path, int(x), index)
        finally:
            self._release(path, generation)

    def _acquire(self, generation: int, number: int, path: str) -> Any:
        """Waits until the fetcher has counted payload `number` and its file is there."""
        with self._cond:
            stalls = 0
            while self._walked <= number or path not in self._index:
                if self._over(generation):
                    raise StreamFailed(self._error or "the input stream was closed or iterated anew")
                if self._cond.wait(STALL_CHECK_S):
                    continue
                stalls = stalls + 1 if self._stuck() else 0
                if stalls >= STALL_CHECKS:
                    self._error = (f"{self.room} cannot hold the files the input stream "
                                   f"reads at once (it holds {_human(self._held)} and needs "
                                   f"{_human(self.size[self._waiting_for])} more): raise data.cache_limit or "
                                   f"lower data.shuffle_buffer")
                    self._cond.notify_all()
            self._reading += 1
            return self._index[path]

    def _stuck(self) -> bool:
        """The fetcher waits for room that only reads could free, and no read or download is under way."""
        return self._waiting_for is not None and not self._downloading and self._reading == 0

    def _release(self, path: str, generation: int) -> None:
        with self._cond:
            self._reading -= 1
            if generation != self._generation:   # its needs went with its generation
                return
            self._need[path] -= 1
            if self._need[path] <= 0:
                del self._need[path]
                self._evict(path)

    @contextlib.contextmanager
    def local_copy(self, url: str, cache_dir: str) -> Iterator[str]:
        """A local copy of `url` to name a corrupt image by: the cached one while the stream holds it, else
        a temporary one outside data.cache_dir (the cache stays within its limit)."""
        path = storage.cache_paths([url], cache_dir)[0]
        with self._cond:
            held, generation = path in self._index, self._generation
            if held:
                self._need[path] += 1
                self._reading += 1
        if held:
            try:
                yield path
            finally:
                self._release(path, generation)
            return
        with tempfile.TemporaryDirectory(prefix="tfdp-named-") as scratch:
            copy = os.path.join(scratch, os.path.basename(path))
            storage.fetch(url, copy)
            yield copy
