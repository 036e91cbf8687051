"""Each weight set's preprocessing (timm's `pretrained_cfg`): what the weights were trained to see.

Pretrained weights only give their accuracy on input normalised as in their
training: Keras' ResNets take BGR with the ImageNet mean subtracted ("caffe"),
Keras' Inception and MobileNets pixels scaled to [-1, 1] ("tf"), torchvision's
and timm's RGB with ImageNet's mean and std. So the weights carry their
preprocessing, and `resolve` fills the preprocessing fields of the data config
(`PREPROCESSING`) that the user did not set, once, where the config is
validated: the run's config.yaml then records the values used, and resume,
evaluate, export and predict build the same model input.

Where the values come from, first found wins:

1. the config itself: a field the user set is never replaced;
2. the run's own checkpoints (`model_dir` holds `checkpoints/` and its
   config.yaml): a resumed, evaluated or exported run keeps the preprocessing
   its weights were trained with, whatever `model.init_from` says now;
3. `model.init_from`'s weights (`from_weights`): Keras' per family, a tfdp
   run's config.yaml, a timm file's pretrained cfg, torchvision's ImageNet,
   a keras-hub preset's image converter;
4. the field's default (ImageNet's RGB mean and std, crop 0.875).

The image size is one of them where the weights say it (a timm cfg's
`input_size`, a keras-hub converter's `image_size`, a tfdp run's
`data.image_size`): a ViT's position embeddings are learned for one grid,
and a run that names no size trains at the weights' own. Where neither the
config nor the weights name one, a model whose name ends in its size
(timm's `vit_small_patch16_224`) builds at that size (`native_size`).
So does the evaluation resize (`data.eval_interpolation`: a timm cfg's
`interpolation`, torchvision's bilinear).

Means and standard deviations are always per R, G, B channel of the decoded
image (0..255 units), whatever `channel_order` the model's first layer sees,
so the augmentations that fill with the mean colour need no reordering.

No TensorFlow or Keras here: the config is validated before TensorFlow loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from typing import TYPE_CHECKING, Callable, Collection

import yaml

from tfdp.config import yaml_floats
from tfdp.config.imagenet_stats import IMAGENET_MEAN, IMAGENET_STD
from tfdp.errors import UserError

if TYPE_CHECKING:
    from tfdp.config import Config, DataConfig, ModelConfig

# The data config's fields that belong to the weights.
PREPROCESSING = ("mean", "std", "channel_order", "eval_crop_fraction", "eval_interpolation", "image_size")
# ... those a run started from another run's weights takes from it
FROM_ANOTHER_RUN = ("mean", "std", "channel_order", "eval_crop_fraction", "eval_interpolation")
# timm's (and torchvision's) interpolation names that data.eval_interpolation reproduces
INTERPOLATIONS = ("bilinear", "bicubic")


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """What one set of weights expects; None: the weights say nothing about that field."""
    what: str                                   # names the weights in the console line
    mean: tuple[float, ...] | None = None       # R, G, B, 0..255 units
    std: tuple[float, ...] | None = None
    channel_order: str | None = None            # rgb | bgr: what the model's first layer sees
    eval_crop_fraction: float | None = None     # timm's crop_pct
    eval_interpolation: str | None = None       # how evaluation resizes (timm's interpolation, a run's own)
    image_size: int | None = None               # the side the weights were trained at (timm's input_size)
    interpolation: str | None = None            # the source's own word for it (reported where tfdp has no match)
    assumed: str = ""                           # what tfdp assumed for weights that say nothing, and why

    def values(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in PREPROCESSING if getattr(self, f) is not None}


# keras.applications' preprocessing modes (keras/src/applications/imagenet_utils.py `preprocess_input`, and the
# Rescaling/Normalization layers the newer families build in) in tfdp's terms.
KERAS_MODES: dict[str, dict] = {
    # RGB → BGR, then the BGR mean (103.939, 116.779, 123.68) subtracted, no scaling
    "caffe": {"mean": (123.68, 116.779, 103.939), "std": (1.0, 1.0, 1.0), "channel_order": "bgr"},
    # x / 127.5 - 1
    "tf": {"mean": (127.5,) * 3, "std": (127.5,) * 3, "channel_order": "rgb"},
    # x / 255, then ImageNet's mean and std
    "torch": {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "channel_order": "rgb"},
    # Rescaling(1/128, offset=-1), EfficientNetV2-S/M/L's built-in preprocessing
    "x/128-1": {"mean": (128.0,) * 3, "std": (128.0,) * 3, "channel_order": "rgb"},
}
# zoo model → the mode its Keras ImageNet weights were trained with. ResNets and Inception/MobileNetV2 through
# their module's preprocess_input; MobileNetV3 and the EfficientNets build theirs into the model (tfdp builds them
# without it and normalises on the device instead): MobileNetV3 Rescaling(1/127.5, -1), EfficientNetV2-B*
# Rescaling(1/255) + Normalization(ImageNet), -S/M/L Rescaling(1/128, -1), EfficientNet (V1) Rescaling(1/255) +
# Normalization with its file's mean and "variance" (ImageNet's std: tensorflow/tensorflow#49930) + Rescaling by
# 1/sqrt(std), Keras' mend of that: (x/255 - mean) / std.
KERAS_IMAGENET: dict[str, str] = {
    "resnet50": "caffe", "resnet101": "caffe", "resnet152": "caffe",
    "inception_v3": "tf", "mobilenet_v2": "tf", "mobilenet_v3_large": "tf", "mobilenet_v3_small": "tf",
    **{f"efficientnetv2_{v}": "torch" for v in ("b0", "b1", "b2", "b3")},
    **{f"efficientnet_b{v}": "torch" for v in range(8)},
    **{f"efficientnetv2_{v}": "x/128-1" for v in ("s", "m", "l")},
}
# torchvision's ImageNet weights (its transforms' Normalize, after Resize(256, bilinear, antialias) and
# CenterCrop(224)); timm's default where a file says nothing
TORCHVISION = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "channel_order": "rgb", "eval_interpolation": "bilinear"}


def keras_imagenet(model_cfg: ModelConfig) -> Preprocessing | None:
    mode = KERAS_IMAGENET.get(model_cfg.name)
    if mode is None:  # no Keras weights for it: model.init_from's reader says so
        return None
    return Preprocessing(f"imagenet weights (keras {model_cfg.name}, {mode})", **KERAS_MODES[mode])


def run_dir_of(path: str) -> str | None:
    """The tfdp run `path` belongs to (a run directory, its checkpoint folders and files, its export): the
    nearest of it and its three parents that holds config.yaml and checkpoints/."""
    path = os.path.abspath(path)
    for _ in range(4):
        if os.path.isfile(os.path.join(path, "config.yaml")) and os.path.isdir(os.path.join(path, "checkpoints")):
            return path
        path = os.path.dirname(path)
    return None


def run_config(run_dir: str, what: str, fields: tuple[str, ...] = PREPROCESSING) -> Preprocessing | None:
    """The preprocessing a tfdp run trained with, from its resolved config.yaml (older runs: rgb): `fields` of it."""
    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            data = (yaml_floats.load(f) or {}).get("data") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    found = {k: data[k] for k in fields if k in data}
    if "mean" in found or "std" in found:
        found.setdefault("channel_order", "rgb")
    return checked(Preprocessing(what, **_as_tuples(found)), os.path.join(run_dir, "config.yaml"))


def tfdp_run(spec: str, model_cfg: ModelConfig) -> Preprocessing | None:
    run = run_dir_of(spec)
    # Weights that start another run leave its image size to its config: a run's size is a choice of its recipe,
    # where a timm or keras-hub file's is the one its weights were trained at.
    return run_config(run, f"the weights of run {run}", FROM_ANOTHER_RUN) if run else None


def _safetensors_metadata(path: str) -> dict[str, str]:
    """The header's `__metadata__` (str → str); the header is 8 bytes of length, then JSON."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(size, 100_000_000)))
        return header.get("__metadata__") or {}
    except (OSError, ValueError, struct.error, AttributeError):
        return {}  # the reader says what is wrong with the file


