"""Model registry: architecture name → builder, and each model's defaults as data.

A builder takes `(input_shape, num_classes, dropout)` and returns a Keras model
mapping float images (already normalised) to logits. Model files register
theirs with `register`; this module imports none of them (importing
`tfdp.models` does, which fills the registry).
"""

from __future__ import annotations

import functools
from typing import Callable

import keras

from tfdp.errors import UserError

Builder = Callable[..., keras.Model]
# name → builder; its `dropout` argument may be left out or None for the model's default.
MODELS: dict[str, Builder] = {}
# name → the smallest input side the model can take.
MIN_INPUT_SIZE: dict[str, int] = {}
# name → the dropout rate before the classifier when `model.dropout` is not set.
DEFAULT_DROPOUT: dict[str, float] = {}
# names of the models whose builder takes `drop_path` (stochastic depth over residual blocks).
DROP_PATH: set[str] = set()
# names of the models that take only the image size they were built for (their classifier reads a flattened
# feature map of fixed size): no progressive resizing, no separate evaluation size.
FIXED_SIZE: set[str] = set()
# name → fnmatch patterns of the layer names of its classifier head (the layers whose shape follows the class count);
# what `train.freeze: [backbone]` leaves trainable and `optimizer.head_lr_multiplier` scales. () = no known head.
HEAD_LAYERS: dict[str, tuple[str, ...]] = {}
# name → its layer grouping for layer-wise learning-rate decay, as timm's `group_matcher(coarse=False)`: an ordered
# {group: regex on layer names}; a regex's groups number the layers inside its group (one per block; digits, or a
# letter counted by its place in the alphabet, as Keras names blocks `block2b`), a group named WITH_PREVIOUS joins
# the group before it (timm's MATCH_PREV_GROUP), and layers no regex matches (the head) come last. Models without
# one cannot take `optimizer.layer_decay`.
LAYER_GROUPS: dict[str, dict[str, str]] = {}
WITH_PREVIOUS = "with_previous"
# name → the batch-norm rule its family trains by (`batch_norm.RUNNING_VARIANCE`), from where the architecture comes:
# "torch" (the moving variance follows the unbiased batch variance) for the families built from timm's and
# torchvision's layouts, tfdp's default; "keras" (the biased one) for keras.applications' graphs as Keras builds them.
BATCH_NORM: dict[str, str] = {}


def register(name: str, min_size: int = 32, dropout: float = 0.0, drop_path: bool = False, fixed_size: bool = False,
             head: tuple[str, ...] = ("logits",), layer_groups: dict[str, str] | None = None,
             batch_norm: str = "torch") -> Callable[[Builder], Builder]:
    """Adds a builder under `name`, with its smallest input side, its default dropout, whether it takes
    a stochastic-depth rate, whether it takes only the input size it was built for, its head's layer
    names, its layer grouping and its batch-norm rule (see `HEAD_LAYERS`, `LAYER_GROUPS`, `BATCH_NORM`)."""
    def add(fn: Builder) -> Builder:
        if name in MODELS:
            raise ValueError(f"model '{name}' registered twice")

        @functools.wraps(fn)
        def build(input_shape, num_classes: int, dropout: float | None = None, drop_path_rate: float = 0.0
                  ) -> keras.Model:
            kwargs = {"drop_path": drop_path_rate} if drop_path_rate else {}
            return fn(input_shape, num_classes, DEFAULT_DROPOUT[name] if dropout is None else dropout, **kwargs)
        MODELS[name] = build
        MIN_INPUT_SIZE[name] = min_size
        DEFAULT_DROPOUT[name] = dropout
        if drop_path:
            DROP_PATH.add(name)
        if fixed_size:
            FIXED_SIZE.add(name)
        HEAD_LAYERS[name] = tuple(head)
        if layer_groups:
            LAYER_GROUPS[name] = dict(layer_groups)
        BATCH_NORM[name] = batch_norm
        return fn
    return add


def check_model_name(name: str) -> None:
    if name not in MODELS:
        raise UserError(f"unknown model '{name}' (valid: {', '.join(sorted(MODELS))})")
