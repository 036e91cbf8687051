"""`model.init_from`: start a fresh run from weights trained elsewhere.

A source is read into one common form, `Weights` (layer name → that layer's
values in Keras' variable order), by the reader its kind names in `SOURCES`;
`load_into` then copies it onto the model, layer by layer, by name:

- imagenet: Keras' own ImageNet files for the keras.applications models, read
  from Keras' cache (`$KERAS_HOME/models`, default `~/.keras/models`) under the
  names Keras itself gives them, downloaded there first (keras.utils.get_file,
  keras.applications' hash checked) where the network allows; where it does
  not, one line names the file, its URL and the folder, within seconds.
- a tfdp run directory (its best checkpoint, else its newest), a checkpoint
  folder (`checkpoints/epoch-0003`), a `.weights.h5` file (from `tfdp train`, or
  a legacy Keras `.h5`) or a `.keras` file (from `tfdp export` or `model.save`).
- a `.safetensors` PyTorch state dict (torchvision's or timm's layout) for the
  models in `TORCHVISION` and `TORCH_LAYOUTS`: names mapped, kernels
  transposed, batch-norm running statistics loaded.
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
import shutil
import socket
import tempfile
import threading
import urllib.parse
import urllib.request
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


# ---------------------------------------------------------------- keras.applications ImageNet files


def _imagenet_files() -> dict[str, Callable[[int], tuple[str, str, str]]]:
    """zoo name → (image size → (file name, download URL, md5)), from keras.applications' own constants."""
    from keras.src.applications import efficientnet, efficientnet_v2, inception_v3, mobilenet_v2, mobilenet_v3, resnet

    def resnet_file(name):
        file = f"{name}_weights_tf_dim_ordering_tf_kernels.h5"
        return lambda size: (file, resnet.BASE_WEIGHTS_PATH + file, resnet.WEIGHTS_HASHES[name][0])

    def mobilenet_v2_file(size):
        rows = size if size in (96, 128, 160, 192, 224) else 224  # as MobileNetV2 picks its file
        file = f"mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_{rows}.h5"
        return file, mobilenet_v2.BASE_WEIGHT_PATH + file, ""

    def mobilenet_v3_file(kind):
        file = f"weights_mobilenet_v3_{kind}_224_1.0_float.h5"
        return lambda size: (file, mobilenet_v3.BASE_WEIGHT_PATH + file,
                             mobilenet_v3.WEIGHTS_HASHES[f"{kind}_224_1.0_float"][0])

    def efficientnet_file(variant):
        file = f"efficientnetv2-{variant.lstrip('-')}.h5"
        return lambda size: (file, efficientnet_v2.BASE_WEIGHTS_PATH + file, efficientnet_v2.WEIGHTS_HASHES[variant][0])

    def efficientnet_v1_file(variant):
        file = f"efficientnet{variant}.h5"
        return lambda size: (file, efficientnet.BASE_WEIGHTS_PATH + file, efficientnet.WEIGHTS_HASHES[variant][0])

    files = {name: resnet_file(name) for name in ("resnet50", "resnet101", "resnet152")}
    files["inception_v3"] = lambda size: ("inception_v3_weights_tf_dim_ordering_tf_kernels.h5",
                                          inception_v3.WEIGHTS_PATH, "9a0d58056eeedaa3f26cb7ebd46da564")
    files["mobilenet_v2"] = mobilenet_v2_file
    for kind in ("large", "small"):
        files[f"mobilenet_v3_{kind}"] = mobilenet_v3_file(kind)
    for variant in ("b0", "b1", "b2", "b3", "-s", "-m", "-l"):
        files[f"efficientnetv2_{variant.lstrip('-')}"] = efficientnet_file(variant)
    for variant in ("b0", "b1", "b2", "b3", "b4", "b5", "b6", "b7"):
        files[f"efficientnet_{variant}"] = efficientnet_v1_file(variant)
    return files


def keras_cache_dir() -> str:
    """Where keras.utils.get_file keeps application weights: $KERAS_HOME/models, default ~/.keras/models."""
    return os.path.join(os.path.expanduser(os.environ.get("KERAS_HOME") or os.path.join("~", ".keras")), "models")


