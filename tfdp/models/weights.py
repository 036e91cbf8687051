"""`model.init_from`: start a fresh run from weights trained elsewhere.

A source is read into one common form, `Weights` (layer name → that layer's
values in Keras' variable order), by the reader its kind names in `SOURCES`;
`load_into` then copies it onto the model, layer by layer, by name:

- imagenet: Keras' own ImageNet files for the keras.applications models
  (`tfdp.models.keras_imagenet`, which registers this kind of source).
- a tfdp run directory (its best checkpoint, else its newest), a checkpoint
  folder (`checkpoints/epoch-0003`), a `.weights.h5` file (from `tfdp train`, or
  a legacy Keras `.h5`) or a `.keras` file (from `tfdp export` or `model.save`).
- a `.safetensors` PyTorch state dict (torchvision's or timm's layout) for the
  models in `TORCH_LAYOUTS`, each family's mapping registered beside it: names
  mapped, kernels transposed, batch-norm running statistics loaded.
- a keras-hub preset folder (what `save_to_preset` writes: config.json,
  model.weights.h5, and for a task its head in task.weights.h5) for the
  families that register a reader of its backbone class (`KERAS_HUB_LAYOUTS`).
- a Hugging Face Hub repository (`hf-hub:timm/NAME`, `hf://ORG/NAME`) is read
  as the timm file or keras-hub preset folder it holds, once `tfdp train` has
  fetched it into the Hub's cache (`tfdp.rundir.hub`), as a bucket's weights
  are copied into data.cache_dir (`tfdp.rundir.init_from`).

Every layer of the model must find its weights, with the same shapes, and every
tensor of the source must find its layer, so a file of another architecture
stops the run with one line naming the first tensor that does not fit. Two
exceptions: the classifier (the model's last layer with weights) is left as
initialised where only its class count differs, and `model.init_exclude`
(fnmatch patterns over layer names and `layer/variable` paths) keeps any layer
or variable as initialised. A layer that defines `adapt_loaded(values)` fits
values of another shape to its own first (a ViT's position embeddings learned
at another image size are resampled). One line reports what was loaded and
what is new.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import io
import json
import os
import re
import zipfile
from typing import Callable

import h5py
import keras
import numpy as np

from tfdp.rundir import hub
from tfdp.rundir.checkpoints import STATE, WEIGHTS, CheckpointStore
from tfdp.config import pretrained
from tfdp.config import DataConfig, ModelConfig
from tfdp.errors import UserError, first_line
from tfdp.models.registry import HEAD_LAYERS
from tfdp.startup.console import say


@dataclasses.dataclass
class Weights:
    """What a source holds, ready to assign: layer name → its values in the layer's variable order."""
    what: str                                   # names the source in messages
    values: dict[str, list[np.ndarray]]
    # layer name → each value's name in the source (a torch key, an h5 path), for messages
    names: dict[str, list[str]]
    # fnmatch patterns of source layers that may have no place in the model (preprocessing tfdp does not build)
    optional: frozenset[str] = frozenset()


# ---------------------------------------------------------------- Keras files


_LAYER_VARS = re.compile(r"(^|/)layers/[^/]+/vars$")


def read_keras_h5(f: h5py.File, what: str) -> Weights:
    """A Keras 3 weights file (layers' groups carry their layer's name) or a legacy Keras 2 one (`layer_names`)."""
    values, names = {}, {}
    if "layer_names" in f.attrs:  # legacy format: keras.applications' ImageNet files
        root = f["model_weights"] if "model_weights" in f else f
        for layer in root.attrs["layer_names"]:
            layer = layer.decode() if isinstance(layer, bytes) else str(layer)
            weight_names = [w.decode() if isinstance(w, bytes) else str(w)
                            for w in root[layer].attrs.get("weight_names", [])]
            if weight_names:
                values[layer] = [np.asarray(root[layer][w]) for w in weight_names]
                names[layer] = weight_names
        return Weights(what, values, names)

    def visit(path, obj):
        if isinstance(obj, h5py.Group) and _LAYER_VARS.search(path) and len(obj) and "name" in obj.attrs:
            layer = str(obj.attrs["name"])
            values[layer] = [np.asarray(obj[str(i)]) for i in range(len(obj))]
            names[layer] = [f"{path}/{i}" for i in range(len(obj))]
    f.visititems(visit)
    return Weights(what, values, names)


