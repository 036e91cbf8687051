"""`tfdp evaluate` and `tfdp export`: load a checkpoint into the configured model."""

from __future__ import annotations

import dataclasses
import os

import keras

from tfdp.checkpoints import CheckpointStore, load_weights
from tfdp.config import Config
from tfdp.data import build_source
from tfdp.data.pipeline import data_errors
from tfdp.data.sources import require_complete
from tfdp.errors import UserError
from tfdp.places import writable_dir
from tfdp.strategy import Runtime
from tfdp.task import evaluation_model, serving_model, validation_dataset


def load_checkpoint(model: keras.Model, path: str, cfg: Config) -> None:
    """Loads weights, turning Keras' mismatch errors into one line that says what does not fit."""
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}")
    load_weights(model, path, f"model '{cfg.model.name}' with {cfg.model.num_classes} classes at "
                              f"{cfg.data.image_size} px (another architecture or class count?)")


def evaluate(cfg: Config, runtime: Runtime, checkpoint: str | None = None) -> dict:
    """Top-1/top-5 over the whole validation split, spread over the replicas, each image once."""
    source = build_source(cfg.data, splits=(cfg.data.val_split,))  # the training split is not even listed
    if source.num_classes and source.num_classes != cfg.model.num_classes:
        raise UserError(f"the data has {source.num_classes} classes but model.num_classes is {cfg.model.num_classes}")
    split = source.split(cfg.data.val_split)
    require_complete(split)
    with runtime.strategy.scope():
        model = evaluation_model(cfg)
    load_checkpoint(model, checkpoint or CheckpointStore(os.path.expanduser(cfg.model_dir)).best_weights, cfg)
    with data_errors():
        result = model.evaluate(validation_dataset(cfg, source, runtime), verbose=0, return_dict=True)
    result["examples"] = evaluated_images(model)
    skipped = split.num_examples - result["examples"]
    if skipped:
        name_unnamed_corrupt(split, cfg, runtime, skipped)
    print("tfdp: evaluate: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "examples")
          + f" over {result['examples']} images"
          + (f" ({skipped} of the {split.num_examples} listed could not be decoded)" if skipped else ""), flush=True)
    return result


def name_unnamed_corrupt(split, cfg: Config, runtime: Runtime, skipped: int) -> None:
    """The pipeline names a corrupt image at the next image it decodes; one at the end of a pipeline's share has
    none, so it is named here, by decoding that share's last files again."""
    if split.kind != "images":
        return
    from tfdp.data.corrupt import LOG, name_trailing
    from tfdp.data.preprocess import eval_transform
    from tfdp.data.storage import localize
    named = sum(path in LOG.entries for path in split.files)
    if named >= skipped:
        return
    pipelines = runtime.num_workers if len(split.files) >= runtime.num_workers else 1
    for k in range(pipelines):
        share = list(split.files[k::pipelines])
        tail = share[-(skipped - named + 1):]
        name_trailing(localize(tail, cfg.data.cache_dir), skipped - named, eval_transform(cfg.data), LOG)


def evaluated_images(model: keras.Model) -> int:
    """Images the metrics really cover: the weight top-1 was averaged over (padding and corrupt images weigh 0).

    Read from the metric itself, summed over all replicas, rather than taken
    from the listing, so the printed count can never claim images that were
    not evaluated.
    """
    def walk(metrics):
        for metric in metrics:
            yield metric
            yield from walk(getattr(metric, "metrics", None) or [])
    top1 = next(m for m in walk(model.metrics) if m.name == "top1")
    count = next(v for v in top1.variables if v.path.endswith("count"))
    return int(round(float(keras.ops.convert_to_numpy(count))))


def export_checkpoint(cfg: Config, runtime: Runtime, checkpoint: str | None, out_dir: str | None,
                      formats: tuple[str, ...] | None = None, verify_images: int | None = 1000) -> dict:
    """Writes the export formats, then (`verify_images` not None; 0: the whole split) runs that many validation
    images through each, loaded back in its own runtime, and prints its agreement with the Keras model.

    A format that could not be written does not stop the others: they are written and checked first, then
    its reason is raised as one line naming the formats that were written."""
    from tfdp.export import DEFAULT_FORMATS, agreement_line, check_packages, export, inference_network, verify
    formats = formats or DEFAULT_FORMATS
    if verify_images is not None and verify_images < 0:
        raise UserError(f"--verify_images must be 0 (the whole validation split) or more, got {verify_images}")
    check_packages(formats)
    model_dir = os.path.expanduser(cfg.model_dir)
    out_dir = writable_dir(out_dir or os.path.join(model_dir, "export"), "the export folder")
    source = build_source(cfg.data, splits=(cfg.data.val_split,))  # for the class names and the verification
    # Exports are float32 whatever the training precision (ONNX's exporter requires it; the weights are float32).
    model = serving_model(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="float32")))
    load_checkpoint(model, checkpoint or CheckpointStore(model_dir).best_weights, cfg)
    written = export(model, cfg, source.class_names, out_dir, formats)
    paths = written.paths
    made = [f for f in formats if f in paths]
    if made:
        print(f"tfdp: export: wrote {', '.join(paths[f] for f in made)} and {paths['classes']}", flush=True)
    if verify_images is not None and made:
        split = source.split(cfg.data.val_split)
        with data_errors():
            # The reference is Keras' own network (grouped convolutions as Keras runs them, not as exported).
            agreements = verify(inference_network(model, portable=False), cfg, split, paths, tuple(made),
                                verify_images)
        for name, agreement in agreements.items():
            print(agreement_line(name, paths[name], agreement), flush=True)
        paths["agreement"] = agreements
    if written.failed:  # after the others are written and checked: one line, exit status 2
        raise UserError(written.failure_line())
    return paths
