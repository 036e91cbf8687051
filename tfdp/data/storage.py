"""Where bytes live: local disk or a bucket (`gs://...`, `s3://...`), through fsspec.

Sources list and read metadata through `filesystem()`, so every layout works
the same from a local path or a bucket of any store fsspec has a driver for
(gcsfs, s3fs: AWS, MinIO, Ceph, ...). Each driver finds its endpoint and
credentials its own way (gcsfs: STORAGE_EMULATOR_HOST, application default
credentials; s3fs through botocore: AWS_ENDPOINT_URL(_S3), AWS_ACCESS_KEY_ID,
~/.aws/config); tfdp adds no settings of its own. TensorFlow's own bucket
support cannot be pointed at anything but Google's endpoint (no emulator, no
other stores), so the pipeline never hands TensorFlow a remote path:
`localize()` copies the files a pipeline reads to a local cache on first use
(in parallel, each file written under a temporary name and renamed when
complete), and every later epoch or run reads them at local-disk speed. A
training share larger than `data.cache_limit` is streamed through a bounded
cache instead (`tfdp.data.streaming`).

The first `filesystem()` call for a bucket asks its endpoint about it, within
`data.remote_timeout` seconds, and turns what goes wrong into one line naming
the endpoint and the bucket: unreachable, silent, access denied, no such
bucket, no credentials. The drivers alone retry for ~40 s and then print a
traceback, or fail much later, deep in a listing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import operator
import os
import shutil
import socket
import threading
import urllib.parse
import urllib.request

import fsspec
import fsspec.utils

from tfdp.config import DataConfig, byte_size
from tfdp.errors import UserError, first_line

LOCAL_PROTOCOLS = ("file", "local")
# Where a driver says which server it talks to: an attribute path on its filesystem object.
# gcsfs: STORAGE_EMULATOR_HOST or Google's. s3fs: its botocore client's, resolved from
# AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / ~/.aws/config, else AWS's for the region.
ENDPOINT_ATTRIBUTES = {"gs": "_location", "s3": "s3.meta.endpoint_url", "hf": "endpoint"}
# How many leading parts of a path name what a store answers for as a whole (its bucket): one, but on the Hugging
# Face Hub a repository, datasets/ORG/NAME (and ORG/NAME for a model's).
HUB_KINDS = ("datasets", "spaces", "buckets")
DOWNLOAD_THREADS = 16
AUTO_FRACTION = 0.5   # data.cache_limit auto: this share of the free space of data.cache_dir at start
DEFAULT_REMOTE_TIMEOUT = 20.0

_remote_timeout = DEFAULT_REMOTE_TIMEOUT
# (filesystem class, endpoint, bucket) → None when it answered, else the one-line error.
_probed: dict[tuple, str | None] = {}
_probe_lock = threading.Lock()
_probe_locks: dict[tuple, threading.Lock] = {}   # one per bucket: a bucket is probed once, by one thread


# url → bytes of the bucket objects a listing has seen (`note_sizes`): a streamed share's sizes, without
# listing the bucket again or keeping fsspec's listing cache of a dict per object.
_known_sizes: dict[str, int] = {}


def note_sizes(pairs) -> None:
    """Remembers (url, size) pairs a listing returned."""
    _known_sizes.update((u, int(size)) for u, size in pairs)


def known_size(remote_url: str) -> int | None:
    return _known_sizes.get(remote_url)


def _gcs_emulator_defaults() -> None:
    """Turns off gcsfs's bucket-type lookup when an emulator stands in for GCS.

    gcsfs asks a GCS endpoint for the bucket type over gRPC first; an emulator
    (STORAGE_EMULATOR_HOST) never answers and each bucket access hangs ~60 s.
    gcsfs reads the switch once, when fsspec first imports it for a gs:// URL,
    so this runs when this module is imported and again before each URL is
    opened (an emulator may be set up after the import). The user's own
    setting wins.
    """
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


_gcs_emulator_defaults()


def configure(remote_timeout: float) -> None:
    """Sets how long a bucket's endpoint may take to answer its first request (data.remote_timeout)."""
    global _remote_timeout
    _remote_timeout = remote_timeout


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a local path or a URL such as gs://bucket/prefix or s3://bucket/prefix.

    A remote bucket is checked the first time it is seen, so an unreachable,
    forbidden or missing one is a one-line error, not a hang or a traceback.
    """
    _gcs_emulator_defaults()
    try:
        fs, path = fsspec.core.url_to_fs(os.path.expanduser(url))
    except (ImportError, ValueError) as e:
        raise UserError(f"cannot open {url}: {e}") from None
    except OSError as e:   # a protocol whose driver connects as it is made (ftp://, hdfs://, sftp://)
        raise UserError(f"cannot open {url}: {first_line(e)}") from None
    if is_remote(fs):
        _check_reachable(fs, path, url)
    return fs, path


def endpoint(fs: fsspec.AbstractFileSystem) -> str | None:
    """The server a remote filesystem talks to, if its driver says (see ENDPOINT_ATTRIBUTES).

    s3fs builds its client to answer (no request is sent); a client that cannot
    be built says nothing here, and the probe reports why.
    """
    attribute = next((ENDPOINT_ATTRIBUTES[p] for p in _protocols(fs) if p in ENDPOINT_ATTRIBUTES), None)
    if attribute is None:
        return None
    try:
        where = operator.attrgetter(attribute)(fs)
    except Exception:  # noqa: BLE001 - e.g. botocore's unknown profile; the probe meets it again and says so
        return None
    return where if isinstance(where, str) and "://" in where else None


def _check_reachable(fs: fsspec.AbstractFileSystem, path: str, url: str) -> None:
    """Raises a one-line `UserError` if the bucket's endpoint refuses, stays silent, denies access or has no
    such bucket; probes once per bucket and process (later calls are dictionary lookups)."""
    where = endpoint(fs)
    bucket = bucket_of(fs, path)
    key = (type(fs), where, bucket)
    with _probe_lock:   # held for a lookup only: a silent bucket's probe must not hold up another bucket's
        lock = _probe_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _probed:
            _probed[key] = _probe(fs, bucket, path, where or url, _remote_timeout)
        error = _probed[key]
    if error:
        raise UserError(f"{error} (reading {url})")


def bucket_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The part of `path` a store answers for as a whole: a bucket, a Hub repository (`HUB_KINDS`)."""
    parts = fs._strip_protocol(path).split("/")
    if "hf" not in _protocols(fs):
        return parts[0]
    return "/".join(parts[:3 if parts[0] in HUB_KINDS else 2])