# Where keras.applications downloads every zoo model's file from (EfficientNet V1's from the second);
# TFDP_KERAS_WEIGHTS_URL replaces both with a mirror of the same layout (an internal server; the tests' loopback
# one): MIRROR_ENV/resnet/<file>, ..., MIRROR_ENV/efficientnetb0.h5
KERAS_WEIGHTS_BASES = ("https://storage.googleapis.com/tensorflow/keras-applications/",
                       "https://storage.googleapis.com/keras-applications/")
MIRROR_ENV = "TFDP_KERAS_WEIGHTS_URL"
# Seconds to reach the server (or proxy) before the run stops with the offline line: a machine without network
# must not wait for TCP's own minutes-long timeout.
CONNECT_TIMEOUT = 3.0
# Seconds any one read of the download may stall (urllib's urlretrieve, which get_file uses, has no timeout of
# its own; the default socket timeout bounds it).
READ_TIMEOUT = 30.0


def weights_url(url: str) -> str:
    """keras.applications' URL, or the same file on the mirror TFDP_KERAS_WEIGHTS_URL names."""
    mirror = os.environ.get(MIRROR_ENV, "")
    if not mirror:
        return url
    if urllib.parse.urlsplit(mirror).scheme not in ("http", "https"):
        raise UserError(f"{MIRROR_ENV}={mirror}: a mirror of keras.applications' weights must be an http(s) URL")
    base = next(b for b in KERAS_WEIGHTS_BASES if url.startswith(b))
    return mirror.rstrip("/") + "/" + url.removeprefix(base)


def reachable(url: str, timeout: float) -> bool:
    """Whether a TCP connection to `url`'s host (or the proxy urllib would use for it) opens within `timeout`
    seconds, name lookup included (in a thread, since getaddrinfo takes no timeout)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port or {"http": 80, "https": 443}.get(parts.scheme, 443)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host or ""):
        via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = via.hostname, via.port or 80
    opened = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            opened.append(True)
        except (OSError, UnicodeError):
            pass
    thread = threading.Thread(target=probe, name="tfdp-reachable", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(opened)


@contextlib.contextmanager
def _download_settings():
    """Keras' download messages off (tfdp prints its own line) and every socket read bounded, restored after."""
    timeout, interactive = socket.getdefaulttimeout(), keras.config.is_interactive_logging_enabled()
    socket.setdefaulttimeout(READ_TIMEOUT)
    keras.config.disable_interactive_logging()
    try:
        yield
    finally:
        socket.setdefaulttimeout(timeout)
        if interactive:
            keras.config.enable_interactive_logging()


