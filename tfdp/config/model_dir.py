"""Where a run may live: a local path, or a bucket of a store with the conditional writes the one-writer lease
needs. No TensorFlow and no file system here: the config checks the form of `model_dir` once, at the edge."""

from __future__ import annotations

from tfdp.errors import UserError

BUCKET_PROTOCOLS = ("gs", "gcs", "s3", "s3a")   # stores with the conditional writes the lease needs
DEFAULT_SCRATCH_DIR = "~/.cache/tfdp/runs"      # the chief's local working copies of bucket runs


def is_bucket(model_dir: str) -> bool:
    return "://" in model_dir and model_dir.split("://", 1)[0] in BUCKET_PROTOCOLS


def check_model_dir(model_dir: str) -> None:
    """A local path, or a bucket of a store with conditional writes; anything else is one line."""
    if "://" not in model_dir or is_bucket(model_dir):
        return
    scheme = model_dir.split("://", 1)[0]
    if scheme == "file":
        raise UserError(f"model_dir {model_dir}: give the path without file://")
    raise UserError(f"model_dir {model_dir}: tfdp keeps runs on a local or shared file system path, gs:// or "
                    f"s3://, not {scheme}:// (the one-writer lease needs a store with conditional writes)")
