"""Data: a registry of source layouts (name → builder) and the tf.data pipeline."""

from __future__ import annotations

import os
from typing import Callable

from tfdp.config import DataConfig
from tfdp.data.sources import Source, Split, image_folder
from tfdp.errors import UserError


def _digits(cfg: DataConfig) -> Source:
    """The embedded demo: scikit-learn's digits, written as JPEGs on first use."""
    from pipelines.digits import ensure_digits
    return image_folder(ensure_digits(cfg.dir), (cfg.train_split, cfg.val_split))


def _image_folder(cfg: DataConfig) -> Source:
    return image_folder(os.path.expanduser(cfg.dir), (cfg.train_split, cfg.val_split))


SOURCES: dict[str, Callable[[DataConfig], Source]] = {
    "digits": _digits,
    "image_folder": _image_folder,
}


def build_source(cfg: DataConfig) -> Source:
    if cfg.format not in SOURCES:
        raise UserError(f"unknown data.format '{cfg.format}' (valid: {', '.join(sorted(SOURCES))})")
    return SOURCES[cfg.format](cfg)


__all__ = ["SOURCES", "Source", "Split", "build_source"]
