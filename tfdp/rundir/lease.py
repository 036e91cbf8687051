"""One writer per run: the chief holds a lease on model_dir while it trains.

Two `tfdp train` commands on one model_dir (a requeued job that starts while
the old attempt still runs, a second launch by mistake) would both append to
metrics.jsonl and mix their checkpoints. So before writing anything the chief
creates `model_dir/.tfdp-lease`, a small JSON record naming it (host, pid, the
process's start time, when it started, a run id), and a daemon thread renews
it every quarter of `train.lease_timeout`. A second run finds the record and
stops with one line naming the holder (exit 2), unless the holder is gone:

- same host, and its process is not alive (pid gone, or reused by another
  process: the record carries the process's start time from /proc), or
- another host, and it was not renewed for longer than its timeout.

Then the newcomer takes the lease over and says so in one line. A holder on
another host that looks alive is watched for up to its timeout: a renewal
proves it alive (refused at once), none proves it gone (taken over). The
lease is released (removed) on every way out of `train`: its end, a
preemption (exit 143), an error; only SIGKILL leaves one behind, and that is
what the take-over rules are for.

Creation is atomic everywhere, so two starting runs never both win: on local
disk (and NFS) every change happens under an flock on `.tfdp-lease.lock` and
the record is created with O_CREAT|O_EXCL; on GCS with the precondition
`ifGenerationMatch=0` (replacing: `=generation read`); on S3 with the
conditional put `If-None-Match: *` (replacing: `If-Match: ETag read`). A
taker or a renewal replaces only the exact version it read, so two takers of
one stale lease cannot both succeed, and a holder whose lease was taken over
finds out at its next renewal (one warning line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import socket
import threading
import time
import uuid
from urllib.parse import quote

from tfdp.errors import UserError, first_line

LEASE_FILE = ".tfdp-lease"
LOCK_FILE = ".tfdp-lease.lock"   # local disk: the flock every change of the lease happens under
RENEWALS_PER_TIMEOUT = 4         # a live holder renews this often within its timeout


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lease: what the lease file says."""
    host: str
    pid: int
    proc_start: int | None   # the process's start time (clock ticks since boot, /proc/PID/stat), None off Linux
    started: float           # unix time the run took the lease
    renewed: float           # unix time of its last renewal
    timeout: float           # seconds without renewal after which it counts as expired
    run_id: str
    job: str = ""            # the scheduler's job id, where there is one (Slurm)

    def text(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True) + "\n"

    @classmethod
    def parse(cls, text: str) -> "Holder | None":
        """The holder a lease file names; None for a file that is not a lease (damaged, edited)."""
        try:
            fields = json.loads(text)
            return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        job = f", job {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}, since {since}"


def process_stat(pid: int) -> tuple[str, int] | None:
    """Process `pid`'s state letter and start time (clock ticks since boot) from /proc/PID/stat, None where
    /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), None where /proc cannot say; tells a live holder
    from a dead one whose pid was reused, and from the same pid in a restarted container."""
    stat = process_stat(pid)
    return None if stat is None else stat[1]


# A process that has exited but is not yet reaped (Z) or is being torn down (X) holds no lease: it writes nothing
# more, and a parent that never reaps (a container's init that reaps nothing) would keep it listed for ever.
ENDED_STATES = ("Z", "X")


def process_alive(pid: int, start: int | None) -> bool:
    """Whether process `pid` on this host is the one that started at `start`, and still runs."""
    if os.path.isdir("/proc/self"):
        stat = process_stat(pid)
        return start is not None and stat is not None and stat[1] == start and stat[0] not in ENDED_STATES
    return process_exists(pid)


