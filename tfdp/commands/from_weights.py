"""`tfdp predict | evaluate | export --init_from=WEIGHTS`: a command that starts from pretrained weights, no run.

The weights are read by `model.init_from`'s own readers (`tfdp.models.weights`: a timm or torchvision
.safetensors file, a keras-hub preset, a .keras or .weights.h5 file, a tfdp run; a bucket's or the Hugging
Face Hub's copy once `tfdp.cli` has fetched it), their preprocessing resolved with the config
(`tfdp.config.pretrained`). What a training run may change, these commands may not: the model must take
every layer from the weights, its classifier too, so the class count is the weights' (a `model.num_classes`
that differs is one line) and a source without a classifier (DINOv2's, a keras-hub backbone) is refused. The
classes are named by the weights where they say (timm's `label_names`), ImageNet's for a 1,000-class head,
else by number. Nothing of the training data is read.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import keras

from tfdp.config import Config, pretrained
from tfdp.data.imagenet_classes import imagenet_classes
from tfdp.errors import UserError
from tfdp.models.registry import HEAD_LAYERS
from tfdp.models.weights import Weights, load_into, read_source
from tfdp.startup.console import say

IMAGENET_CLASSES = 1000


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """Weights read whole, with the config they are built by (their class count) and their classes' names."""
    cfg: Config
    weights: Weights
    names: tuple[str, ...]   # one per class ('' tuple: named by number)
    text: tuple[str, ...]    # a description per class, or ()
    classes_from: str        # where the names come from, for the console

    def load(self, model: keras.Model) -> None:
        """Every layer of `model` from the weights; a layer they leave as initialised is one line."""
        loaded, new = load_into(model, self.weights, self.cfg.model)
        if new:
            raise UserError(f"--init_from {self.cfg.model.init_from}: {self.weights.what} does not set every layer "
                            f"of model '{self.cfg.model.name}' (new: {', '.join(new)}); predict, evaluate and export "
                            f"use the weights as they are: fine-tune them first (docs/fine-tune-your-images.md)")
        say(f"tfdp: init_from: loaded all {len(loaded)} layers from {self.weights.what}")


def no_checkpoint(path: str) -> UserError:
    """The one line for a command with neither a checkpoint nor weights to start from."""
    return UserError(f"no checkpoint at {path}: train a run there, name one (--model_dir=RUN, --checkpoint=FILE), "
                     f"or start from pretrained weights (--init_from=FILE, hf-hub:timm/NAME, ...)")


def head_classes(weights: Weights, model_name: str) -> int | None:
    """The class count of the weights' classifier: the last axis of the first layer whose name the model's head
    patterns match (`HEAD_LAYERS`); None where the weights hold no such layer."""
    for name, values in weights.values.items():
        if any(fnmatch.fnmatchcase(name, p) for p in HEAD_LAYERS.get(model_name, ())) and values:
            return int(values[0].shape[-1])
    return None


def read_pretrained(cfg: Config, classes_set: bool) -> Pretrained:
    """`cfg.model.init_from` read whole, the config given the weights' class count (`classes_set`: the user named
    model.num_classes, which must then be the weights'), the classes named, and what is assumed said once."""
    spec = cfg.model.init_from
    weights = read_source(spec, cfg.model, cfg.data)
    count = head_classes(weights, cfg.model.name)
    if count is not None and classes_set and count != cfg.model.num_classes:
        raise UserError(f"--init_from {spec}: its classifier has {count} classes, but model.num_classes is "
                        f"{cfg.model.num_classes} (leave model.num_classes out to use the weights' classes, or "
                        f"fine-tune them on yours first: docs/fine-tune-your-images.md)")
    if count is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=count))
    names, text, where = class_names(spec, cfg.model.num_classes)
    for line in pretrained.assumptions(cfg):
        say(line)
    say(f"tfdp: assumed: {cfg.model.num_classes} classes, {where}; fine-tune the weights to predict others "
        f"(docs/fine-tune-your-images.md)")
    return Pretrained(cfg, weights, names, text, where)


def class_names(spec: str, num_classes: int) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(names, descriptions, where they come from): the weights' own (timm's label_names), else ImageNet-1k's for
    a 1,000-class head, else none (the rows name classes by number)."""
    own = pretrained.label_names(spec, num_classes)
    if own is not None:
        return own[0], own[1], "named by the weights' label_names"
    if num_classes == IMAGENET_CLASSES:
        ids, text = imagenet_classes()
        return ids, text, ("named as ImageNet-1k's (a 1,000-class head with no label_names of its own: "
                           "the ImageNet classes in their usual order are assumed)")
    return (), (), "named by number (the weights carry no label_names)"