@contextlib.contextmanager
def keras_h5(source, what: str):
    """h5py's reader of a Keras weights file (`source`: a path, or the bytes of one in a file object); a file that
    cannot be read (cut short, damaged, a group without its variables) is one line naming `what`."""
    try:
        with h5py.File(source, "r") as f:
            yield f
    except (OSError, KeyError) as e:
        raise UserError(f"model.init_from: cannot read {what} as a Keras weights file ({first_line(e, 120)})"
                        ) from None


def read_weights_file(path: str, what: str | None = None) -> Weights:
    with keras_h5(path, what or path) as f:
        return read_keras_h5(f, what or path)


def read_keras_file(path: str) -> Weights:
    """A `.keras` file is a zip archive; its weights are the `model.weights.h5` inside."""
    try:
        with zipfile.ZipFile(path) as archive:
            data = archive.read("model.weights.h5")
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise UserError(f"model.init_from: {path} is not a .keras file with weights ({e})") from None
    with keras_h5(io.BytesIO(data), f"the weights inside {path}") as f:
        return read_keras_h5(f, path)


def read_checkpoint_folder(path: str) -> Weights:
    return read_weights_file(os.path.join(path, WEIGHTS), f"checkpoint {path}")


def read_run_dir(path: str) -> Weights:
    """A run's best checkpoint (as `tfdp evaluate` and `export` take it), else its newest one."""
    store = CheckpointStore(path)
    if os.path.exists(store.best_weights):
        return read_weights_file(store.best_weights, f"the best checkpoint of run {path}")
    found = store.checkpoints()
    if not found:
        raise UserError(f"model.init_from: run directory {path} has no checkpoint yet")
    return read_checkpoint_folder(found[-1][2])


# ---------------------------------------------------------------- PyTorch state dicts (torchvision / timm layout)


# zoo name → a reader of its PyTorch state dicts (tensors, model config, what) → Weights. Each family registers its
# readers in its own file, beside its architecture (`register_torch_layout`): a renaming of torch modules to its
# layers (`renamed_modules`), or more where the layouts differ (fused attention, layer scale, position embeddings).
TORCH_LAYOUTS: dict[str, Callable[[dict[str, np.ndarray], ModelConfig, str], Weights]] = {}


# zoo name → whose files its readers take ("timm", "torchvision", "keras-hub"), as `tfdp models` lists them; a model
# whose state-dict reader registered no origins is listed as reading "PyTorch" state dicts.
WEIGHT_ORIGINS: dict[str, tuple[str, ...]] = {}


def add_origins(names, origins: tuple[str, ...]) -> None:
    """Records that the models `names` read files of `origins` (see `WEIGHT_ORIGINS`)."""
    for name in names:
        WEIGHT_ORIGINS[name] = tuple(dict.fromkeys((*WEIGHT_ORIGINS.get(name, ()), *origins)))


def register_torch_layout(*names: str, origins: tuple[str, ...] = ()):
    """Registers a state-dict reader for the zoo models `names` (see `TORCH_LAYOUTS`), and whose layouts it reads
    (`origins`: "timm", "torchvision"; see `WEIGHT_ORIGINS`)."""
    def add(fn):
        for name in names:
            TORCH_LAYOUTS[name] = fn
        add_origins(names, origins)
        return fn
    return add



def torch_module_values(params: dict[str, np.ndarray], layer: str) -> tuple[list[np.ndarray], list[str]]:
    """One torch module's tensors in Keras' variable order, in Keras' layouts."""
    if "running_mean" in params:  # batch norm: gamma, beta, moving mean, moving variance
        order = ["weight", "bias", "running_mean", "running_var"]
        return [params[k] for k in order], order
    weight = params["weight"]
    if weight.ndim == 4:  # convolution (grouped too): OIHW → HWIO
        kernel = weight.transpose(2, 3, 1, 0)
    elif weight.ndim == 2:  # linear: (out, in) → (in, out)
        kernel = weight.T
    else:
        return [weight], ["weight"]
    order = ["weight"] + (["bias"] if "bias" in params else [])
    return [kernel] + ([params["bias"]] if "bias" in params else []), order


