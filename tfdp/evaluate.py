"""`tfdp evaluate`: top-1/top-5 of a checkpoint over the whole validation split."""

from __future__ import annotations

import os

from tfdp.checkpoints import CheckpointStore
from tfdp.config import Config
from tfdp.data import build_source
from tfdp.errors import UserError
from tfdp.models import check_model_name
from tfdp.strategy import Runtime
from tfdp.trainer import compile_model, distributed_datasets, make_plan


def evaluate(cfg: Config, runtime: Runtime, checkpoint: str | None = None) -> dict:
    check_model_name(cfg.model.name)
    source = build_source(cfg.data)
    plan = make_plan(cfg, source, runtime)
    store = CheckpointStore(os.path.expanduser(cfg.model_dir))
    with runtime.strategy.scope():
        model = compile_model(cfg, plan)
    path = checkpoint or store.best_weights
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}")
    model.load_weights(path)
    _, val_ds = distributed_datasets(cfg, source, runtime, plan)
    result = model.evaluate(val_ds, verbose=0, return_dict=True)
    print("tfdp: evaluate: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()), flush=True)
    return result
