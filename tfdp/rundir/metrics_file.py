"""The metrics log's name and reader: one JSON object per epoch in model_dir/metrics.jsonl.

Kept apart from the Keras callback that writes it (tfdp/train/callbacks.py), so
that reading a run (`tfdp report`) never imports TensorFlow: that costs
seconds of start-up to draw a few PNGs.
"""

from __future__ import annotations

import json
import os
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The rows of a metrics log, oldest epoch first; none when the file does not exist yet."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