def read_safetensors(path: str, model_cfg: ModelConfig) -> Weights:
    if model_cfg.name not in TORCH_LAYOUTS:
        raise UserError(f"model.init_from: {path} is a PyTorch state dict, but model '{model_cfg.name}' has no "
                        f"torchvision or timm layout to map it onto (models that have one: "
                        f"{', '.join(sorted(TORCH_LAYOUTS))})")
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise UserError(f"model.init_from: cannot read {path} as safetensors ({str(e).splitlines()[0][:120]})"
                        ) from None
    return torch_weights(tensors, model_cfg, path)


def torch_weights(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> Weights:
    """A torchvision/timm state dict as `Weights` for the zoo model `model_cfg.name`, by its family's reader."""
    return TORCH_LAYOUTS[model_cfg.name](tensors, model_cfg, what)


def torch_modules(tensors: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """A state dict's tensors by module (`layer1.0.bn1.weight` → module `layer1.0.bn1`, parameter `weight`)."""
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        module, _, param = key.rpartition(".")
        if param != "num_batches_tracked":  # PyTorch's batch-norm step counter: nothing in Keras holds it
            modules.setdefault(module, {})[param] = value
    return modules


def renamed_modules(modules: dict[str, dict[str, np.ndarray]], rename: Callable[[str], str | None],
                    model_cfg: ModelConfig, what: str,
                    convert: Callable[[dict[str, np.ndarray], str], tuple[list, list[str]]] = torch_module_values
                    ) -> Weights:
    """`Weights` of torch modules each renamed to its Keras layer (`rename`; None: no place, the "does not fit"
    line) and converted to Keras' layouts (`convert(params, layer)` → (values, parameter names))."""
    values, names = {}, {}
    for module, params in modules.items():
        layer = rename(module)
        if layer is None:
            first = sorted(params)[0]
            raise UserError(f"model.init_from: {what} does not fit model '{model_cfg.name}': tensor "
                            f"{module}.{first} {tuple(params[first].shape)} has no place in it (another architecture?)")
        arrays, order = convert(params, layer)
        values[layer], names[layer] = arrays, [f"{module}.{p}" for p in order]
    return Weights(what, values, names)


# ---------------------------------------------------------------- keras-hub presets

# keras-hub backbone class name (a preset's config.json `class_name`) → a reader (preset folder, its config.json,
# its task.json or None, model config, what) → Weights. Each family registers its own, beside its architecture.
KERAS_HUB_LAYOUTS: dict[str, Callable[[str, dict, dict | None, ModelConfig, str], Weights]] = {}
KERAS_HUB_FILES = ("config.json", "model.weights.h5", "task.json", "task.weights.h5")


def by_module(tensors: dict[str, np.ndarray], modules: re.Pattern, model_cfg: ModelConfig, what: str,
              whole: tuple[str, ...] = ()) -> dict[str, dict[str, np.ndarray]]:
    """A timm-style state dict's tensors by module (`blocks.0.attn.qkv.weight` → module `blocks.0.attn.qkv`,
    parameter `weight`); `whole`: keys that are a module themselves (a ViT's tokens; parameter ""). A tensor whose
    module `modules` does not match is the one "does not fit" line."""
    found: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        module, param = (key, "") if key in whole else key.rpartition(".")[::2]
        if not modules.fullmatch(module):
            raise UserError(f"model.init_from: {what} does not fit model '{model_cfg.name}': tensor {key} "
                            f"{tuple(value.shape)} has no place in it (another architecture?)")
        found.setdefault(module, {})[param] = value
    return found


def register_keras_hub_layout(*class_names: str, models=()):
    """Registers a keras-hub preset reader for the backbone classes `class_names` (see `KERAS_HUB_LAYOUTS`), and the
    zoo `models` its presets fit (`WEIGHT_ORIGINS`)."""
    def add(fn):
        for name in class_names:
            KERAS_HUB_LAYOUTS[name] = fn
        add_origins(models, ("keras-hub",))
        return fn
    return add


def h5_groups(path: str) -> dict[str, tuple[str, list[np.ndarray]]]:
    """A Keras 3 weights file's layers: the path of each `.../vars` group (without it) → (the layer's name, its
    variables in order)."""
    found = {}
    with keras_h5(path, path) as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Group) and (name == "vars" or name.endswith("/vars")):
                found[name[:-len("/vars")] if "/" in name else ""] = (
                    str(obj.attrs.get("name", "")), [np.asarray(obj[str(i)]) for i in range(len(obj))])
        f.visititems(visit)
    return found


def keras_hub_head(preset: str) -> tuple[list[np.ndarray], list[str]] | None:
    """The classifier of a keras-hub ImageClassifier preset (its `predictions` Dense in task.weights.h5: kernel and
    bias, in Keras' layout) and where each came from; None for a backbone-only preset."""
    path = os.path.join(preset, "task.weights.h5")
    if not os.path.isfile(path):
        return None
    for group, (name, arrays) in h5_groups(path).items():
        if name == "predictions" and group.startswith("layers/"):
            return arrays, [f"task.weights.h5 {group}/vars/{i}" for i in range(len(arrays))]
    return None


def is_keras_hub_preset(path: str) -> bool:
    """A folder whose config.json names a keras-hub class (`"module": "keras_hub..."`)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return str(json.load(f).get("module", "")).startswith("keras_hub")
    except (OSError, ValueError, AttributeError):
        return False


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"model.init_from: cannot read {path} ({first_line(e)[:120]})") from None


def read_keras_hub_preset(path: str, model_cfg: ModelConfig) -> Weights:
    """A keras-hub preset folder: its backbone's weights, and the classifier's where it holds a task."""
    backbone = _read_json(os.path.join(path, "config.json")) or {}
    kind = backbone.get("class_name", "?")
    if kind not in KERAS_HUB_LAYOUTS:
        raise UserError(f"model.init_from: {path} is a keras-hub {kind} preset; tfdp reads the presets of "
                        f"{', '.join(sorted(KERAS_HUB_LAYOUTS))} only")
    if not os.path.isfile(os.path.join(path, "model.weights.h5")):
        raise UserError(f"model.init_from: keras-hub preset {path} has no weights (no model.weights.h5 beside its "
                        f"config.json): save it with save_to_preset from a model that holds them")
    task = _read_json(os.path.join(path, "task.json"))
    if task is None or not os.path.isfile(os.path.join(path, "task.weights.h5")):
        task = None   # a backbone alone: the classifier starts new (load_into says so)
    return KERAS_HUB_LAYOUTS[kind](path, backbone, task, model_cfg, f"keras-hub preset {path}")


# ---------------------------------------------------------------- kinds of source


@dataclasses.dataclass(frozen=True)
class Source:
    """A kind of `init_from` value: whether a value is one, and how to read it."""
    describe: str
    matches: Callable[[str], bool]
    read: Callable[[str, ModelConfig, DataConfig], Weights]


def _has_suffix(*suffixes: str) -> Callable[[str], bool]:
    return lambda spec: os.path.isfile(spec) and spec.lower().endswith(suffixes)


# kind → source; the first that matches an `init_from` value reads it. A family whose weights come from elsewhere
# adds its own kind (`register_source`: keras.applications' `imagenet`, tfdp.models.keras_imagenet).
SOURCES: dict[str, Source] = {
    "run_dir": Source("a tfdp run directory", lambda spec: os.path.isdir(os.path.join(spec, "checkpoints")),
                      lambda spec, *_: read_run_dir(spec)),
    "checkpoint": Source("a checkpoint folder", lambda spec: os.path.isfile(os.path.join(spec, WEIGHTS))
                         and os.path.isfile(os.path.join(spec, STATE)), lambda spec, *_: read_checkpoint_folder(spec)),
    "keras": Source("a .keras file", _has_suffix(".keras"), lambda spec, *_: read_keras_file(spec)),
    "keras_weights": Source("a .weights.h5 (or Keras .h5) file", _has_suffix(".h5"),
                            lambda spec, *_: read_weights_file(spec)),
    "safetensors": Source("a .safetensors PyTorch state dict", _has_suffix(".safetensors"),
                          lambda spec, model_cfg, _: read_safetensors(spec, model_cfg)),
    "keras_hub": Source("a keras-hub preset folder", is_keras_hub_preset,
                        lambda spec, model_cfg, _: read_keras_hub_preset(spec, model_cfg)),
}


def register_source(kind: str, source: Source) -> None:
    """Adds a kind of `init_from` value (see `SOURCES`), tried before the files' kinds."""
    ordered = {kind: source, **{k: s for k, s in SOURCES.items() if k != kind}}
    SOURCES.clear()
    SOURCES.update(ordered)


def read_source(spec: str, model_cfg: ModelConfig, data_cfg: DataConfig) -> Weights:
    """The weights `spec` names, read by the first kind of source that matches it."""
    if hub.is_refused_handle(spec):
        raise UserError(hub.refusal(spec, "model.init_from"))
    if "://" in spec or hub.is_handle(spec):
        raise UserError(f"model.init_from: {spec}: the weights' readers take a local path (`tfdp train` copies a "
                        f"bucket's weights into data.cache_dir, and fetches a Hugging Face Hub repository into its "
                        f"cache, first: tfdp.rundir)")
    path = os.path.expanduser(spec)
    for source in SOURCES.values():
        if source.matches(path):
            return source.read(path, model_cfg, data_cfg)
    kinds = ", ".join(s.describe for s in SOURCES.values())
    if not os.path.exists(path) and not re.search(r"[./\\]", spec):
        raise UserError(f"model.init_from: unknown kind of weights '{spec}', and no file or folder of that name "
                        f"(it takes {kinds})")
    if not os.path.exists(path):
        raise UserError(f"model.init_from: no such file or directory: {spec}")
    if path.lower().endswith((".pth", ".pt", ".bin", ".ckpt")):
        raise UserError(f"model.init_from: {spec} is a pickled PyTorch file; save its state dict as .safetensors "
                        f"first (see docs/pretrained-weights.md)")
    raise UserError(f"model.init_from: cannot tell what kind of weights {spec} holds (it takes {kinds})")


# ---------------------------------------------------------------- loading into the model


def layers_with_weights(model: keras.Layer) -> list[keras.Layer]:
    """Every layer that owns variables, nested models walked, in build order, each once."""
    found, seen = [], set()

    def walk(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if isinstance(layer, keras.Model):
            for child in layer.layers:
                walk(child)
        elif own_variables(layer):
            found.append(layer)
    walk(model)
    return found


def own_variables(layer: keras.Layer) -> list:
    """A layer's variables in the order Keras saves them (`Layer.save_own_variables`)."""
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def _excluded(layer: str, variable: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(layer, p) or fnmatch.fnmatchcase(f"{layer}/{variable}", p) for p in patterns)


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def load_into(model: keras.Model, weights: Weights, model_cfg: ModelConfig) -> tuple[list[str], list[str]]:
    """Assigns `weights` to `model` (mirrored variables too); returns (loaded layers, layers left as initialised).

    Nothing is assigned until every layer has been checked, so a file that
    does not fit leaves the model as it was.
    """
    layers = layers_with_weights(model)
    check_exclusions(layers, weights, model_cfg)
    heads = {id(layer) for layer in layers[-1:]} | {
        id(layer) for layer in layers if any(fnmatch.fnmatchcase(layer.name, p) for p in HEAD_LAYERS.get(
            model_cfg.name, ()))}
    # A source with no classifier at all (DINOv2's weights, a keras-hub backbone, timm's num_classes=0) holds a
    # feature extractor: the classifier starts new, as timm's load_pretrained leaves it.
    headless = not any(layer.name in weights.values for layer in layers if id(layer) in heads)
    plan, loaded, new, used, notes = [], [], [], set(), []
    for layer in layers:
        variables = own_variables(layer)
        keep = [_excluded(layer.name, v.name, model_cfg.init_exclude) for v in variables]
        if all(keep):
            new.append(f"{layer.name} (init_exclude)")
            used.add(layer.name)
            continue
        if headless and id(layer) in heads:
            new.append(f"{layer.name} (the source has no classifier)")
            continue
        if layer.name not in weights.values:
            v = variables[0]
            raise UserError(f"model.init_from: {weights.what} does not fit model '{model_cfg.name}': it has nothing "
                            f"for {layer.name}/{v.name} {_shape(v)} (another architecture?)")
        values, names = weights.values[layer.name], weights.names[layer.name]
        used.add(layer.name)
        if len(values) != len(variables):
            raise UserError(f"model.init_from: {weights.what} does not fit model '{model_cfg.name}': layer "
                            f"{layer.name} has {len(variables)} variables, the source {len(values)} ({names[0]}...)")
        if hasattr(layer, "adapt_loaded"):
            values, note = layer.adapt_loaded(values)
            notes += [note] if note else []
        if id(layer) in heads and _only_classes_differ(variables, values):
            new.append(f"{layer.name} ({model_cfg.num_classes} classes, the source has {_shape(values[0])[-1]})")
            continue
        for v, value, name, skip in zip(variables, values, names, keep):
            if not skip and _shape(v) != _shape(value):
                raise UserError(f"model.init_from: {weights.what} does not fit model '{model_cfg.name}': "
                                f"{layer.name}/{v.name} is {_shape(value)} there ({name}), the model's is {_shape(v)}")
        plan += [(v, value) for v, value, skip in zip(variables, values, keep) if not skip]
        if any(keep):
            new.append(f"{layer.name} (partly, init_exclude)")
        else:
            loaded.append(layer.name)
    unused = [name for name in weights.values if name not in used
              and not any(fnmatch.fnmatchcase(name, p) for p in weights.optional)
              and not _excluded(name, "*", model_cfg.init_exclude)]
    if unused:
        name = weights.names[unused[0]][0]
        raise UserError(f"model.init_from: {weights.what} does not fit model '{model_cfg.name}': its {name} "
                        f"{_shape(weights.values[unused[0]][0])} has no place in the model (another architecture?)")
    for note in notes:
        say(f"tfdp: init_from: {note}")
    for v, value in plan:
        v.assign(np.asarray(value).astype(keras.backend.standardize_dtype(v.dtype)))
    return loaded, new


def check_exclusions(layers: list, weights: Weights, model_cfg: ModelConfig) -> None:
    """Each `model.init_exclude` pattern matches a layer or `layer/variable` of the model or a layer of the source:
    a mistyped one would load what it meant to leave out, with only the report line's "new: none" to tell (as
    `train.freeze` refuses a pattern that matches nothing)."""
    for pattern in model_cfg.init_exclude:
        if not (any(_excluded(layer.name, v.name, (pattern,)) for layer in layers for v in own_variables(layer))
                or any(_excluded(name, "*", (pattern,)) for name in weights.values)):
            prefixes = list(dict.fromkeys(layer.name.split("_")[0] for layer in layers))
            raise UserError(f"model.init_exclude: '{pattern}' matches no layer (or layer/variable) of model "
                            f"'{model_cfg.name}' nor of {weights.what} (the model's layers start "
                            f"{', '.join(prefixes[:12])}, ...)")


def _only_classes_differ(variables, values) -> bool:
    """The classifier's kernel and bias differ in their last axis (the classes) only."""
    shapes = [(_shape(v), _shape(x)) for v, x in zip(variables, values)]
    return any(a != b for a, b in shapes) and all(a[:-1] == b[:-1] for a, b in shapes)


def init_from(model: keras.Model, model_cfg: ModelConfig, data_cfg: DataConfig, resumed: bool) -> None:
    """The trainer's hook, after the checkpoint restore: fills a fresh run's model from `model.init_from`."""
    if not model_cfg.init_from:
        return
    if resumed:
        say(f"tfdp: init_from: resumed run, continuing from its own checkpoint; model.init_from "
            f"({model_cfg.init_from}) applies to a fresh run only")
        return
    weights = read_source(model_cfg.init_from, model_cfg, data_cfg)
    loaded, new = load_into(model, weights, model_cfg)
    say(f"tfdp: init_from: loaded {len(loaded)} of {len(loaded) + len(new)} layers from {weights.what}; "
        f"new: {', '.join(new) if new else 'none'}")
    for said in (pretrained.line(model_cfg, data_cfg), pretrained.differing_line(model_cfg, data_cfg),
                 pretrained.assumed_line(model_cfg)):
        if said:   # resolved with the config (tfdp/config/pretrained.py); said here, once
            say(said)
