"""`tfdp evaluate` and `tfdp export`: load a checkpoint into the configured model."""

from __future__ import annotations

import os

import keras

from tfdp.checkpoints import CheckpointStore
from tfdp.config import Config
from tfdp.data import build_source
from tfdp.data.pipeline import data_errors
from tfdp.errors import UserError
from tfdp.models import check_model_name
from tfdp.strategy import Runtime
from tfdp.trainer import compile_model, distributed_datasets, make_plan


def load_checkpoint(model: keras.Model, path: str, cfg: Config) -> None:
    """Loads weights, turning Keras' mismatch errors into one line that says what does not fit."""
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}")
    try:
        model.load_weights(path)
    except (ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0][:200]
        raise UserError(f"checkpoint {path} does not fit model '{cfg.model.name}' with "
                        f"{cfg.model.num_classes} classes at {cfg.data.image_size} px "
                        f"(another architecture or class count?): {first}") from None


def evaluate(cfg: Config, runtime: Runtime, checkpoint: str | None = None) -> dict:
    """Top-1/top-5 over the whole validation split, spread over the replicas, each image once."""
    check_model_name(cfg.model.name)
    source = build_source(cfg.data)
    plan = make_plan(cfg, source, runtime)
    with runtime.strategy.scope():
        model = compile_model(cfg, plan)
    load_checkpoint(model, checkpoint or CheckpointStore(os.path.expanduser(cfg.model_dir)).best_weights, cfg)
    _, val_ds = distributed_datasets(cfg, source, runtime, plan)
    with data_errors():
        result = model.evaluate(val_ds, verbose=0, return_dict=True)
    result["examples"] = plan.val_examples
    print("tfdp: evaluate: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "examples")
          + f" over {plan.val_examples} images", flush=True)
    return result


def export_checkpoint(cfg: Config, runtime: Runtime, checkpoint: str | None, out_dir: str | None) -> dict:
    from tfdp.export import export
    check_model_name(cfg.model.name)
    source = build_source(cfg.data)
    plan = make_plan(cfg, source, runtime)
    model = compile_model(cfg, plan)  # serving runs on one device: no strategy scope
    model_dir = os.path.expanduser(cfg.model_dir)
    load_checkpoint(model, checkpoint or CheckpointStore(model_dir).best_weights, cfg)
    paths = export(model, cfg, source.class_names, out_dir or os.path.join(model_dir, "export"))
    print(f"tfdp: export: {paths['keras']} and {paths['saved_model']} (input: encoded image bytes)", flush=True)
    return paths
