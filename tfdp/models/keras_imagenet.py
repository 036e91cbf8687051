"""`model.init_from: imagenet`: keras.applications' own ImageNet files, for the keras.applications models of the zoo.

Read from Keras' cache (`$KERAS_HOME/models`, default `~/.keras/models`) under the names Keras itself gives
them, downloaded there first (keras.utils.get_file, keras.applications' hash checked) where the network allows;
where it does not, one line names the file, its URL and the folder, within seconds. The file is a Keras weights
file, read by `tfdp.models.weights`; this module registers the `imagenet` kind of source there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import tempfile
import threading
import urllib.parse
import urllib.request
from typing import Callable

import keras

from tfdp.config import DataConfig, ModelConfig
from tfdp.errors import UserError, first_line
from tfdp.models.weights import Source, Weights, read_weights_file, register_source
from tfdp.startup.console import say


def imagenet_files() -> dict[str, Callable[[int], tuple[str, str, str]]]:
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
    files = imagenet_files()
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


register_source("imagenet", Source("imagenet", lambda spec: spec == "imagenet",
                                   lambda spec, model_cfg, data_cfg: read_imagenet(model_cfg, data_cfg)))