def _probe(fs: fsspec.AbstractFileSystem, bucket: str, path: str, where: str, seconds: float) -> str | None:
    """None if the endpoint answers that `bucket` is there for us within `seconds`, else what went wrong.

    A refused connection is known at once (a plain TCP connect, unless a proxy
    stands between); silence needs the deadline. The answer itself is judged
    by `_bucket_problem`.
    """
    address = _direct_address(where)
    if address:
        try:
            socket.create_connection(address, timeout=seconds).close()
        except socket.timeout:
            return f"storage endpoint {where} did not accept a connection within {seconds:g} s (data.remote_timeout)"
        except OSError as e:
            return f"cannot reach storage endpoint {where}: {e.strerror or e}"
    done = threading.Event()
    problem: list[str | None] = []

    def ask() -> None:
        problem.append(_bucket_problem(fs, bucket, path, where))
        done.set()
    threading.Thread(target=ask, daemon=True, name="tfdp-storage-probe").start()
    if not done.wait(seconds):
        return f"storage endpoint {where} did not answer within {seconds:g} s (data.remote_timeout)"
    return problem[0]


def _bucket_problem(fs: fsspec.AbstractFileSystem, bucket: str, path: str, where: str) -> str | None:
    """What the endpoint's answer about `bucket` says stands in the way, in one line; None when nothing does.

    One request when all is well. The drivers turn the stores' answers into
    OSErrors: FileNotFoundError and PermissionError are the two this can word
    better than the listing that would meet them later; any other answer means
    the endpoint is there, and what the data lacks is the caller's to report.
    An exception that is no OSError means the driver could not even ask (no
    credentials, an unknown profile, an invalid bucket name).
    """
    try:
        fs.info(bucket)
        return None
    except FileNotFoundError as e:
        if "hf" in _protocols(fs):
            return _hub_problem(e, bucket, where)
        return None if _exists_anyway(fs, bucket) else f"bucket {bucket} does not exist at {where}"
    except PermissionError:
        denied = _denied(fs, path)
        return f"access denied to bucket {bucket} at {where} (check the credentials): {denied}" if denied else None
    except OSError:
        return None
    except Exception as e:  # noqa: BLE001 - the driver's own error types; their message is the line
        return f"cannot access bucket {bucket} at {where}: {_one_line(e)}"


