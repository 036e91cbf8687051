"""Fine-tuning controls: frozen layers (`train.freeze`, `train.freeze_epochs`) and per-variable learning rates
(`optimizer.layer_decay`, `optimizer.head_lr_multiplier`).

Freezing is Keras' own: `layer.trainable = False`, so the layer's variables
leave `model.trainable_variables` (no gradient, no optimizer update) and a
frozen BatchNormalization runs in inference mode (Keras 3 reads `trainable`
at call time). The optimizer is always built over every variable before
anything is frozen, so its state and the checkpoints have one shape
whichever phase a run is in; a frozen variable gets no gradient, and Keras'
optimizer skips variables without one (their momentum stays as it is). Each
`fit` call has one trainable set (`Freezing.split`), and the train function
is rebuilt where it changes.

Learning-rate scales follow timm (timm/optim/_param_groups.py
`param_groups_layer_decay`): layer ids from the model's layer grouping (its
`group_matcher(coarse=False)`, here `registry.LAYER_GROUPS`: the stem 0, one
id per block, every unmatched layer, the head among them, last), and
scale = layer_decay ** (num_layers - 1 - layer_id). timm puts the scale on
the param group's lr, which the optimizer also uses for decoupled weight
decay, so the decay scales too. Here the scale multiplies the learning rate
inside `update_step`, per variable, which Keras' own step and tfdp's
whole-step XLA update both call; the schedule and the EMA are untouched.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import warnings

import keras

from tfdp.config import Config, TrainConfig
from tfdp.errors import UserError
from tfdp.models.registry import HEAD_LAYERS, LAYER_GROUPS, WITH_PREVIOUS

BACKBONE = "backbone"


def weight_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The model's innermost layers that hold weights, in order (nested models, as the backbone, opened)."""
    found = []
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            found.extend(weight_layers(layer))
        elif layer.weights:
            found.append(layer)
    return found


