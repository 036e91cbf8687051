"""A model_dir in a bucket (`gs://…`, `s3://…`): a local working copy, and uploads a crash never leaves half-read.

Object stores have no rename and no append, so the POSIX recipe of the rest
of tfdp (write a temporary name and rename it into place; rewrite
metrics.jsonl each epoch) does not carry over. A run whose model_dir is a
bucket works in a local copy under `scratch_dir` (bounded as a local
model_dir is: the newest checkpoints and the logs), and its chief uploads
what it writes there:

- a checkpoint: its objects, then `checkpoints/<name>/commit.json` last,
  listing every object with its size (Orbax's commit marker). A checkpoint
  counts only with its marker and every object at its listed size, so a
  run killed between the objects and the marker leaves one that is ignored
  and swept by the next run; pruning deletes the marker first;
- the metrics log: one object per epoch (`metrics/epoch-000003.jsonl`; read
  in name order they are metrics.jsonl);
- TensorBoard's event files: the complete records written since the last
  upload, each batch one more object named after its file and offset
  (TensorBoard reads every file whose name holds "tfevents", in name order);
- config.yaml, corrupt_images.txt, best.weights.h5 / best.json, a report,
  an export: whole objects, each uploaded when it changes.

So the bytes uploaded grow with the run, never by rewriting a growing file.
Every request retries with backoff for `train.upload_retry_seconds`; a
bucket that stays silent ends the run with the restart status (143), and the
same command resumes from the newest committed checkpoint. Other workers
than the chief download the checkpoint they resume from and upload nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from typing import Callable, TypeVar

from tfdp.config.model_dir import DEFAULT_SCRATCH_DIR, is_bucket
from tfdp.errors import StorageLost, UserError, first_line
from tfdp.startup.console import say

COMMIT = "commit.json"
CHECKPOINTS = "checkpoints"
METRICS = "metrics"
TENSORBOARD = "tensorboard"
WHOLE_FILES = ("config.yaml", "corrupt_images.txt")   # small files uploaded whole when they change
T = TypeVar("T")


class BucketLost(StorageLost):
    """The bucket holding model_dir stopped answering; the newest committed checkpoint is where to go on."""


def scratch_path(url: str, scratch_dir: str) -> str:
    """The chief's local working copy of the bucket run `url`: one folder per run, so a requeued job on the
    same host finds its own and two runs never share one."""
    digest = hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(os.path.expanduser(scratch_dir)), digest)


class Bucket:
    """The objects of one run in a bucket, by their paths relative to model_dir."""

    def __init__(self, url: str, retry_seconds: float = 120.0):
        from tfdp.data import storage
        self.url = url.rstrip("/")
        self.fs, root = storage.filesystem(self.url)   # one line if the endpoint or bucket is not there
        self.root = root.rstrip("/")
        self.retry_seconds = retry_seconds

    def remote(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def where(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """`call`, again with backoff while the bucket does not answer, for up to `retry_seconds`."""
        deadline = time.monotonic() + self.retry_seconds
        pause = 0.5
        while True:
            try:
                return call()
            except (FileNotFoundError, UserError):
                raise
            except PermissionError as e:
                raise UserError(f"cannot {what} in model_dir {self.url}: permission denied ({first_line(e)})"
                                ) from None
            except Exception as e:  # noqa: BLE001  connection refused, reset, timed out, 5xx: all worth a retry
                if time.monotonic() + pause > deadline:
                    raise BucketLost(f"the bucket of model_dir {self.url} did not answer for "
                                     f"{self.retry_seconds:.0f} s while trying to {what} ({first_line(e)})") from None
                time.sleep(pause)
                pause = min(pause * 2, 10.0)

    # Objects

    def put_file(self, local: str, rel: str) -> None:
        self._retry(f"write {rel}", lambda: self.fs.put_file(local, self.remote(rel)))

    def put_bytes(self, data: bytes, rel: str) -> None:
        self._retry(f"write {rel}", lambda: self.fs.pipe_file(self.remote(rel), data))

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self._retry(f"read {rel}", lambda: self.fs.cat_file(self.remote(rel)))
        except FileNotFoundError:
            return None

    def get_file(self, rel: str, local: str, size: int | None = None) -> None:
        """Downloads under a temporary name, renamed when complete at the expected size."""
        os.makedirs(os.path.dirname(local), exist_ok=True)
        tmp = f"{local}.tmp-{os.getpid()}"
        try:
            self._retry(f"read {rel}", lambda: self.fs.get_file(self.remote(rel), tmp))
            if size is not None and os.path.getsize(tmp) != size:
                raise UserError(f"{self.where(rel)} changed while it was read: {os.path.getsize(tmp)} bytes, "
                                f"{size} listed")
            os.replace(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def listing(self, rel: str) -> dict[str, int]:
        """{path relative to model_dir: size} of every object under `rel`, listed afresh (fsspec caches
        listings, and another writer may have changed them)."""
        def find():
            self.fs.invalidate_cache()
            return self.fs.find(self.remote(rel), detail=True)
        prefix = self.root + "/"
        found = self._retry(f"list {rel or 'model_dir'}", find)
        return {path[len(prefix):]: int(info.get("size") or 0) for path, info in found.items()
                if path.startswith(prefix) and info.get("type", "file") != "directory"}

    def remove(self, rels: list[str]) -> None:
        if rels:
            self._retry(f"delete {rels[0]}", lambda: self.fs.rm([self.remote(r) for r in rels]))

    def check_writable(self) -> None:
        """Writes and deletes one small object: no write permission is one line before any training."""
        rel = f".tfdp-write-check-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.pipe_file(self.remote(rel), b"")
            self.fs.rm(self.remote(rel))
        except Exception as e:  # noqa: BLE001  each store words a refusal its own way
            raise UserError(f"cannot write to model_dir {self.url}: {_refusal(e)}") from None

    # Checkpoints

    def checkpoints(self, warn: bool = True) -> tuple[list[tuple[int, int, str, dict]], list[str]]:
        """(committed checkpoints as (global step, 1 for an epoch checkpoint else 0, name, {object: size}),
        oldest first; names of the uncommitted ones). A marker whose objects are missing or of another
        size makes its checkpoint neither (skipped, with a warning if `warn`)."""
        groups: dict[str, dict[str, int]] = defaultdict(dict)
        for rel, size in self.listing(CHECKPOINTS).items():
            parts = rel.split("/")
            if len(parts) == 3:
                groups[parts[1]][parts[2]] = size
        committed, uncommitted = [], []
        for name, objects in sorted(groups.items()):
            if COMMIT not in objects:
                uncommitted.append(name)
                continue
            marker = self.read_bytes(f"{CHECKPOINTS}/{name}/{COMMIT}")
            try:
                commit = json.loads(marker or b"")
                files = {str(k): int(v) for k, v in commit["files"].items()}
                step, is_epoch = int(commit["step"]), int(name.startswith("epoch-"))
            except (ValueError, KeyError, TypeError, AttributeError):
                _warn(f"skipping checkpoint {self.where(f'{CHECKPOINTS}/{name}')}: its {COMMIT} cannot be read")
                continue
            wrong = [f"{f} ({objects.get(f, 'missing')}, {size} committed)" for f, size in sorted(files.items())
                     if objects.get(f) != size]
            if wrong:
                if warn:
                    _warn(f"skipping checkpoint {self.where(f'{CHECKPOINTS}/{name}')}: object(s) changed since "
                          f"it was committed: {', '.join(wrong)}")
                continue
            committed.append((step, is_epoch, name, files))
        return sorted(committed), uncommitted

    def push_checkpoint(self, local_dir: str, step: int) -> None:
        """Uploads a complete local checkpoint folder, its marker last."""
        name = os.path.basename(local_dir)
        files = {f: os.path.getsize(os.path.join(local_dir, f)) for f in sorted(os.listdir(local_dir))}
        for f in files:
            self.put_file(os.path.join(local_dir, f), f"{CHECKPOINTS}/{name}/{f}")
        marker = {"step": step, "files": files, "written": time.time()}
        self.put_bytes(json.dumps(marker, indent=1).encode(), f"{CHECKPOINTS}/{name}/{COMMIT}")

    def drop_checkpoint(self, name: str) -> None:
        """Deletes a checkpoint, its marker first: what a kill leaves behind is uncommitted, never half of one."""
        prefix = f"{CHECKPOINTS}/{name}"
        objects = sorted(self.listing(prefix))
        marker = f"{prefix}/{COMMIT}"
        if marker in objects:
            self.remove([marker])
        self.remove([o for o in objects if o != marker])

    def pull_checkpoint(self, name: str, files: dict[str, int], local_root: str) -> str:
        """Downloads a committed checkpoint into `local_root/name` (whole, or not at all)."""
        final = os.path.join(local_root, name)
        tmp = os.path.join(local_root, f".tmp-pull-{name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for f, size in files.items():
                self.get_file(f"{CHECKPOINTS}/{name}/{f}", os.path.join(tmp, f), size)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    # The metrics log

    def metrics_rows(self) -> list[dict]:
        """The run's metrics rows, oldest epoch first."""
        return self.rows(METRICS)

    def rows(self, prefix: str) -> list[dict]:
        """The rows of the one-row-per-object log under `prefix` (the metrics log, the evaluator's), in name order."""
        names = sorted(rel for rel in self.listing(prefix) if rel.endswith(".jsonl"))
        if not names:
            return []
        blobs = self._retry(f"read {prefix}/", lambda: self.fs.cat([self.remote(n) for n in names]))
        rows = []
        for name in names:
            blob = blobs[self.remote(name)]
            rows += [json.loads(line) for line in blob.decode().splitlines() if line.strip()]
        return rows