def _hub_problem(error: FileNotFoundError, repo: str, where: str) -> str:
    """huggingface_hub's reason behind `HfFileSystem`'s FileNotFoundError for a repository, in tfdp's words."""
    reason = type(error.__cause__).__name__
    if reason == "GatedRepoError":
        return (f"the Hugging Face Hub repository {repo} at {where} is gated: accept its conditions on its page, then "
                f"set HF_TOKEN to a token of that account")
    if reason == "RevisionNotFoundError":
        return f"the Hugging Face Hub repository {repo} at {where} has no such revision"
    return (f"no Hugging Face Hub repository {repo} at {where} (or it is private: set HF_TOKEN; a dataset's URL is "
            f"hf://datasets/ORG/NAME)")


def _exists_anyway(fs: fsspec.AbstractFileSystem, bucket: str) -> bool:
    """Whether a bucket reported missing lists anyway: gcsfs, without the right to read a bucket's
    metadata, cannot tell an empty bucket from a missing one, and falls back to listing it."""
    try:
        fs.ls(bucket, detail=False)
    except FileNotFoundError:
        return False
    except Exception:  # noqa: BLE001 - any other answer: it is there
        pass
    return True


def _denied(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """The store's reason when `path` itself cannot be listed, else None.

    A policy may deny the bucket's root yet allow a prefix, so a denial there
    is confirmed on the path the user gave; a listing also carries the store's
    own reason (an unknown key, a bad signature), which a HEAD request cannot.
    """
    try:
        fs.ls(path, detail=False)
    except PermissionError as e:
        return _one_line(e) or "permission denied"
    except Exception:  # noqa: BLE001 - missing, or another answer: not a denial
        pass
    return None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _direct_address(where: str) -> tuple[str, int] | None:
    """(host, port) of an http(s) endpoint reached without a proxy; None when a TCP connect proves nothing."""
    parts = urllib.parse.urlsplit(where)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname):
        return None
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def is_remote(fs: fsspec.AbstractFileSystem) -> bool:
    return not set(_protocols(fs)) & set(LOCAL_PROTOCOLS)