def _timm_cfg(path: str) -> dict | None:
    """timm's pretrained cfg for a .safetensors file: in the file's metadata (`pretrained_cfg` as JSON, or
    `mean`/`std`), or in the `config.json` beside it (the Hugging Face Hub layout timm saves)."""
    metadata = _safetensors_metadata(path)
    try:
        if "pretrained_cfg" in metadata:
            return json.loads(metadata["pretrained_cfg"])
        if "mean" in metadata and "std" in metadata:
            return {k: json.loads(v) for k, v in metadata.items() if k in ("mean", "std", "crop_pct")}
    except ValueError:
        raise UserError(f"model.init_from: {path}: its metadata's pretrained cfg is not JSON") from None
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
    try:
        with open(beside, encoding="utf-8") as f:
            cfg = json.load(f).get("pretrained_cfg")
    except (OSError, ValueError, AttributeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def timm_architecture(path: str) -> str | None:
    """The timm model a .safetensors file's weights are from, where its pretrained cfg or the `config.json` beside
    it names one (`tf_efficientnet_b0`), else None."""
    named = (_timm_cfg(path) or {}).get("architecture")
    if not named:
        try:
            with open(os.path.join(os.path.dirname(os.path.abspath(path)), "config.json"), encoding="utf-8") as f:
                named = json.load(f).get("architecture")
        except (OSError, ValueError, AttributeError):
            return None
    return named if isinstance(named, str) else None


def torch_file(spec: str, model_cfg: ModelConfig) -> Preprocessing:
    cfg = _timm_cfg(spec)
    if cfg is None:
        return Preprocessing(f"{os.path.basename(spec)} (torchvision's ImageNet normalisation)", **TORCHVISION,
                             assumed=f"{os.path.basename(spec)} carries no pretrained cfg (no metadata, no "
                                     f"config.json beside it): torchvision's ImageNet mean/std and bilinear resize "
                                     f"are assumed, as timm assumes for such a file")
    try:
        found = {"mean": tuple(255 * float(m) for m in cfg["mean"]), "std": tuple(255 * float(s) for s in cfg["std"]),
                 "channel_order": "rgb"}
        if cfg.get("crop_pct") is not None:
            found["eval_crop_fraction"] = float(cfg["crop_pct"])
        if cfg.get("input_size"):   # (channels, height, width)
            found["image_size"] = int(cfg["input_size"][-1])
        if cfg.get("interpolation") in INTERPOLATIONS:
            found["eval_interpolation"] = cfg["interpolation"]
    except (KeyError, TypeError, ValueError, IndexError):
        raise UserError(f"model.init_from: {spec}: its pretrained cfg has no usable mean and std "
                        f"(got {str(cfg)[:120]})") from None
    return checked(Preprocessing(f"{os.path.basename(spec)} (its timm pretrained cfg)",
                                 interpolation=cfg.get("interpolation"), **found), spec)


def _as_tuples(found: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in found.items()}


def checked(p: Preprocessing, where: str) -> Preprocessing:
    """Values read from a file hold what the config's validation would ask of them."""
    bad = ((p.mean is not None and (len(p.mean) != 3 or not all(isinstance(m, (int, float)) for m in p.mean)))
           or (p.std is not None and (len(p.std) != 3 or not all(isinstance(s, (int, float)) and s > 0
                                                                  for s in p.std)))
           or p.channel_order not in (None, "rgb", "bgr")
           or (p.eval_crop_fraction is not None and not 0 < p.eval_crop_fraction <= 1)
           or (p.image_size is not None and not (isinstance(p.image_size, int) and p.image_size > 0))
           or p.eval_interpolation not in (None, "fast", *INTERPOLATIONS))
    if bad:
        raise UserError(f"model.init_from: {where}: its preprocessing (mean {p.mean}, std {p.std}, channel order "
                        f"{p.channel_order}, crop {p.eval_crop_fraction}, image size {p.image_size}) is not 3 means, "
                        f"3 positive stds, rgb|bgr, a crop in (0, 1] and a positive size; set data.mean, data.std, "
                        f"data.channel_order, data.eval_crop_fraction, data.image_size")
    return dataclasses.replace(p, mean=tuple(float(m) for m in p.mean) if p.mean else None,
                               std=tuple(float(s) for s in p.std) if p.std else None,
                               eval_crop_fraction=float(p.eval_crop_fraction) if p.eval_crop_fraction else None)


def _keras_hub_converter(path: str) -> dict | None:
    """A keras-hub preset's image converter config (image_converter.json, or the one inside preprocessor.json)."""
    for name in ("image_converter.json", "preprocessor.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                config = json.load(f).get("config", {})
        except (OSError, ValueError, AttributeError):
            continue
        config = config.get("image_converter", {}).get("config", config) if name == "preprocessor.json" else config
        if isinstance(config, dict) and ("scale" in config or "image_size" in config):
            return config
    return None


def _per_channel(value, default: float) -> tuple[float, ...]:
    value = default if value is None else value
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),) * 3


