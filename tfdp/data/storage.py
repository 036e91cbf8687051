"""Where bytes live: local disk or a bucket (`gs://...`), through fsspec/gcsfs.

Sources list and read metadata through `filesystem()`, so every layout works
the same from a local path or a bucket. TensorFlow's own `gs://` support cannot
be pointed at anything but Google's endpoint (no emulator, no other stores),
so the pipeline never hands TensorFlow a remote path: `localize()` copies the
files a pipeline reads to a local cache on first use (in parallel, each file
written under a temporary name and renamed when complete), and every later
epoch or run reads them at local-disk speed.

A bucket whose endpoint cannot be reached fails the first `filesystem()` call
for it with one line naming the endpoint, within `data.remote_timeout`
seconds: gcsfs alone retries for ~40 s and then prints a traceback.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import socket
import threading
import urllib.parse
import urllib.request

import fsspec
import fsspec.utils

from tfdp.errors import UserError

LOCAL_PROTOCOLS = ("file", "local")
DOWNLOAD_THREADS = 16
DEFAULT_REMOTE_TIMEOUT = 20.0

_remote_timeout = DEFAULT_REMOTE_TIMEOUT
# (filesystem class, endpoint, bucket) → None when it answered, else the one-line error.
_probed: dict[tuple, str | None] = {}
_probe_lock = threading.Lock()


def configure(remote_timeout: float) -> None:
    """Sets how long a bucket's endpoint may take to answer its first request (data.remote_timeout)."""
    global _remote_timeout
    _remote_timeout = remote_timeout


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a local path or a URL such as gs://bucket/prefix.

    A remote bucket is checked to answer the first time it is seen, so an
    unreachable one is a one-line error, not a hang.
    """
    try:
        fs, path = fsspec.core.url_to_fs(os.path.expanduser(url))
    except (ImportError, ValueError) as e:
        raise UserError(f"cannot open {url}: {e}") from None
    if is_remote(fs):
        _check_reachable(fs, path, url)
    return fs, path


def endpoint(fs: fsspec.AbstractFileSystem) -> str | None:
    """The server a remote filesystem talks to (gcsfs: STORAGE_EMULATOR_HOST or Google's), if it says."""
    location = getattr(fs, "_location", None)
    return location if isinstance(location, str) and "://" in location else None


def _check_reachable(fs: fsspec.AbstractFileSystem, path: str, url: str) -> None:
    """Raises a one-line `UserError` if the bucket's endpoint refuses or stays silent; probes once per bucket."""
    where = endpoint(fs)
    bucket = fs._strip_protocol(path).split("/", 1)[0]
    key = (type(fs), where, bucket)
    with _probe_lock:
        if key not in _probed:
            _probed[key] = _probe(fs, bucket, where or url, _remote_timeout)
        error = _probed[key]
    if error:
        raise UserError(f"{error} (reading {url})")


def _probe(fs: fsspec.AbstractFileSystem, bucket: str, where: str, seconds: float) -> str | None:
    """None if the endpoint answers a request about `bucket` within `seconds`, else what went wrong.

    A refused connection is known at once (a plain TCP connect, unless a proxy
    stands between); silence needs the deadline. Any answer counts, even "no
    such bucket": reporting that is the caller's job.
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

    def ask() -> None:
        try:
            fs.info(bucket)
        except Exception:  # noqa: BLE001 - any answer means the endpoint is there
            pass
        done.set()
    threading.Thread(target=ask, daemon=True, name="tfdp-storage-probe").start()
    if not done.wait(seconds):
        return f"storage endpoint {where} did not answer within {seconds:g} s (data.remote_timeout)"
    return None


def _direct_address(where: str) -> tuple[str, int] | None:
    """(host, port) of an http(s) endpoint reached without a proxy; None when a TCP connect proves nothing."""
    parts = urllib.parse.urlsplit(where)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname):
        return None
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def is_remote(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return not set(protocols) & set(LOCAL_PROTOCOLS)


def url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A path as the user would write it (gs://bucket/x for remote files, /x locally)."""
    return fs.unstrip_protocol(path) if is_remote(fs) else path


def localize(urls: list[str] | tuple[str, ...], cache_dir: str) -> list[str]:
    """Local paths for `urls`: local files as they are, remote files copied into `cache_dir` once.

    A cached copy is reused when its size matches the remote object, so an
    interrupted copy (which never reaches its final name anyway) or a changed
    object is fetched again.
    """
    # The protocol from the string alone: building a filesystem per path would cost
    # seconds for a million-image tree.
    remote = [u for u in urls if fsspec.utils.get_protocol(u) not in LOCAL_PROTOCOLS]
    if not remote:
        return list(urls)
    cache_dir = os.path.expanduser(cache_dir)
    local = {u: _cache_path(cache_dir, u) for u in remote}
    with concurrent.futures.ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        list(pool.map(lambda u: _fetch(u, local[u]), remote))
    return [local.get(u, u) for u in urls]


def _cache_path(cache_dir: str, remote_url: str) -> str:
    scheme, _, rest = remote_url.partition("://")
    return os.path.join(cache_dir, scheme, rest)


def _fetch(remote_url: str, local_path: str) -> None:
    fs, path = filesystem(remote_url)
    size = fs.size(path)
    if os.path.exists(local_path) and os.path.getsize(local_path) == size:
        return
    os.makedirs(os.path.dirname(local_path), exist_ok=True)
    tmp = f"{local_path}.tmp-{os.getpid()}-{hashlib.sha1(remote_url.encode()).hexdigest()[:8]}"
    try:
        fs.get_file(path, tmp)
        os.replace(tmp, local_path)
    except FileNotFoundError:
        raise UserError(f"file vanished while copying: {remote_url}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

