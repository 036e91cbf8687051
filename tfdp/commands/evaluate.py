"""`tfdp evaluate`: a checkpoint's top-1/top-5 over the whole validation split."""

from __future__ import annotations

import os

import keras

from tfdp.rundir.checkpoints import CheckpointStore, load_checkpoint
from tfdp.config import Config
from tfdp.data import build_source, memory_cache
from tfdp.data.pipeline import data_errors
from tfdp.data.layouts import require_complete
from tfdp.errors import UserError
from tfdp.distribute.strategy import Runtime
from tfdp.train.task import ClassificationTask
from tfdp.startup.console import say


def evaluate(cfg: Config, runtime: Runtime, checkpoint: str | None = None, pretrained=None) -> dict:
    """Top-1/top-5 over the whole validation split, spread over the replicas, each image once. `pretrained`
    (`tfdp.commands.from_weights.Pretrained`): model.init_from's weights as they are, with their class count."""
    if pretrained is not None:
        return Evaluator(pretrained.cfg, runtime).evaluate(pretrained)
    path = checkpoint or CheckpointStore(os.path.expanduser(cfg.model_dir)).best_weights
    if not os.path.exists(path):   # before the data is listed: a run without a best checkpoint is one line at once
        from tfdp.commands.from_weights import no_checkpoint
        raise no_checkpoint(path)
    return Evaluator(cfg, runtime).evaluate(path)


class Evaluator:
    """The validation split and the model compiled for evaluation, built once, for one checkpoint after
    another (`tfdp evaluate --continuous` evaluates each one a run commits with the same pipeline)."""

    def __init__(self, cfg: Config, runtime: Runtime):
        source = build_source(cfg.data, splits=(cfg.data.val_split,))  # the training split is not even listed
        if source.num_classes and source.num_classes != cfg.model.num_classes:
            raise UserError(f"the data has {source.num_classes} classes but model.num_classes is "
                            f"{cfg.model.num_classes}")
        self.split = source.split(cfg.data.val_split)
        require_complete(self.split)
        if cfg.data.cache:   # tf.data fills the cache during the first pass: a split too large is killed in it
            memory_cache.check_fits([self.split], runtime.num_workers)
        self.cfg, self.runtime = cfg, runtime
        task = ClassificationTask(cfg, runtime, source)
        with runtime.strategy.scope():
            self.model = task.build_model("evaluate")
        self.inputs = task.build_validation_inputs()

    def evaluate(self, weights, label: str = "") -> dict:
        """Loads `weights` (a checkpoint's path, or read pretrained weights) and evaluates them; prints one line
        (after `label`, what was evaluated, if given)."""
        if isinstance(weights, str):
            load_checkpoint(self.model, weights, self.cfg)
        else:
            with self.runtime.strategy.scope():
                weights.load(self.model)
        with data_errors():
            result = self.model.evaluate(self.inputs, verbose=0, return_dict=True)
        result["examples"] = evaluated_images(self.model)
        split = self.split
        skipped = split.num_examples - result["examples"]
        if skipped:
            name_unnamed_corrupt(split, self.cfg, self.runtime, skipped)
        say("tfdp: evaluate: " + (f"{label}: " if label else "")
            + ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "examples")
            + f" over {result['examples']} images"
            + (f" ({skipped} of the {split.num_examples} listed could not be decoded)" if skipped else ""))
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