def keras_hub_preset(spec: str, model_cfg: ModelConfig) -> Preprocessing | None:
    """The converter's x * scale + offset as (x - mean) / std (std = 1/scale, mean = -offset/scale), its image
    size, and a crop of the whole image (it resizes the largest centred square: crop_to_aspect_ratio)."""
    config = _keras_hub_converter(spec)
    if config is None:
        return None
    where = os.path.join(spec, "image_converter.json")
    try:
        scale, offset = _per_channel(config.get("scale"), 1.0), _per_channel(config.get("offset"), 0.0)
        found = {"std": tuple(1.0 / s for s in scale), "mean": tuple(-o / s for o, s in zip(offset, scale)),
                 "channel_order": "rgb", "eval_crop_fraction": 1.0}
        if config.get("image_size"):
            found["image_size"] = int(config["image_size"][-1])
    except (TypeError, ValueError, ZeroDivisionError, IndexError):
        raise UserError(f"model.init_from: {where}: its scale/offset/image_size are not numbers "
                        f"(got {str(config)[:120]})") from None
    return checked(Preprocessing(f"keras-hub preset {os.path.basename(os.path.normpath(spec))} (its image converter)",
                                 interpolation=config.get("interpolation"), **found), where)


def _is_keras_hub_preset(spec: str) -> bool:
    try:
        with open(os.path.join(spec, "config.json"), encoding="utf-8") as f:
            return str(json.load(f).get("module", "")).startswith("keras_hub")
    except (OSError, ValueError, AttributeError):
        return False