def metrics_object(epoch: int) -> str:
    return f"{METRICS}/epoch-{epoch:06d}.jsonl"


class Uploader:
    """The chief's side of a bucket run: uploads what it writes in its local working copy `local`.

    Uploads run on a thread of their own, in the order they were asked for, while training goes on: a
    checkpoint's objects and marker go up during the steps that follow it. The next checkpoint first waits
    for them (`wait`), before the local store prunes, so a folder is never deleted while it is read, and
    at most one checkpoint is in flight. An upload that failed is raised at that wait (or at `finish`).
    """

    def __init__(self, bucket: Bucket, local: str):
        import concurrent.futures
        self.bucket = bucket
        self.local = local
        from tfdp.rundir.metrics_file import METRICS_FILE, read_metrics
        # The rows pulled from the bucket are there already.
        self._epochs_sent = {int(r["epoch"]) for r in read_metrics(os.path.join(local, METRICS_FILE))}
        self._event_offsets: dict[str, int] = {}     # local event file → bytes of whole records uploaded
        self._whole_sent: dict[str, tuple[int, int]] = {}   # local file → (size, mtime_ns) uploaded
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tfdp-upload")
        self._pending: list = []

    def _submit(self, call: Callable[[], None]) -> None:
        self._pending.append(self._pool.submit(call))

    def wait(self) -> None:
        """Until every upload asked for is done; the first that failed is raised."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def finish(self, quiet: bool = False) -> None:
        """Waits for the uploads in flight (a preempted run's last checkpoint among them), then stops the thread.
        `quiet`: the run is already ending with an error, which an upload's failure must not hide (it is
        one warning line)."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001
            if not quiet:
                raise
            _warn(f"an upload to model_dir {self.bucket.url} did not finish: {first_line(e)}")
        finally:
            self._pool.shutdown(wait=True)

    def sync_logs(self) -> None:
        """Uploads new metrics rows, new TensorBoard records and changed small files."""
        from tfdp.rundir.metrics_file import METRICS_FILE, read_metrics
        for row in read_metrics(os.path.join(self.local, METRICS_FILE)):
            epoch = int(row["epoch"])
            if epoch not in self._epochs_sent:
                self.bucket.put_bytes((json.dumps(row) + "\n").encode(), metrics_object(epoch))
                self._epochs_sent.add(epoch)
        for name in WHOLE_FILES:
            self._put_if_changed(os.path.join(self.local, name), name)
        self.sync_events()

    def _put_if_changed(self, path: str, rel: str) -> None:
        if not os.path.isfile(path):
            return
        stat = os.stat(path)
        if self._whole_sent.get(path) != (stat.st_size, stat.st_mtime_ns):
            self.bucket.put_file(path, rel)
            self._whole_sent[path] = (stat.st_size, stat.st_mtime_ns)

    def sync_events(self) -> None:
        """Uploads the complete TensorBoard records written under `local`/tensorboard since the last call."""
        root = os.path.join(self.local, TENSORBOARD)
        for folder, _, files in os.walk(root):
            for f in sorted(files):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, self.local).replace(os.sep, "/")
                if "tfevents" not in f:
                    self._put_if_changed(path, rel)   # a profile: written once, whole
                    continue
                sent = self._event_offsets.get(path, 0)
                with open(path, "rb") as stream:
                    stream.seek(sent)
                    data = stream.read()
                end = whole_records(data)
                if end:
                    self.bucket.put_bytes(data[:end], f"{rel}.{sent:012d}")
                    self._event_offsets[path] = sent + end

    def publish_checkpoint(self, local_dir: str, step: int, kept: Callable[[list], list]) -> None:
        """The logs up to this checkpoint, then the checkpoint with its marker; then the bucket's own
        checkpoints pruned by `kept` (the rule the local store prunes by). In the background."""
        def publish():
            self.sync_logs()
            self.bucket.push_checkpoint(local_dir, step)
            committed, _ = self.bucket.checkpoints(warn=False)
            keep = {name for _, _, name in kept([(s, e, n) for s, e, n, _ in committed])}
            for _, _, name, _ in committed:
                if name not in keep:
                    self.bucket.drop_checkpoint(name)
        self._submit(publish)

    def publish_best(self, weights: str, record: str) -> None:
        """The best checkpoint's two files, in the background, from copies: the local ones are replaced
        whole when a better epoch comes."""
        folder = tempfile.mkdtemp(prefix=".tmp-best-upload-", dir=os.path.dirname(weights))
        copies = [shutil.copy(path, folder) for path in (weights, record)]

        def publish():
            try:
                for path in copies:
                    self.bucket.put_file(path, f"{CHECKPOINTS}/{os.path.basename(path)}")
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        self._submit(publish)


