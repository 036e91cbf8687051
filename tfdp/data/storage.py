"""Where bytes live: local disk or a bucket (`gs://...`), through fsspec/gcsfs.

Sources list and read metadata through `filesystem()`, so every layout works
the same from a local path or a bucket. TensorFlow's own `gs://` support cannot
be pointed at anything but Google's endpoint (no emulator, no other stores),
so the pipeline never hands TensorFlow a remote path: `localize()` copies the
files a pipeline reads to a local cache on first use (in parallel, each file
written under a temporary name and renamed when complete), and every later
epoch or run reads them at local-disk speed.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import struct

import fsspec
import fsspec.utils

from tfdp.errors import UserError

LOCAL_PROTOCOLS = ("file", "local")
DOWNLOAD_THREADS = 16


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a local path or a URL such as gs://bucket/prefix."""
    try:
        fs, path = fsspec.core.url_to_fs(os.path.expanduser(url))
    except (ImportError, ValueError) as e:
        raise UserError(f"cannot open {url}: {e}") from None
    return fs, path


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


# TFRecord framing: uint64 length, uint32 crc of the length, data, uint32 crc of the data.
LENGTH = struct.Struct("<Q")
HEADER_BYTES, FOOTER_BYTES = LENGTH.size + 4, 4


def first_record(file_url: str) -> bytes | None:
    """The first record of a TFRecord file, local or remote (a few bytes read, nothing copied)."""
    fs, path = filesystem(file_url)
    size = fs.size(path)
    if size == 0:
        return None
    with fs.open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
        length = LENGTH.unpack(header[:LENGTH.size])[0] if len(header) == HEADER_BYTES else size
        if HEADER_BYTES + length + FOOTER_BYTES > size:
            raise UserError(f"truncated TFRecord file: {file_url} (first record cut short)")
        return f.read(length)


def count_records(path: str) -> int:
    """Number of records in a local TFRecord file, read from the length headers only.

    Seeking over each record's data makes counting a 140 GB ImageNet cost
    seconds, not a full read.
    """
    count, cut = readable_records(path)
    if cut is not None:
        raise UserError(f"truncated TFRecord file: {path} (record {count} {cut})")
    return count


def readable_records(path: str) -> tuple[int, str | None]:
    """(complete records at the start of a local TFRecord file, how the next one is cut short or None).

    Only the framing is read, one 8-byte length per record at its offset (not
    the payload's CRC): cheap enough to run on every shard whenever a split is
    listed. Read-ahead is turned off, so a cold cache reads one page per
    record, not the images between the headers.
    """
    count, offset = 0, 0
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        while offset < size:
            header = os.pread(fd, LENGTH.size, offset)
            if len(header) < LENGTH.size:
                return count, "header cut short"
            offset += HEADER_BYTES + LENGTH.unpack(header)[0] + FOOTER_BYTES
            if offset > size:
                return count, "runs past the end"
            count += 1
    finally:
        os.close(fd)
    return count, None