def _is_file(*suffixes: str) -> Callable[[str], bool]:
    return lambda spec: os.path.isfile(spec) and spec.lower().endswith(suffixes)


# kind of model.init_from (as tfdp/models/weights.py SOURCES reads them) → (matches, its preprocessing); a kind
# not listed (a .weights.h5 or .keras file outside a tfdp run) says nothing: the config's values stay.
SOURCES: dict[str, tuple[Callable[[str], bool], Callable[[str, ModelConfig], Preprocessing | None]]] = {
    "imagenet": (lambda spec: spec == "imagenet", lambda spec, model_cfg: keras_imagenet(model_cfg)),
    "safetensors": (_is_file(".safetensors"), torch_file),
    "keras_hub": (_is_keras_hub_preset, keras_hub_preset),
    "tfdp_run": (lambda spec: os.path.exists(spec) and run_dir_of(spec) is not None, tfdp_run),
}


def from_weights(model_cfg: ModelConfig) -> Preprocessing | None:
    """The preprocessing `model.init_from`'s weights were trained with, where they say."""
    spec = model_cfg.init_from
    if not spec or "://" in spec:
        return None
    path = spec if spec == "imagenet" else os.path.expanduser(spec)
    for matches, read in SOURCES.values():
        if matches(path):
            return read(path, model_cfg)
    return None


def own_run(model_dir: str) -> Preprocessing | None:
    """The run in `model_dir`, when it has checkpoints to continue from (or evaluate, export, predict with)."""
    path = os.path.abspath(os.path.expanduser(model_dir))
    checkpoints = os.path.join(path, "checkpoints")
    if "://" in model_dir or not os.path.isdir(checkpoints) or not os.listdir(checkpoints):
        return None
    return run_config(path, f"the run's own checkpoints in {path}") if os.path.isfile(
        os.path.join(path, "config.yaml")) else None


