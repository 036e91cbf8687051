"""The metrics log's name and reader: one JSON object per epoch in model_dir/metrics.jsonl.

Kept apart from the Keras callback that writes it (tfdp/train/callbacks.py), so
that reading a run (`tfdp report`) never imports TensorFlow: that costs
seconds of start-up to draw a few PNGs.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tfdp.errors import UserError

METRICS_FILE = "metrics.jsonl"
# The evaluator's rows, one per checkpoint it evaluated (tfdp/commands/continuous_eval.py); in a bucket, one object
# each under EVAL_METRICS/.
EVAL_METRICS_FILE = "eval_metrics.jsonl"
EVAL_METRICS = "eval_metrics"


def with_evaluations(rows: list[dict[str, Any]], evaluated: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics rows, each with the evaluator's `val_` figures of its epoch's checkpoint where the workers had
    none of their own (train.validate)."""
    by_epoch = {int(r["epoch"]): r for r in evaluated if not r.get("step_in_epoch")}
    return [{**{k: v for k, v in by_epoch.get(int(r["epoch"]), {}).items() if k.startswith("val_")}, **r}
            for r in rows]


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The rows of a metrics log, oldest epoch first; none when the file does not exist yet.

    tfdp writes each log whole and atomically, so a row that is not a JSON
    object was damaged from outside (a disk, an edit): one line naming it.
    """
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path} line {number} is not a JSON object ({e}): a damaged log; mend or remove "
                                f"that line") from None
            if not isinstance(row, dict) or "epoch" not in row:
                raise UserError(f"{path} line {number} is not a metrics row (a JSON object with an epoch): "
                                f"{line[:80]}")
            rows.append(row)
    return rows