def url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A path as the user would write it (gs://bucket/x or s3://bucket/x for remote files, /x locally)."""
    return fs.unstrip_protocol(path) if is_remote(fs) else path


def localize(urls: list[str] | tuple[str, ...], cache_dir: str, fresh: bool = False) -> list[str]:
    """Local paths for `urls`: local files as they are, remote files copied into `cache_dir` once.

    A cached copy is reused when its size matches the remote object, so an
    interrupted copy (which never reaches its final name anyway) or a changed
    object is fetched again. `fresh`: every file is fetched again (objects that
    may change at the same size, a run's best checkpoint), replacing its copy
    in one rename, so a reader never meets half a file.
    """
    remote = [u for u in urls if is_remote_url(u)]
    if not remote:
        return list(urls)
    local = dict(zip(remote, cache_paths(remote, cache_dir)))
    with concurrent.futures.ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        list(pool.map(lambda u: fetch(u, local[u], fresh), remote))
    return [local.get(u, u) for u in urls]


def cache_paths(urls: list[str] | tuple[str, ...], cache_dir: str) -> list[str]:
    """Where `localize` keeps each of `urls` under `cache_dir` (local files: where they are). Nothing is read."""
    cache_dir = os.path.expanduser(cache_dir)
    return [_cache_path(cache_dir, u) if is_remote_url(u) else u for u in urls]


def object_sizes(urls: tuple[str, ...]) -> dict[str, int]:
    """Each object's size: as the data's listing saw it (`note_sizes`), else from one listing of the
    folder the others share (a request per object would take minutes for a million images)."""
    sizes = {u: known_size(u) for u in urls}
    missing = [u for u, size in sizes.items() if size is None]
    if not missing:
        return sizes
    fs, _ = filesystem(missing[0])
    paths = [u.partition("://")[2] for u in missing]
    common = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    listed = {p: info["size"] for p, info in fs.find(common, detail=True).items()}
    sizes.update({u: listed[p] if p in listed else fs.size(p) for u, p in zip(missing, paths)})
    return sizes


def on_disk(local: dict[str, str]) -> dict[str, int]:
    """url → size of its copy in the cache, for those there (`local`: url → its cache path; a stream being
    replaced may delete some meanwhile)."""
    sizes = {}
    for url, path in local.items():
        with contextlib.suppress(FileNotFoundError):
            sizes[url] = os.path.getsize(path)
    return sizes


def limit_bytes(cfg: DataConfig, reclaimable: int = 0) -> int:
    """data.cache_limit in bytes: what a bounded cache (`tfdp.data.streaming`) or `tfdp predict`'s chunks may
    hold in data.cache_dir; auto is AUTO_FRACTION of its free space, counting the copies already there that
    the holder may replace (`reclaimable`) as free."""
    limit = byte_size(cfg.cache_limit)
    if limit is not None:
        return limit
    where = os.path.expanduser(cfg.cache_dir)
    while not os.path.isdir(where):
        where = os.path.dirname(where) or "."
    return int(AUTO_FRACTION * (shutil.disk_usage(where).free + reclaimable))


def is_remote_url(url: str) -> bool:
    """Whether `url` names a bucket object, from the string alone (no filesystem is built, and a plain path,
    with no protocol separator, is not even parsed: cheap for a million-image tree)."""
    return ("://" in url or "::" in url) and fsspec.utils.get_protocol(url) not in LOCAL_PROTOCOLS


def mirror(prefix_url: str, cache_dir: str) -> tuple[int, int]:
    """Copies every file under the bucket prefix `prefix_url` into `cache_dir`, laid out as `localize` lays
    them out, so paths made by `cache_paths` elsewhere find them here; (files, bytes). Files already
    there at their remote size are kept."""
    fs, path = filesystem(prefix_url)
    if not is_remote(fs):
        raise UserError(f"only a bucket can be mirrored (gs://..., s3://...), got {prefix_url}")
    sizes = {p: info["size"] for p, info in fs.find(path, detail=True).items()}
    if not sizes:
        raise UserError(f"nothing to mirror: no files under {prefix_url}")
    localize([fs.unstrip_protocol(p) for p in sizes], cache_dir)
    return len(sizes), sum(sizes.values())


def _cache_path(cache_dir: str, remote_url: str) -> str:
    scheme, _, rest = remote_url.partition("://")
    return os.path.join(cache_dir, scheme, rest)


def fetch(remote_url: str, local_path: str, fresh: bool = False) -> None:
    """Copies one bucket object to `local_path` under a temporary name, renamed when complete (so no reader
    ever meets half a file); a copy already there at the object's size is kept unless `fresh`. The size is the
    listing's when the data was listed in this process (no request per object), else the store's."""
    fs, path = filesystem(remote_url)
    size = known_size(remote_url)
    try:
        size = fs.size(path) if size is None else size
    except FileNotFoundError:
        raise UserError(f"{remote_url} is no longer in the bucket (deleted after the data was listed)") from None
    if not fresh and os.path.exists(local_path) and os.path.getsize(local_path) == size:
        return
    os.makedirs(os.path.dirname(local_path), exist_ok=True)
    tmp = f"{local_path}.tmp-{os.getpid()}-{hashlib.sha1(remote_url.encode()).hexdigest()[:8]}"
    try:
        fs.get_file(path, tmp)
        got = os.path.getsize(tmp)
        if got != size:
            if fs.size(path) == got:   # the object itself changed
                raise UserError(f"{remote_url} changed after the data was listed: {got} bytes now, {size} listed")
            raise OSError(f"short download of {remote_url}: {got} of {size} bytes")   # a connection cut short
        os.replace(tmp, local_path)
    except FileNotFoundError:
        raise UserError(f"{remote_url} is no longer in the bucket (deleted after the data was listed)") from None
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        free = shutil.disk_usage(os.path.dirname(local_path)).free
        raise UserError(f"no space left on the device of {os.path.dirname(local_path)} while copying {remote_url} "
                        f"({size} bytes; {free} bytes free): free space there or lower data.cache_limit (a share above "
                        f"it streams)") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