# A model's native image size in its name, as timm names them: the last number after the patch or window size
# (vit_small_patch16_224, swin_base_patch4_window12_384, vit_mediumd_patch16_reg4_gap_384); a RegNet's or
# EfficientNet's trailing number is its width or variant, not a size.
NATIVE_SIZE = re.compile(r"(?:patch|window)\d+(?:_[a-z0-9]+)*?_(\d{2,4})$")


def native_size(name: str) -> int | None:
    """The side `name` was designed for, where its name says (timm's `_224`), else None."""
    found = NATIVE_SIZE.search(name)
    return int(found.group(1)) if found else None


def resolve(cfg: Config, set_by_user: Collection[str], from_run: bool = True) -> None:
    """Fills `cfg.data`'s preprocessing fields not in `set_by_user` from the weights the run starts from (`from_run`:
    the run's own checkpoints in model_dir first; False where a command starts from model.init_from alone), then
    the image size from the model's name where nothing else gave one."""
    found = (own_run(cfg.model_dir) if from_run else None) or from_weights(cfg.model)
    values = found.values() if found is not None else {}
    for field, value in values.items():
        if field not in set_by_user:
            setattr(cfg.data, field, value)
    size = native_size(cfg.model.name)
    if size and "image_size" not in set_by_user and "image_size" not in values and not (
            found is not None and found.what.startswith("the run's own")):
        cfg.data.image_size = size


def _numbers(values) -> str:
    return ",".join(f"{v:.4g}" for v in values)


def line(model_cfg: ModelConfig, data_cfg: DataConfig) -> str | None:
    """The one console line saying what the data config took from `model.init_from`'s weights; None where that
    is nothing but the defaults (torchvision's ImageNet statistics are tfdp's own)."""
    found = from_weights(model_cfg)
    if found is None:
        return None
    taken = {f: v for f, v in found.values().items() if getattr(data_cfg, f) == v}
    defaults = {f.name: f.default for f in dataclasses.fields(data_cfg)}
    if all(v == defaults[f] for f, v in taken.items()):  # nothing the config would not have had anyway
        return None
    parts = [str(taken["channel_order"]).upper()] if "channel_order" in taken else []
    parts += [f"{name} {_numbers(taken[name])}" for name in ("mean", "std") if name in taken]
    if "mean" in taken or "std" in taken:
        parts[-1] += " (R,G,B)"
    if "eval_crop_fraction" in taken:
        parts.append(f"eval crop {taken['eval_crop_fraction']:.4g}")
    if "image_size" in taken:
        parts.append(f"image size {taken['image_size']}")
    own = [f"data.{f}" for f in found.values() if f not in taken]
    kept = f"; {', '.join(own)} from the config" if own else ""
    if "eval_interpolation" in taken:
        parts.append(f"{taken['eval_interpolation']} resize")
    interpolation = (f"; the weights' {found.interpolation} interpolation has no match in data.eval_interpolation "
                     f"(fast, bilinear, bicubic): fast is used" if found.interpolation and not found.eval_interpolation
                     and found.interpolation not in INTERPOLATIONS else "")
    fields = "/".join(f for f in PREPROCESSING if f in found.values())
    return (f"tfdp: preprocessing from {found.what}: {', '.join(parts)}{kept}{interpolation}; "
            f"set data.{fields} to override")


def _same(ours, theirs) -> bool:
    """Equal, numbers to 1e-4 of their size (a recipe's 123.675 is ImageNet's 0.485 x 255 as the weights give it)."""
    if isinstance(ours, tuple) and isinstance(theirs, tuple) and len(ours) == len(theirs):
        return all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(ours, theirs))
    return ours == theirs


def differing_line(model_cfg: ModelConfig, data_cfg: DataConfig) -> str | None:
    """A console line where the config's own normalisation (data.mean, std, channel_order) is not what
    `model.init_from`'s weights were trained with. The config wins, as documented; but weights fed pixels
    normalised otherwise lose accuracy with no other sign (a recipe written for a ViT's 0.5/0.5 given DINOv2's
    ImageNet-normalised weights), so the run says it once."""
    found = from_weights(model_cfg)
    if found is None:
        return None
    theirs = found.values()
    differ = [f for f in ("mean", "std", "channel_order") if f in theirs and not _same(getattr(data_cfg, f),
                                                                                      theirs[f])]
    if not differ:
        return None

    def shown(value) -> str:
        return _numbers(value) if isinstance(value, tuple) else str(value)
    ours = ", ".join(f"data.{f} {shown(getattr(data_cfg, f))}" for f in differ)
    want = ", ".join(f"{f} {shown(theirs[f])}" for f in differ)
    return (f"tfdp: preprocessing: the config's {ours} differ from what the weights were trained with ({found.what}: "
            f"{want}); the config's are used (leave them out of it to take the weights')")