def download(model: str, file: str, url: str, file_hash: str, where: str) -> str:
    """keras.utils.get_file into a private folder beside the cache, then renamed in: another process (a local
    worker of the same run) never reads a partial file, and a failed or mismatching download leaves nothing."""
    host = urllib.parse.urlsplit(url).netloc
    missing = f"model.init_from: imagenet weights for '{model}' are not in Keras' cache and"
    put = f"put {file} (from {url}) into {where}/"
    if not reachable(url, CONNECT_TIMEOUT):
        raise UserError(f"{missing} {host} cannot be reached: {put}")
    try:
        os.makedirs(where, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=f".{file}.", dir=where)
    except OSError as e:
        raise UserError(f"model.init_from: cannot write Keras' cache {where}/ ({e.strerror}): put {file} "
                        f"(from {url}) into a KERAS_HOME/models/ that can be written") from None
    checked = f"{'sha256' if len(file_hash) == 64 else 'md5'} {file_hash}" if file_hash else "no hash: Keras lists none"
    say(f"tfdp: init_from: downloading {file} from {url} into {where}/ ({checked})")
    try:
        with _download_settings():
            fetched = keras.utils.get_file(file, url, file_hash=file_hash or None, cache_subdir=scratch)
        path = os.path.join(where, file)
        os.replace(fetched, path)
        return path
    except ValueError as e:
        if "hash" not in str(e):
            raise
        raise UserError(f"model.init_from: {file} downloaded from {url} does not have keras.applications' hash "
                        f"({checked}); nothing kept in {where}/") from None
    except Exception as e:  # get_file's "URL fetch failure on ...", a stalled read, a full disk
        reason = first_line(e).replace(f"URL fetch failure on {url}: ", "")
        raise UserError(f"{missing} the download from {host} failed ({reason}), nothing kept: {put}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def read_imagenet(model_cfg: ModelConfig, data_cfg: DataConfig) -> Weights:
    """Keras' file from its cache (as it is: a file put there by hand is not hash-checked), else downloaded."""
    files = _imagenet_files()
    if model_cfg.name not in files:
        raise UserError(f"model.init_from: imagenet weights come with the keras.applications models only "
                        f"({', '.join(sorted(files))}), not '{model_cfg.name}'; for a torchvision-layout model "
                        f"use a .safetensors state dict")
    file, url, file_hash = files[model_cfg.name](data_cfg.image_size)
    where = keras_cache_dir()
    candidates = [os.path.join(where, file), os.path.join("/tmp", ".keras", "models", file)]  # Keras' fallback
    path = next((p for p in candidates if os.path.exists(p)), None)
    if path is None:
        path = download(model_cfg.name, file, weights_url(url), file_hash, where)
    # The preprocessing layers keras.applications builds when include_preprocessing is on; tfdp normalises itself.
    return dataclasses.replace(read_weights_file(path, f"imagenet weights {path}"),
                               optional=frozenset({"normalization*", "rescaling*"}))


# ---------------------------------------------------------------- PyTorch state dicts (torchvision / timm layout)


def _resnet_name(key: str) -> str | None:
    """torchvision's ResNet module names → tfdp's layers (resnet.py)."""
    fixed = {"conv1": "stem_conv", "bn1": "stem_bn", "fc": "logits"}
    if key in fixed:
        return fixed[key]
    m = re.fullmatch(r"layer(\d)\.(\d+)\.(conv|bn)(\d)", key)
    if m:
        return f"stage{m[1]}_block{int(m[2]) + 1}_{'abc'[int(m[4]) - 1]}_{m[3]}"
    m = re.fullmatch(r"layer(\d)\.(\d+)\.downsample\.([01])", key)
    if m:
        return f"stage{m[1]}_block{int(m[2]) + 1}_down_{('conv', 'bn')[int(m[3])]}"
    return None


def resnet_d_layer(key: str) -> str | None:
    """timm's ResNet-D module names → tfdp's layers (resnet.py): the deep stem `conv1.0`/`.1`, `.3`/`.4`, `.6` and
    `bn1`, the average-pool shortcut's `downsample.1` (convolution) and `.2` (batch norm); the rest as torchvision's.
    resnet.py registers it for its ResNet-Ds (`register_torch_layout`)."""
    fixed = {"conv1.0": "stem_a_conv", "conv1.1": "stem_a_bn", "conv1.3": "stem_b_conv", "conv1.4": "stem_b_bn",
             "conv1.6": "stem_conv"}
    if key in fixed:
        return fixed[key]
    m = re.fullmatch(r"layer(\d)\.(\d+)\.downsample\.([12])", key)
    if m:
        return f"stage{m[1]}_block{int(m[2]) + 1}_down_{('conv', 'bn')[int(m[3]) - 1]}"
    return None if key == "conv1" or re.fullmatch(r"layer\d\.\d+\.downsample\.0", key) else _resnet_name(key)


def _squeezenet_name(key: str) -> str | None:
    """torchvision's SqueezeNet 1.1 `features.N` / `classifier.1` → tfdp's layers (squeezenet.py)."""
    fires = {3: 2, 4: 3, 6: 4, 7: 5, 9: 6, 10: 7, 11: 8, 12: 9}  # features index → fire module number
    if key == "features.0":
        return "conv1"
    if key == "classifier.1":
        return "classifier"
    m = re.fullmatch(r"features\.(\d+)\.(squeeze|expand1x1|expand3x3)", key)
    if m and int(m[1]) in fires:
        return f"fire{fires[int(m[1])]}_{m[2]}"
    return None


def _vgg_name(plan, batch_norm: bool) -> Callable[[str], str | None]:
    """torchvision's VGG `features.N` (conv, [bn], relu, ..., maxpool) and `classifier.{0,3,6}` → vgg.py's layers."""
    names, index = {}, 0
    for i, item in enumerate(plan):
        if item == "M":
            index += 1
            continue
        names[f"features.{index}"] = f"conv{i}"
        if batch_norm:
            names[f"features.{index + 1}"] = f"bn{i}"
        index += 3 if batch_norm else 2
    names.update({"classifier.0": "fc1", "classifier.3": "fc2", "classifier.6": "logits"})
    return names.get


def _torchvision_names() -> dict[str, Callable[[str], str | None]]:
    from tfdp.models.vgg import PLANS
    names = {name: _resnet_name for name in ("resnet18", "resnet34", "resnet50_v1_5", "resnext50_32x4d")}
    names["squeezenet1_1"] = _squeezenet_name
    for name, plan in PLANS.items():
        names[name] = _vgg_name(plan, False)
        names[f"{name}_bn"] = _vgg_name(plan, True)
    return names


# zoo name → torch module name → tfdp layer name (None: no such layer)
TORCHVISION = _torchvision_names()
# zoo name → a reader of its PyTorch state dicts (tensors, model config, what) → Weights, for the families whose
# mapping is more than renaming modules (fused attention, layer scale, position embeddings). Each family registers
# its readers in its own file, beside its architecture (`register_torch_layout`).
TORCH_LAYOUTS: dict[str, Callable[[dict[str, np.ndarray], ModelConfig, str], Weights]] = {}


def register_torch_layout(*names: str):
    """Registers a state-dict reader for the zoo models `names` (see `TORCH_LAYOUTS`)."""
    def add(fn):
        for name in names:
            TORCH_LAYOUTS[name] = fn
        return fn
    return add
# layer → the (channels, height, width) its flattened input has in PyTorch (NCHW), reordered to Keras' (H, W, C)
_FLATTENED_INPUT = {"fc1": (512, 7, 7)}


def torch_module_values(params: dict[str, np.ndarray], layer: str) -> tuple[list[np.ndarray], list[str]]:
    """One torch module's tensors in Keras' variable order, in Keras' layouts."""
    if "running_mean" in params:  # batch norm: gamma, beta, moving mean, moving variance
        order = ["weight", "bias", "running_mean", "running_var"]
        return [params[k] for k in order], order
    weight = params["weight"]
    if weight.ndim == 4:  # convolution (grouped too): OIHW → HWIO
        kernel = weight.transpose(2, 3, 1, 0)
    elif weight.ndim == 2 and layer in _FLATTENED_INPUT:
        c, h, w = _FLATTENED_INPUT[layer]
        kernel = weight.reshape(-1, c, h, w).transpose(2, 3, 1, 0).reshape(h * w * c, -1) \
            if weight.shape[1] == c * h * w else weight.T
    elif weight.ndim == 2:  # linear: (out, in) → (in, out)
        kernel = weight.T
    else:
        return [weight], ["weight"]
    order = ["weight"] + (["bias"] if "bias" in params else [])
    return [kernel] + ([params["bias"]] if "bias" in params else []), order


def read_safetensors(path: str, model_cfg: ModelConfig) -> Weights:
    if model_cfg.name not in TORCHVISION and model_cfg.name not in TORCH_LAYOUTS:
        raise UserError(f"model.init_from: {path} is a PyTorch state dict, but model '{model_cfg.name}' has no "
                        f"torchvision or timm layout to map it onto (models that have one: "
                        f"{', '.join(sorted({*TORCHVISION, *TORCH_LAYOUTS}))})")
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise UserError(f"model.init_from: cannot read {path} as safetensors ({str(e).splitlines()[0][:120]})"
                        ) from None
    return torch_weights(tensors, model_cfg, path)


def torch_weights(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> Weights:
    """A torchvision/timm state dict as `Weights` for the zoo model `model_cfg.name`."""
    if model_cfg.name in TORCH_LAYOUTS:
        return TORCH_LAYOUTS[model_cfg.name](tensors, model_cfg, what)
    return renamed_modules(torch_modules(tensors), TORCHVISION[model_cfg.name], model_cfg, what)


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


def register_keras_hub_layout(*class_names: str):
    """Registers a keras-hub preset reader for the backbone classes `class_names` (see `KERAS_HUB_LAYOUTS`)."""
    def add(fn):
        for name in class_names:
            KERAS_HUB_LAYOUTS[name] = fn
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


# kind → source; the first that matches an `init_from` value reads it
SOURCES: dict[str, Source] = {
    "imagenet": Source("imagenet", lambda spec: spec == "imagenet",
                       lambda spec, model_cfg, data_cfg: read_imagenet(model_cfg, data_cfg)),
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
