"""Output places checked before any expensive work: one line if a run could not write its results.

A run that trains for an hour and then fails to write its first checkpoint
(read-only folder, a file where a folder should be) wastes the hour; so every
command checks, before it builds a model or reads data, that each folder it
will write into exists or can be made and takes a file. No TensorFlow here.
"""

from __future__ import annotations

import errno
import os
import tempfile

from tfdp.errors import UserError


def writable_dir(path: str, what: str) -> str:
    """Makes `path` if needed and proves a file can be written there; returns its absolute path."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{what} {path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tfdp-write-check-"):
            pass
    except OSError as e:
        reason = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                  errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the device",
                  errno.ENOTDIR: "a part of the path is a file"}.get(e.errno, os.strerror(e.errno or 0).lower())
        raise UserError(f"cannot write to {what} {path}: {reason}") from None
    return path


def writable_tree(path: str, what: str) -> str:
    """`writable_dir`, and every folder already below it (a read-only checkpoints/ inside a writable run)."""
    root = writable_dir(path, what)
    for folder, subfolders, _ in os.walk(root):
        for name in subfolders:
            if not name.startswith("."):
                writable_dir(os.path.join(folder, name), what + " folder")
        break
    return root