def whole_records(data: bytes) -> int:
    """Bytes of `data` made of whole TFRecord records (length, its CRC, payload, its CRC): an event file
    being written may end mid-record, and what is uploaded must not."""
    end = 0
    while end + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[end:end + 8])
        if end + 16 + length > len(data):
            break
        end += 16 + length
    return end


@dataclasses.dataclass
class Place:
    """Where a command finds its run: `local`, which is the model_dir itself or the local working copy of
    the bucket `bucket`."""
    model_dir: str
    local: str
    bucket: Bucket | None = None
    temporary: bool = False   # a folder of this command alone, removed by `close`

    def shown(self, text: str) -> str:
        """`text` (a message) with the local copy's paths written as the bucket objects they stand for: an
        operator reading the log finds them in the bucket, where the local copy is gone with the command."""
        if not self.bucket:
            return text
        return text.replace(self.local.rstrip(os.sep) + os.sep, self.bucket.url + "/").replace(self.local,
                                                                                               self.bucket.url)

    @property
    def lease_target(self) -> str:
        return self.bucket.url if self.bucket else self.local

    def uploader(self) -> Uploader | None:
        return Uploader(self.bucket, self.local) if self.bucket else None

    def pull_run(self, is_chief: bool) -> None:
        """Fills the local copy with what a run resumes from: the newest committed checkpoint, the best
        one, the metrics rows up to it and the TensorBoard run folders. The chief first sweeps
        uncommitted checkpoints (a run killed mid-upload) and metrics rows past the checkpoint (epochs the
        killed run finished but did not commit), as a local run drops them."""
        if not self.bucket:
            return
        bucket, local = self.bucket, self.local
        shutil.rmtree(local, ignore_errors=True)   # the bucket is the truth; this is a copy of it
        os.makedirs(local)
        committed, uncommitted = bucket.checkpoints()
        if is_chief and uncommitted:
            for name in uncommitted:
                bucket.drop_checkpoint(name)
            _say(f"tfdp: bucket: removed {len(uncommitted)} uncommitted checkpoint(s) a stopped run left "
                 f"({', '.join(uncommitted)})")
        root = os.path.join(local, CHECKPOINTS)
        os.makedirs(root)
        epoch = 0
        if committed:
            _, _, name, files = committed[-1]
            path = bucket.pull_checkpoint(name, files, root)
            with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
                epoch = int(json.load(f)["epoch"])
            for f in ("best.weights.h5", "best.json"):
                if (data := bucket.read_bytes(f"{CHECKPOINTS}/{f}")) is not None:
                    with open(os.path.join(root, f), "wb") as out:
                        out.write(data)
        rows = bucket.metrics_rows()
        if is_chief:
            bucket.remove([metrics_object(r["epoch"]) for r in rows if r["epoch"] > epoch])
        _write_rows(os.path.join(local, "metrics.jsonl"), [r for r in rows if r["epoch"] <= epoch])
        for rel in bucket.listing(TENSORBOARD):
            parts = rel.split("/")
            if len(parts) == 3:   # tensorboard/<run>/<events>: the run folder marks a restart
                os.makedirs(os.path.join(local, TENSORBOARD, parts[1]), exist_ok=True)

    def pull_outputs(self) -> None:
        """What evaluate, export, predict and report read: the best checkpoint, the config, the metrics (the
        evaluator's too)."""
        if not self.bucket:
            return
        root = os.path.join(self.local, CHECKPOINTS)
        os.makedirs(root, exist_ok=True)
        for rel in (f"{CHECKPOINTS}/best.weights.h5", f"{CHECKPOINTS}/best.json", "config.yaml"):
            if (data := self.bucket.read_bytes(rel)) is not None:
                with open(os.path.join(self.local, rel), "wb") as out:
                    out.write(data)
        _write_rows(os.path.join(self.local, "metrics.jsonl"), self.bucket.metrics_rows())
        from tfdp.rundir.metrics_file import EVAL_METRICS, EVAL_METRICS_FILE
        _write_rows(os.path.join(self.local, EVAL_METRICS_FILE), self.bucket.rows(EVAL_METRICS))

    def push_folder(self, name: str) -> str | None:
        """Uploads the local folder `name` (an export, a report) whole; its bucket URL, or None if absent."""
        folder = os.path.join(self.local, name)
        if not self.bucket or not os.path.isdir(folder):
            return None
        for base, _, files in os.walk(folder):
            for f in sorted(files):
                path = os.path.join(base, f)
                self.bucket.put_file(path, os.path.relpath(path, self.local).replace(os.sep, "/"))
        return self.bucket.where(name)

    def close(self) -> None:
        if self.temporary:
            shutil.rmtree(self.local, ignore_errors=True)