def _hub_config(path: str) -> dict:
    """The `config.json` beside a timm .safetensors file (the Hugging Face Hub layout timm saves), or {}."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(path)), "config.json"), encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def label_names(spec: str, num_classes: int) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(names, descriptions) of a timm file's classes, in label order, where it carries them (`label_names`, a
    list or an {index: name} map, and `label_descriptions` {name: text}, at the top of its config.json or in its
    pretrained cfg); None where it has none or not one per class."""
    path = os.path.expanduser(spec)
    if not (os.path.isfile(path) and path.lower().endswith(".safetensors")):
        return None
    beside = _hub_config(path)
    timm_cfg = _timm_cfg(path) or {}
    names = beside.get("label_names") or timm_cfg.get("label_names")
    if isinstance(names, dict):
        try:
            names = [names.get(str(k), names.get(k)) for k in range(num_classes)]
        except TypeError:
            return None
    if not isinstance(names, list) or len(names) != num_classes or not all(isinstance(n, str) for n in names):
        return None
    described = beside.get("label_descriptions") or timm_cfg.get("label_descriptions") or {}
    text = tuple(str(described.get(n, n)) for n in names) if isinstance(described, dict) and described else ()
    return tuple(names), text


def _shown_size(cfg: Config, found: Preprocessing | None) -> str:
    """Where data.image_size came from."""
    size = cfg.data.image_size
    if found is not None and found.image_size == size:
        return f"image size {size} px, from {found.what}"
    if native_size(cfg.model.name) == size:
        return f"image size {size} px, the one model {cfg.model.name}'s name says"
    return f"image size {size} px, the config's"


def assumed_line(model_cfg: ModelConfig) -> str | None:
    """The console line saying what tfdp assumed for weights that carry no preprocessing of their own (a timm
    state dict saved without its pretrained cfg), and how to change it; None where they carry theirs."""
    found = from_weights(model_cfg)
    if found is None or not found.assumed:
        return None
    return (f"tfdp: assumed: {found.assumed}; weights trained otherwise (many ViTs: mean and std 0.5) are misread "
            f"without a word: set data.mean, data.std and data.eval_interpolation to theirs")


def assumptions(cfg: Config) -> list[str]:
    """What a command that starts from model.init_from's weights alone feeds them, each with where it comes from
    and how to change it: said once, so that weights misread (a ViT trained with mean/std 0.5 fed ImageNet's
    statistics is 47 % off, with no other sign) are seen at once."""
    found = from_weights(cfg.model)
    d = cfg.data
    source = found.what if found is not None else "tfdp's defaults (the weights say nothing)"
    norm = (f"tfdp: assumed: {d.channel_order.upper()}, mean {_numbers(d.mean)}, std {_numbers(d.std)} (R,G,B, "
            f"0..255 units), from {source}")
    if found is not None and found.assumed:
        norm += f" ({found.assumed})"
    eval_size = d.eval_image_size or d.image_size
    crop = (f"tfdp: assumed: evaluation crop {d.eval_crop_fraction:.4g} of the shorter side at {eval_size} px, "
            + ("decoded alone and resized bilinearly (fast)" if d.eval_interpolation == "fast" else
               f"after a {d.eval_interpolation} resize of the shorter side to {int(eval_size / d.eval_crop_fraction)} "
               f"px antialiased as Pillow's")
            + "; set data.eval_crop_fraction, data.eval_interpolation (fast, bilinear, bicubic) to change")
    return [norm + "; set data.mean, data.std, data.channel_order to change",
            f"tfdp: assumed: {_shown_size(cfg, found)}; set data.image_size to change",
            crop]