def matches(name: str, pattern: str) -> bool:
    """A layer name against a `train.freeze` entry: an fnmatch pattern, or a stage/block prefix (stage1 = stage1_*)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + "_*")


def head_layers(model: keras.Model, model_name: str) -> list[keras.layers.Layer]:
    """The classifier head's layers, as the model's registry entry names them."""
    patterns = HEAD_LAYERS.get(model_name, ())
    return [layer for layer in weight_layers(model) if any(fnmatch.fnmatchcase(layer.name, p) for p in patterns)]


def frozen_layers(model: keras.Model, model_name: str, entries: tuple[str, ...]) -> list[keras.layers.Layer]:
    """The layers `train.freeze` names; a one-line error for an entry that names none."""
    layers = weight_layers(model)
    chosen: dict[int, keras.layers.Layer] = {}
    for entry in entries:
        if entry == BACKBONE:
            head = head_layers(model, model_name)
            if not head:
                raise UserError(f"train.freeze: backbone needs a classifier head, and model '{model_name}' declares "
                                f"none (name its layers or stages instead)")
            hit = [layer for layer in layers if all(layer is not h for h in head)]
        else:
            hit = [layer for layer in layers if matches(layer.name, entry)]
            if not hit:
                raise UserError(f"train.freeze: '{entry}' matches no layer with weights of model '{model_name}' "
                                f"(its layers start {', '.join(layer_prefixes(layers)[:12])}, ...)")
        chosen.update((id(layer), layer) for layer in hit)
    return [layer for layer in layers if id(layer) in chosen]


def layer_prefixes(layers: list[keras.layers.Layer]) -> list[str]:
    """Distinct name prefixes (up to the first underscore), in order: what a user can write as a stage."""
    return list(dict.fromkeys(layer.name.split("_")[0] for layer in layers))


@dataclasses.dataclass
class Freezing:
    """Which layers are frozen in which epochs, and the switch between the two phases."""
    layers: list[keras.layers.Layer]
    until_epoch: int | None      # first epoch (0-based) in which everything trains; None: frozen all run
    entries: tuple[str, ...] = ()
    frozen: bool = False          # the layers' current state

    @classmethod
    def plan(cls, train: TrainConfig, model_name: str, model: keras.Model) -> "Freezing":
        layers = frozen_layers(model, model_name, train.freeze) if train.freeze else []
        return cls(layers, train.freeze_epochs or None, tuple(train.freeze))

    def frozen_in(self, epoch: int) -> bool:
        return bool(self.layers) and (self.until_epoch is None or epoch < self.until_epoch)

    def split(self, fits: list) -> list:
        """`fits` (trainer Segments) split at the epoch where everything starts to train: one trainable set a fit."""
        if not self.layers or self.until_epoch is None:
            return fits
        cut = self.until_epoch
        out = []
        for fit in fits:
            if fit.initial_epoch < cut < fit.epochs:
                out += [dataclasses.replace(fit, epochs=cut), dataclasses.replace(fit, initial_epoch=cut)]
            else:
                out.append(fit)
        return out

    def enter(self, model: keras.Model, epoch: int, epochs: int) -> str | None:
        """Sets the trainable set for a fit starting at `epoch`; returns the line to print where it changed."""
        want = self.frozen_in(epoch)
        if want == self.frozen:
            return None
        for layer in self.layers:
            layer.trainable = not want
        self.frozen = want
        model.train_function = None  # Keras traces the trainable set into it: rebuilt by the next fit
        # Frozen variables have no gradient: Keras' optimizer skips them, and says so once per trace.
        warnings.filterwarnings("ignore", message="Gradients do not exist for variables")
        what = ", ".join(self.entries)
        if want:
            end = epochs if self.until_epoch is None else self.until_epoch
            span = ("the whole run" if self.until_epoch is None else
                    f"epoch {end}" if end == epoch + 1 else f"epochs {epoch + 1}-{end}")
            return (f"tfdp: fine-tuning: {len(self.layers)} layers frozen ({what}) for {span}; their batch norm "
                    f"runs in inference mode")
        return (f"tfdp: fine-tuning: every layer trains from epoch {epoch + 1} on (train.freeze_epochs: "
                f"{self.until_epoch}; {len(self.layers)} layers unfrozen)")


# ---- per-variable learning rates ----

def group_key(name: str, matcher: dict[str, str]) -> tuple[float, ...]:
    """timm's `group_with_matcher` ordinal for one layer name: (group index, the regex's numbers...), inf unmatched;
    a letter the regex captures counts as its place in the alphabet (Keras' `block2b`)."""
    for ordinal, pattern in enumerate(matcher.values()):
        m = re.match(pattern, name)
        if m:
            return (float(ordinal), *(float(g) if g.isdigit() else float(ord(g) - ord("a"))
                                      for g in m.groups() if g is not None))
    return (float("inf"),)


def layer_ids(model: keras.Model, model_name: str) -> tuple[dict[int, int], int]:
    """({id(variable): layer id} for the trainable variables, number of layer ids), as timm numbers them."""
    if model_name not in LAYER_GROUPS:
        raise UserError(f"optimizer.layer_decay: model '{model_name}' has no layer grouping (models with one: "
                        f"{', '.join(sorted(LAYER_GROUPS))})")
    matcher = LAYER_GROUPS[model_name]
    keys = {}
    for layer in weight_layers(model):
        for v in layer.trainable_weights:
            keys[id(v)] = group_key(layer.name, matcher)
    joins = float(list(matcher).index(WITH_PREVIOUS)) if WITH_PREVIOUS in matcher else None
    ordered, layer = {}, -1
    for key in sorted(set(keys.values())):
        layer += not (key[0] == joins and layer >= 0)   # timm's MATCH_PREV_GROUP: the group before's id
        ordered[key] = layer
    return {vid: ordered[key] for vid, key in keys.items()}, layer + 1


def learning_rate_scales(cfg: Config, model: keras.Model) -> dict[int, float]:
    """{id(variable): learning-rate multiplier} for every trainable variable whose multiplier is not 1."""
    scales: dict[int, float] = {}
    decay, head_multiplier = cfg.optimizer.layer_decay, cfg.optimizer.head_lr_multiplier
    if decay and decay != 1:
        ids, num_layers = layer_ids(model, cfg.model.name)
        scales = {vid: decay ** (num_layers - 1 - i) for vid, i in ids.items()}
    if head_multiplier != 1:
        head = head_layers(model, cfg.model.name)
        if not head:
            raise UserError(f"optimizer.head_lr_multiplier: model '{cfg.model.name}' declares no classifier head")
        for layer in head:
            for v in layer.trainable_weights:
                scales[id(v)] = scales.get(id(v), 1.0) * head_multiplier
    return {vid: s for vid, s in scales.items() if s != 1.0}


class ScaledLearningRates:
    """Mixed into an optimizer class: each variable's learning rate times its scale (`tfdp_lr_scales`, by the
    optimizer's variable index), its decoupled weight decay (AdamW, Lamb) with it.

    The decay moves from `_apply_weight_decay` (one rate for all) into
    `update_step`, just before the variable's update, as Keras applies it;
    only the scaled rate differs. `update_step` runs in Keras' own step and in
    the whole-step XLA update alike.
    """
    tfdp_lr_scales: list[float] = []

    def _apply_weight_decay(self, variables):
        return  # done per variable in update_step

    def update_step(self, gradient, variable, learning_rate):
        scale = self.tfdp_lr_scales[self._get_variable_index(variable)]
        if scale != 1.0:
            learning_rate = learning_rate * scale
        if self.weight_decay is not None and self._use_weight_decay(variable):
            lr = keras.ops.cast(learning_rate, variable.dtype)
            wd = keras.ops.cast(self.weight_decay, variable.dtype)
            self.assign_sub(variable, variable * wd * lr)
        super().update_step(gradient, variable, learning_rate)


_SCALED_CLASSES: dict[type, type] = {}


def scale_learning_rates(cfg: Config, model: keras.Model, optimizer: keras.optimizers.Optimizer) -> str | None:
    """Installs the per-variable learning rates on the built `optimizer`; the line to print, or None when all are 1.

    Raises the one-line errors for a model without the grouping or head asked for.
    """
    scales = learning_rate_scales(cfg, model)
    if not scales:
        return None
    cls = type(optimizer)
    if cls not in _SCALED_CLASSES:
        _SCALED_CLASSES[cls] = type(cls.__name__, (ScaledLearningRates, cls), {})
    optimizer.__class__ = _SCALED_CLASSES[cls]
    optimizer.tfdp_lr_scales = [scales.get(id(v), 1.0) for v in optimizer._trainable_variables]
    low, high = min(optimizer.tfdp_lr_scales), max(optimizer.tfdp_lr_scales)
    parts = []
    if cfg.optimizer.layer_decay and cfg.optimizer.layer_decay != 1:
        parts.append(f"layer_decay {cfg.optimizer.layer_decay:g}")
    if cfg.optimizer.head_lr_multiplier != 1:
        parts.append(f"head x{cfg.optimizer.head_lr_multiplier:g}")
    return f"tfdp: fine-tuning: per-layer learning rates ({', '.join(parts)}): x{low:.3g} to x{high:.3g} of the schedule"


def expand_to_built(optimizer, trainable: list, gradients: list) -> list:
    """`gradients` of the model's trainable variables, laid out over every variable the optimizer was built with
    (None for a frozen one, which the optimizer then leaves alone): what `stateless_apply` takes."""
    built = optimizer._trainable_variables
    if len(built) == len(trainable):
        return list(gradients)
    where = {id(v): g for v, g in zip(trainable, gradients)}
    return [where.get(id(v)) for v in built]