def place_for(model_dir: str, scratch_dir: str = DEFAULT_SCRATCH_DIR, *, own: bool = True,
              retry_seconds: float = 120.0) -> Place:
    """The `Place` of `model_dir`. A bucket run's local copy is the run's own folder under `scratch_dir` for
    its writer (`own`), and a fresh temporary folder there for a reader or another worker."""
    if not is_bucket(model_dir):
        return Place(model_dir, os.path.abspath(os.path.expanduser(model_dir)))
    bucket = Bucket(model_dir, retry_seconds)
    if own:
        return Place(model_dir, scratch_path(model_dir, scratch_dir), bucket)
    root = os.path.abspath(os.path.expanduser(scratch_dir))
    os.makedirs(root, exist_ok=True)
    return Place(model_dir, tempfile.mkdtemp(prefix="read-", dir=root), bucket, temporary=True)


def _write_rows(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _refusal(error: Exception) -> str:
    text = first_line(error)
    if isinstance(error, PermissionError) or "denied" in text.lower() or "forbidden" in text.lower() \
            or "403" in text:
        return f"permission denied ({text})"
    return text


def _warn(message: str) -> None:
    sys.stderr.write(f"tfdp: warning: {message}\n")
    sys.stderr.flush()


def _say(message: str) -> None:
    say(message)