def process_exists(pid: int) -> bool:
    """Whether some process `pid` runs on this host (another user's counts: signal 0 is refused, not failed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_reason(holder: Holder | None, host: str, now: float) -> str:
    """Why a lease may be taken over; empty when its holder may still be running."""
    if holder is None:
        return "the lease file is not a lease (damaged or edited)"
    if holder.host == host:  # known for sure: alive (however long since its last renewal) or not
        return "" if process_alive(holder.pid, holder.proc_start) else f"its process (pid {holder.pid}) is gone"
    if now - holder.renewed > holder.timeout:
        return f"it was not renewed for {now - holder.renewed:.1f} s (timeout {holder.timeout:g} s)"
    return ""


class LocalStore:
    """The lease file on a local or network (NFS) file system; every change under an flock."""

    def __init__(self, model_dir: str):
        self.where = os.path.join(model_dir, LEASE_FILE)
        self._lock_path = os.path.join(model_dir, LOCK_FILE)

    @contextlib.contextmanager
    def _locked(self):
        import fcntl
        os.makedirs(os.path.dirname(self._lock_path), exist_ok=True)
        fd = os.open(self._lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _text(self) -> str | None:
        try:
            with open(self.where, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def read(self) -> tuple[str | None, object]:
        """(the lease's text or None, its version: what a replace must find to succeed)."""
        with self._locked():
            text = self._text()
        return text, text

    def create(self, text: str) -> object:
        """Writes the lease if there is none; its version, or None if one exists."""
        with self._locked():
            try:
                fd = os.open(self.where, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        return text

    def replace(self, text: str, version: object) -> object:
        """Replaces the lease if it is still at `version`; the new version, or None if it changed."""
        with self._locked():
            if self._text() != version:
                return None
            tmp = f"{self.where}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.where)
        return text

    def remove(self, version: object) -> None:
        """Removes the lease if it is still at `version` (a taken-over one is the new holder's)."""
        with self._locked():
            if self._text() == version:
                os.unlink(self.where)


class GcsStore:
    """The lease object in a GCS bucket, written with generation preconditions (gcsfs's own `mode="create"`
    only covers creation, so uploads are made here with `ifGenerationMatch` directly)."""

    def __init__(self, url: str):
        from tfdp.data import storage
        self.fs, path = storage.filesystem(url)
        self.where = f"gs://{path.rstrip('/')}/{LEASE_FILE}"
        self.bucket, self.key = f"{path.rstrip('/')}/{LEASE_FILE}".split("/", 1)

    def read(self):
        try:
            info = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, json_out=True)
            _, data = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media",
                                   ifGenerationMatch=info["generation"])
        except FileNotFoundError:
            return None, None
        except FileExistsError:  # replaced between the two requests: read again
            return self.read()
        return data.decode("utf-8", "replace"), info["generation"]

    def _upload(self, text: str, generation) -> object:
        try:
            out = self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
                               uploadType="media", name=self.key, ifGenerationMatch=str(generation),
                               headers={"Content-Type": "application/octet-stream"}, data=text.encode(), json_out=True)
        except FileExistsError:  # gcsfs's word for 412 Precondition Failed
            return None
        return out["generation"]

    def create(self, text: str) -> object:
        return self._upload(text, 0)

    def replace(self, text: str, version: object) -> object:
        return self._upload(text, version)

    def remove(self, version: object) -> None:
        with contextlib.suppress(FileNotFoundError, FileExistsError):
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=str(version))


class S3Store:
    """The lease object in an S3 bucket, written with conditional puts (If-None-Match / If-Match)."""

    def __init__(self, url: str):
        from tfdp.data import storage
        self.fs, path = storage.filesystem(url)
        self.where = f"s3://{path.rstrip('/')}/{LEASE_FILE}"
        self.bucket, self.key = f"{path.rstrip('/')}/{LEASE_FILE}".split("/", 1)

    def read(self):
        try:
            out = self.fs.call_s3("get_object", Bucket=self.bucket, Key=self.key)
        except FileNotFoundError:
            return None, None
        return _read_body(self.fs, out["Body"]).decode("utf-8", "replace"), out["ETag"]

    def _put(self, text: str, **condition) -> object:
        try:
            out = self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=text.encode(), **condition)
        except OSError as e:  # s3fs's words for 412 PreconditionFailed (and 409 ConditionalRequestConflict)
            if isinstance(e, FileExistsError) or e.errno == errno.EINVAL or "condition" in str(e).lower():
                return None
            raise
        return out["ETag"]

    def create(self, text: str) -> object:
        return self._put(text, IfNoneMatch="*")

    def replace(self, text: str, version: object) -> object:
        return self._put(text, IfMatch=version)

    def remove(self, version: object) -> None:
        _, now = self.read()
        if now == version:  # S3 deletes have no portable precondition: checked just before
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key)


def _read_body(fs, body) -> bytes:
    """The bytes of an aiobotocore streaming body, read on s3fs's event loop."""
    from fsspec.asyn import sync

    async def read():
        async with body as stream:
            return await stream.read()
    return sync(fs.loop, read)


# Bucket protocols with an atomic create and a conditional replace; everything else is a local path.
BUCKET_STORES = {"gs": GcsStore, "gcs": GcsStore, "s3": S3Store, "s3a": S3Store}


