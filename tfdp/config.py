"""Typed run configuration: YAML in, validated dataclasses out.

The YAML file and the command-line overrides are merged as plain dicts first,
then validated exactly once (`load_config`), so every later module can trust
the types and ranges it receives. Validation is pydantic's; the messages are
rewritten to one line that names the field (and, for a typo, the nearest
valid key).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import ConfigDict, Field, Strict

from tfdp.errors import UserError

_FORBID = ConfigDict(extra="forbid")

PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
PosFloat = Annotated[float, Strict(), Field(gt=0)]
NonNegFloat = Annotated[float, Strict(), Field(ge=0)]
Fraction = Annotated[float, Strict(), Field(ge=0, le=1)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


@dataclasses.dataclass
class DataConfig:
    """Where the images are and how they are fed (see tfdp/data)."""
    __pydantic_config__ = _FORBID
    # digits | image_folder | imagenet (raw ILSVRC2012 or Kaggle tree) | tfrecord | tfds | synthetic
    format: Str = "digits"
    dir: Str = "~/.cache/tfdp/digits"   # a local path or gs://bucket/prefix
    train_split: Str = "train"
    val_split: Str = "val"
    tfds_name: Str = ""                 # data.format tfds: the dataset's name, e.g. imagenet2012
    tfds_manual_dir: Str = ""           # ... and where its manually downloaded files are, to prepare it
    cache_dir: Str = "~/.cache/tfdp/remote"   # local copies of files read from a bucket
    # Seconds a bucket's endpoint may take to answer the first request before the run stops.
    remote_timeout: PosFloat = 20.0
    synthetic_examples: PosInt = 1_281_167    # data.format synthetic: examples per "epoch"
    # Training stops once more than this fraction of the records read could not be decoded.
    max_bad_fraction: Annotated[float, Strict(), Field(ge=0, le=1)] = 0.001
    image_size: PosInt = 32
    # Random-resized-crop window for training (fraction of the image area).
    min_crop_area: Annotated[float, Strict(), Field(gt=0, le=1)] = 0.08
    max_crop_area: Annotated[float, Strict(), Field(gt=0, le=1)] = 1.0
    hflip: Bool = True
    # Evaluation crops this fraction of the shorter side around the centre.
    eval_crop_fraction: Annotated[float, Strict(), Field(gt=0, le=1)] = 0.875
    shuffle_buffer: PosInt = 10_000
    cache: Bool = False
    deterministic: Bool = False
    # Per-channel statistics in 0..255 pixel units, applied on the device.
    mean: tuple[Annotated[float, Strict()], ...] = (123.675, 116.28, 103.53)
    std: tuple[PosFloat, ...] = (58.395, 57.12, 57.375)
    # A tf.data service dispatcher (grpc://host:port, see `tfdp data-service`) that runs the training
    # pipeline on its workers, so input scales past this host's CPUs; "" = the local pipeline.
    # Evaluation always reads locally.
    service_address: Str = ""
    # distributed_epoch: all trainers share one job over the whole split, every example once per data
    # epoch; parallel_epochs: every service worker streams this trainer's share in its own order.
    service_mode: Literal["distributed_epoch", "parallel_epochs"] = "distributed_epoch"
    # Seconds the dispatcher may take to answer at start before the run stops with an error.
    service_timeout: PosFloat = 60.0


@dataclasses.dataclass
class ModelConfig:
    __pydantic_config__ = _FORBID
    name: Str = "resnet18_small"
    num_classes: PosInt = 10
    # Dropout rate before the classifier; None: the model's own default (0.5 for VGG and SqueezeNet as
    # their papers, 0.2 for EfficientNetV2 and MobileNetV3 as keras.applications, else 0); 0: none.
    dropout: Annotated[float, Strict(), Field(ge=0, lt=1)] | None = None
    # Batch-norm statistics over the global batch (all replicas) instead of each replica's share, as
    # Model Garden's use_sync_bn and PyTorch's SyncBatchNorm: for small per-replica batches.
    sync_bn: Bool = False


@dataclasses.dataclass
class OptimizerConfig:
    __pydantic_config__ = _FORBID
    name: Literal["sgd"] = "sgd"
    # Learning rate per 256 images; scaled linearly with the global batch.
    lr: PosFloat = 0.1
    momentum: Fraction = 0.9
    nesterov: Bool = False
    weight_decay: NonNegFloat = 0.0
    # Most ImageNet recipes decay only conv/dense kernels, not batch-norm scale/shift or biases.
    decay_norm_and_bias: Bool = True


@dataclasses.dataclass
class ScheduleConfig:
    __pydantic_config__ = _FORBID
    name: Literal["cosine", "step", "exponential", "constant", "one_cycle"] = "cosine"
    warmup_epochs: NonNegFloat = 0.0
    # For `step`: epochs at which the rate is multiplied by `decay_rate`.
    decay_epochs: tuple[PosInt, ...] = (30, 60, 80)
    # `step`: factor at each decay epoch; `exponential`: factor per epoch.
    decay_rate: Annotated[float, Strict(), Field(gt=0, le=1)] = 0.1
    # `one_cycle` (Smith & Topin 2019, as torch's OneCycleLR): rise from peak/div_factor over
    # pct_start of the run, then cosine down to peak/(div_factor*final_div_factor).
    pct_start: Annotated[float, Strict(), Field(gt=0, lt=1)] = 0.3
    div_factor: Annotated[float, Strict(), Field(ge=1)] = 25.0
    final_div_factor: Annotated[float, Strict(), Field(ge=1)] = 1e4


@dataclasses.dataclass
class TrainConfig:
    __pydantic_config__ = _FORBID
    epochs: PosInt = 10
    batch_size_per_replica: PosInt = 64
    label_smoothing: Annotated[float, Strict(), Field(ge=0, lt=1)] = 0.0
    seed: NonNegInt = 0
    # Keep the best checkpoint by this validation metric.
    best_metric: Literal["val_top1", "val_loss"] = "val_top1"
    # Compute dtype policy; logits and loss stay float32, float16 gets dynamic loss scaling.
    precision: Literal["float32", "mixed_bfloat16", "mixed_float16"] = "float32"
    # Training steps per tf.function call (fewer host round trips for small models).
    steps_per_execution: PosInt = 1
    # Compile each replica's forward/backward pass with XLA (tfdp/xla.py); works with any number
    # of replicas, where Keras' own jit_compile fails (it compiles the cross-replica step).
    # `auto`: on where the strategy's devices are GPUs or TPUs (5x faster for ResNet-50 on an H100),
    # off on CPUs, and off with model.sync_bn; true/false force it.
    jit_compile: Literal["auto"] | Bool = "auto"
    # Mid-epoch checkpoints every this many global steps (0: epoch checkpoints only). A kill loses at
    # most this many steps; a preemption notice (SIGTERM) loses none. The default keeps a checkpoint
    # under 2% of step time on the ImageNet recipes (benchmarks/checkpoint_cost.py).
    checkpoint_every_steps: NonNegInt = 1000
    # Bit-identical runs: TensorFlow op determinism and seeded input (implies data.deterministic), so a
    # run killed and resumed any number of times ends with exactly the weights of an uninterrupted one.
    deterministic: Bool = False


@dataclasses.dataclass
class DistributeConfig:
    __pydantic_config__ = _FORBID
    strategy: Literal["one_device", "mirrored", "multi_worker"] = "mirrored"
    # On a host without GPUs, split the CPU into this many logical devices so
    # `mirrored` really runs that many replicas. 0 keeps one CPU device.
    cpu_replicas: NonNegInt = 0
    # multi_worker: the all-reduce implementation across hosts.
    communication: Literal["auto", "ring", "nccl"] = "auto"
    # multi_worker: seconds to wait for every worker to join before giving up.
    startup_timeout: PosFloat = 120.0


@dataclasses.dataclass
class LogConfig:
    """What the chief records besides metrics.jsonl (see tfdp/callbacks.py)."""
    __pydantic_config__ = _FORBID
    tensorboard: Bool = True
    # Profile training steps [first, last] (1-based, first epoch) into the TensorBoard logs; [0, 0] = off.
    profile_steps: tuple[NonNegInt, NonNegInt] = (0, 0)
    # Weights & Biases project; empty = off. `wandb_mode: offline` logs without a network.
    wandb_project: Str = ""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"


@dataclasses.dataclass
class Config:
    __pydantic_config__ = _FORBID
    model_dir: Str = "runs/default"
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    distribute: DistributeConfig = dataclasses.field(default_factory=DistributeConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)


_ADAPTER = pydantic.TypeAdapter(Config)


def read_yaml(path: str) -> dict[str, Any]:
    """Reads a config file into a plain dict (no validation yet)."""
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"config file {path} is not valid YAML{where}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must hold a mapping of sections, not {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets `raw[a][b][c] = value` for `dotted == "a.b.c"`, creating sections."""
    keys = dotted.split(".")
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise UserError(f"cannot set {dotted}: {'.'.join(keys[:i + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def parse_assignment(text: str) -> tuple[str, Any]:
    """Parses `a.b=value` as given to `--set`, the value read as YAML (so 0.2 is a float)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set expects KEY=VALUE (for example optimizer.lr=0.2), got {text!r}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def validate(raw: dict[str, Any]) -> Config:
    """Turns a merged dict into a `Config`, or raises a one-line `UserError`."""
    try:
        cfg = _ADAPTER.validate_python(raw)
    except pydantic.ValidationError as e:
        raise UserError(_describe(e.errors()[0])) from None
    _check_cross_field(cfg)
    return cfg


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> Config:
    """The edge of the program: file + overrides → validated `Config`."""
    raw = read_yaml(path) if path else {}
    for dotted, value in (overrides or {}).items():
        apply_override(raw, dotted, value)
    return validate(raw)


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain-data view of a config, with tuples as lists, for YAML and logs."""
    return _listify(dataclasses.asdict(cfg))


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _listify(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _listify(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_listify(v) for v in node]
    return node


def _check_cross_field(cfg: Config) -> None:
    d = cfg.data
    if d.min_crop_area > d.max_crop_area:
        raise UserError("data.min_crop_area must not exceed data.max_crop_area")
    if len(d.mean) != 3 or len(d.std) != 3:
        raise UserError("data.mean and data.std must each have 3 values (R, G, B)")
    if cfg.schedule.name == "step" and list(cfg.schedule.decay_epochs) != sorted(cfg.schedule.decay_epochs):
        raise UserError("schedule.decay_epochs must be in increasing order")
    first, last = cfg.log.profile_steps
    if (first or last) and not 0 < first <= last:
        raise UserError("log.profile_steps must be [first, last] with 0 < first <= last, or [0, 0] for off")
    if cfg.schedule.warmup_epochs >= cfg.train.epochs:
        raise UserError("schedule.warmup_epochs must be smaller than train.epochs")
    if cfg.model.sync_bn and cfg.train.jit_compile is True:
        raise UserError("model.sync_bn needs train.jit_compile: false (its all-reduce cannot run inside the "
                        "per-replica XLA step)")
    if d.service_address:
        _check_service(cfg)
    if cfg.train.deterministic:
        d.deterministic = True  # seeded crops are part of a deterministic run


def _check_service(cfg: Config) -> None:
    """A dispatcher address TensorFlow can parse (its own error comes late, as a traceback), and no
    promise of a replayable input, which the service cannot keep (see tfdp/data/service.py)."""
    address = cfg.data.service_address
    protocol, _, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":")
    if protocol not in ("", "grpc") or not host or not port.isdigit():
        raise UserError(f"data.service_address must be grpc://HOST:PORT (a tf.data service dispatcher), "
                        f"got {address!r}")
    if cfg.train.deterministic:
        raise UserError("train.deterministic cannot train through the tf.data service (data.service_address): "
                        "the service decides which worker reads what, so the input cannot be replayed")


def _section_at(loc: tuple[str, ...]) -> type | None:
    """The dataclass that holds the field at `loc`, to list its valid keys."""
    node: Any = Config
    for key in loc[:-1]:
        node = typing.get_type_hints(node).get(key)
        if not dataclasses.is_dataclass(node):
            return None
    return node


def _describe(err: dict[str, Any]) -> str:
    loc = tuple(str(part) for part in err["loc"])
    where = ".".join(loc) or "config"
    kind = err["type"]
    if kind == "unexpected_keyword_argument":
        section = _section_at(loc)
        valid = [f.name for f in dataclasses.fields(section)] if section else []
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f"; did you mean '{'.'.join(loc[:-1] + (close[0],))}'?" if close else ""
        listed = f" (valid keys: {', '.join(valid)})" if valid and not close else ""
        return f"unknown config key '{where}'{hint}{listed}"
    if kind == "dataclass_type":
        return f"config section '{where}' must be a mapping of keys, got {err.get('input')!r}"
    return f"config field '{where}': {err['msg'].lower()} (got {err.get('input')!r})"
