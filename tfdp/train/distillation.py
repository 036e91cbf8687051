"""A teacher beside the student: knowledge distillation inside the training step (`train.teacher`).

The teacher is a tfdp model built like the student (`build_model`: uint8
images in, its own normalisation inside, logits out), in the same strategy
scope, so every replica holds a copy; it is frozen, called in inference mode,
in the run's precision, and loaded whole from `train.teacher.init_from` (any
source `model.init_from` reads) or the run stops. It is no attribute of the
student, so it is in no checkpoint, EMA or export.

Its logits are computed in the student's loss (`compute_loss`, which the
compiled step calls inside its XLA program, once per micro-batch) on the batch
the student trains on, after Mixup/CutMix (both see the mixed images), resized
on the device to the teacher's side where it differs. Its normalisation is
its own: `train.teacher.mean/std`, else what its weights say
(`tfdp.config.pretrained`), else data.mean/std. The student's random flip is a
layer of the student, so the teacher sees the batch unflipped: its logits of
a mirrored image are, for the classifiers taught here, its logits of the image.

A distilled DeiT (a `head_dist` classifier) trains as DeiT did: its class head
on the labels, its distillation head on the teacher, the two averaged at
evaluation and in exports (`HeadAverage`); any other student takes both terms
on its one head, as timm's `LogitDistillationTask`. Loss: (1 - α) labels + α
teacher (`tfdp.optim.distillation`).
"""

from __future__ import annotations

import dataclasses
import types

import keras
from keras import ops

from tfdp.config import Config, DataConfig, ModelConfig, TeacherConfig, pretrained
from tfdp.errors import UserError
from tfdp.models import build_model
from tfdp.models.registry import MODELS
from tfdp.models.weights import load_into, read_source
from tfdp.optim.distillation import combined, distillation_loss
from tfdp.startup.console import say

DIST_HEAD, AVERAGE = "head_dist", "head_average"   # a distilled DeiT's second classifier and its averaging layer


def teacher_configs(cfg: Config) -> tuple[ModelConfig, DataConfig]:
    """The teacher's model and data configs: its name, weights and the student's classes; one image size (its
    own: train.teacher.image_size, its weights', or data.image_size), no flip, its weights' normalisation."""
    t = cfg.train.teacher
    model_cfg = ModelConfig(name=t.model, num_classes=cfg.model.num_classes, dropout=0.0, init_from=t.init_from)
    found = pretrained.from_weights(model_cfg)
    said = found.values() if found is not None else {}
    data = cfg.data
    return model_cfg, dataclasses.replace(
        data, image_size=t.image_size or said.get("image_size") or data.image_size, eval_image_size=0,
        progressive_min_size=0, hflip=False, mean=tuple(t.mean) or said.get("mean", data.mean),
        std=tuple(t.std) or said.get("std", data.std), channel_order=said.get("channel_order", data.channel_order))


def build_teacher(cfg: Config) -> keras.Model:
    """The frozen teacher in the run's precision, its weights loaded whole. Call inside the strategy scope."""
    t = cfg.train.teacher
    if t.model not in MODELS:
        raise UserError(f"train.teacher.model: unknown model '{t.model}' (`tfdp models` lists them)")
    model_cfg, data_cfg = teacher_configs(cfg)
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(cfg.train.precision)
    try:
        teacher = build_model(model_cfg, data_cfg)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    what = load_teacher(teacher, model_cfg, data_cfg)
    teacher.trainable = False
    numbers = lambda values: "/".join(f"{v:g}" for v in values)  # noqa: E731
    say(f"tfdp: teacher: {t.model} from {what}, {data_cfg.image_size} px, mean {numbers(data_cfg.mean)} std "
        f"{numbers(data_cfg.std)}, {t.distillation} distillation (alpha {t.alpha}"
        + (f", tau {t.tau})" if t.distillation == "soft" else ")"))
    return teacher


def load_teacher(teacher: keras.Model, model_cfg: ModelConfig, data_cfg: DataConfig) -> str:
    """Loads every layer of the teacher from its weights (what they are, for the console), or one line why not:
    a teacher with a layer left as initialised (another class count, a source without a classifier) teaches noise."""
    try:
        weights = read_source(model_cfg.init_from, model_cfg, data_cfg)
        _, new = load_into(teacher, weights, model_cfg)
    except UserError as e:
        raise UserError(f"train.teacher.init_from: {str(e).removeprefix('model.init_from: ')}") from None
    if new:
        raise UserError(f"train.teacher.init_from: {weights.what} leaves layer {new[0]} of teacher "
                        f"'{model_cfg.name}' untrained: a teacher must load whole, its classifier with "
                        f"model.num_classes ({model_cfg.num_classes}) classes")
    return weights.what


def find_layer(model: keras.Model, name: str) -> keras.Layer | None:
    """The layer called `name` anywhere in the model (the backbone is a nested model)."""
    return next((layer for layer in model._flatten_layers(include_self=False) if layer.name == name), None)


def teacher_view(x, size: int):
    """The uint8 batch at the teacher's side: itself where it already is, else resized (bilinear, antialiased
    when shrinking, torchvision's Resize) and rounded back to uint8, on the device."""
    if x.shape[1] == size and x.shape[2] == size:
        return x
    resized = ops.image.resize(ops.cast(x, "float32"), (size, size), interpolation="bilinear",
                               antialias=bool(x.shape[1] and x.shape[1] > size))
    return ops.cast(ops.clip(ops.round(resized), 0.0, 255.0), "uint8")


def install_distillation(model: keras.Model, teacher: keras.Model, t: TeacherConfig) -> None:
    """Makes the student's training loss (1 - α) labels + α teacher, on its distillation head where it has one.

    `t.dist_token` (the recipe asks for DeiT's token): a student without that head is one line, not a silent
    distillation on its class head.
    """
    average = find_layer(model, AVERAGE) if find_layer(model, DIST_HEAD) is not None else None
    if t.dist_token and average is None:
        raise UserError(f"train.teacher.dist_token: model '{model.name}' has no distillation head (DeiT's "
                        f"deit_*_distilled_* models do); set it false to distil into the model's one head")
    if average is not None:
        average.distilled_training = True   # training calls give [class head | distillation head]
    distill = distillation_loss(t.distillation, t.tau, t.soft_reduction)
    base_loss, base_metrics = model.compute_loss, model.compute_metrics
    classes, size = model.output_shape[-1], teacher.input_shape[1]

    def split(y_pred):
        """(what the labels teach, what the teacher teaches) of the student's training output."""
        if y_pred.shape[-1] == 2 * classes:
            return y_pred[:, :classes], y_pred[:, classes:]
        return y_pred, y_pred

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if not training:
            return base_loss(x, y, y_pred, sample_weight, training=training)
        head, head_dist = split(y_pred)
        teacher_logits = ops.stop_gradient(teacher(teacher_view(x, size), training=False))
        return combined(base_loss(x, y, head, sample_weight, training=training),
                        distill(teacher_logits, head_dist, sample_weight), t.alpha)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        head, head_dist = split(y_pred)
        return base_metrics(x, y, head if head is head_dist else (head + head_dist) / 2, sample_weight)

    model.compute_loss = types.MethodType(compute_loss, model)
    model.compute_metrics = types.MethodType(compute_metrics, model)