def store_for(model_dir: str):
    protocol = model_dir.split("://", 1)[0] if "://" in model_dir else ""
    if protocol in BUCKET_STORES:
        return BUCKET_STORES[protocol](model_dir)
    if protocol and protocol not in ("file", "local"):
        raise UserError(f"model_dir {model_dir}: no lease for {protocol}:// (tfdp supports local paths, gs:// "
                        f"and s3://)")
    return LocalStore(model_dir.split("://", 1)[-1])


class Lease:
    """The lease on `model_dir` of the run that holds it; a context manager (acquire, then release).

    `host` is this machine's name; given, it stands for another machine
    (tests of the take-over rules across hosts).
    """

    def __init__(self, model_dir: str, timeout: float = 60.0, host: str | None = None, say=print):
        self.store = store_for(model_dir)
        self.model_dir = model_dir
        self.timeout = timeout
        self.host = host or socket.gethostname()
        self.say = say
        self.holder: Holder | None = None
        self.lost = False
        self._version = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, started: float, renewed: float) -> Holder:
        pid = os.getpid()
        return Holder(self.host, pid, process_start(pid), started, renewed, self.timeout,
                      self.holder.run_id if self.holder else uuid.uuid4().hex[:12],
                      os.environ.get("SLURM_JOB_ID", ""))

    def acquire(self) -> "Lease":
        """Takes the lease, taking over a stale one (one line); a live holder is a one-line UserError."""
        now = time.time()
        mine = self._record(now, now)
        watched: Holder | None = None   # another host's live-looking holder, watched for a renewal
        while True:
            text, version = self.store.read()
            if text is None:
                self._version = self.store.create(mine.text())
                if self._version is not None:
                    return self._held(mine)
                continue  # another run created it meanwhile: look at it
            holder = Holder.parse(text)
            reason = stale_reason(holder, self.host, time.time())
            if reason:
                self._version = self.store.replace(mine.text(), version)
                if self._version is not None:
                    was = f" from {holder.describe()}" if holder else ""
                    self.say(f"tfdp: lease: took over model_dir {self.model_dir}{was}: {reason}", flush=True)
                    return self._held(mine)
                continue  # renewed or taken by another run meanwhile: look again
            if holder.host == self.host or (watched and holder != watched):
                self._refuse(holder)
            watched = watched or holder
            time.sleep(min(1.0, holder.timeout / 10))  # until it is renewed (alive) or expires (gone)

    def _refuse(self, holder: Holder) -> None:
        raise UserError(f"model_dir {self.model_dir} is in use by another run ({holder.describe()}; its lease "
                        f"{self.store.where} was renewed {max(time.time() - holder.renewed, 0):.0f} s ago): "
                        f"wait for it to end, or choose another model_dir")

    def _held(self, mine: Holder) -> "Lease":
        self.holder = mine
        self._thread = threading.Thread(target=self._heartbeat, name="tfdp-lease", daemon=True)
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        """Renews the lease until released; stops, with one warning, once another run has taken it over."""
        failed = False
        while not self._stop.wait(self.timeout / RENEWALS_PER_TIMEOUT):
            renewed = dataclasses.replace(self.holder, renewed=time.time())
            try:
                version = self.store.replace(renewed.text(), self._version)
            except Exception as e:  # noqa: BLE001  a bucket that does not answer for a while: try at the next beat
                if not failed:
                    self.say(f"tfdp: lease: warning: could not renew the lease {self.store.where}: {first_line(e)}",
                             flush=True)
                failed = True
                continue
            failed = False
            if version is None:
                self.lost = True
                text, _ = self.store.read()
                holder = Holder.parse(text) if text else None
                by = f" by {holder.describe()}" if holder else " (it was removed)"
                self.say(f"tfdp: lease: warning: the lease on model_dir {self.model_dir} was taken over{by}; "
                         f"this run is no longer its only writer", flush=True)
                return
            self._version, self.holder = version, renewed

    def release(self) -> None:
        """Stops renewing and removes the lease if it is still this run's."""
        self._stop.set()
        if self._thread:
            self._thread.join()
            self._thread = None
        if self.holder and not self.lost:
            try:
                self.store.remove(self._version)
            except Exception as e:  # noqa: BLE001  never hides the error the run is ending with
                self.say(f"tfdp: lease: warning: could not remove the lease {self.store.where}: {first_line(e)}",
                         flush=True)
        self.holder = None

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def writer_lease(model_dir: str, timeout: float, is_chief: bool):
    """The chief's lease on `model_dir` for the length of a `with`; nothing on the other workers, which
    write only into scratch directories."""
    return Lease(model_dir, timeout) if is_chief else contextlib.nullcontext()
