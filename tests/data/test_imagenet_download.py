"""`--init_from=imagenet` downloads Keras' file into Keras' cache where the network allows (tfdp/models/weights.py).

No test reaches the internet: a loopback HTTP server (python's http.server in a thread, started and stopped by
each test) stands in for keras.applications' bucket, through the mirror variable TFDP_KERAS_WEIGHTS_URL.
"""

import contextlib
import functools
import hashlib
import http.server
import os
import socket
import threading
import time

import h5py
import keras
import numpy as np
import pytest

from conftest import assert_one_line_error, run_tfdp
from tfdp.config import validate
from tfdp.errors import UserError
from tfdp.models import build_model
from tfdp.models import keras_imagenet
from tfdp.models.keras_imagenet import MIRROR_ENV
from tfdp.models.weights import layers_with_weights, load_into, read_source

MOBILENET_V3 = "mobilenet_v3/weights_mobilenet_v3_large_224_1.0_float.h5"
RESNET50 = "resnet/resnet50_weights_tf_dim_ordering_tf_kernels.h5"


@contextlib.contextmanager
def weights_server(root):
    """Serves the folder `root` (keras.applications' bucket layout) on a free loopback port; yields its URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def md5(path) -> str:
    return hashlib.md5(open(path, "rb").read()).hexdigest()


def cfg_for(name, image_size=32):
    return validate({"model": {"name": name, "num_classes": 10, "init_from": "imagenet"},
                     "data": {"image_size": image_size, "hflip": False}})


def test_the_file_is_downloaded_hash_checked_and_used(tmp_path, monkeypatch, capsys):
    from keras.src.applications import mobilenet_v3
    from keras.src.legacy.saving.legacy_h5_format import save_weights_to_hdf5_group
    served = tmp_path / "bucket" / MOBILENET_V3
    os.makedirs(served.parent)
    keras.utils.set_random_seed(4)
    imagenet = keras.applications.MobileNetV3Large(weights=None, input_shape=(224, 224, 3), classes=1000)
    with h5py.File(served, "w") as f:
        save_weights_to_hdf5_group(f, imagenet)
    # keras.applications' hash for the real file, set to this file's for the test
    monkeypatch.setitem(mobilenet_v3.WEIGHTS_HASHES, "large_224_1.0_float", (md5(served), ""))
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    cfg = cfg_for("mobilenet_v3_large")
    with weights_server(tmp_path / "bucket") as url:
        monkeypatch.setenv(MIRROR_ENV, url)
        capsys.readouterr()
        weights = read_source("imagenet", cfg.model, cfg.data)
        cached = tmp_path / "keras" / "models" / os.path.basename(MOBILENET_V3)
        assert capsys.readouterr().out == (f"tfdp: init_from: downloading {cached.name} from {url}{MOBILENET_V3} "
                                           f"into {cached.parent}/ (md5 {md5(served)})\n")
    assert os.listdir(cached.parent) == [cached.name] and md5(cached) == md5(served)  # no scratch left
    model = build_model(cfg.model, cfg.data)
    loaded, new = load_into(model, weights, cfg.model)
    assert new == ["logits (10 classes, the source has 1000)"] and len(loaded) == len(layers_with_weights(model)) - 1
    for name in ("conv", "expanded_conv_project"):
        for ours, theirs in zip(model.layers[-2].get_layer(name).weights, imagenet.get_layer(name).weights):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs))
    # the next run reads the cache: the server is gone
    assert read_source("imagenet", cfg.model, cfg.data).values.keys() == weights.values.keys()


def test_a_file_with_another_hash_is_one_line_and_nothing_is_kept(tmp_path, small_dir):
    """Through the real command line: exit 2, one line, no file left in Keras' cache."""
    served = tmp_path / "bucket" / RESNET50
    os.makedirs(served.parent)
    served.write_bytes(b"not keras.applications' resnet50 file" * 1000)
    home = tmp_path / "keras"
    with weights_server(tmp_path / "bucket") as url:
        result = run_tfdp("train", "--config=configs/digits.yaml", f"--data_dir={small_dir}",
                          "--data_format=image_folder", f"--model_dir={tmp_path / 'run'}", "--model=resnet50",
                          "--set=data.image_size=32", "--epochs=1", "--set=schedule.warmup_epochs=0", "--init_from=imagenet",
                          timeout=300,
                          env_extra={"KERAS_HOME": str(home), MIRROR_ENV: url})
    assert_one_line_error(result, 2, "tfdp: error: model.init_from: resnet50_weights_tf_dim_ordering_tf_kernels.h5 "
                          f"downloaded from {url}{RESNET50} does not have keras.applications' hash (md5 ",
                          f"nothing kept in {home}/models/")
    assert os.listdir(home / "models") == []


def test_an_unreachable_server_is_the_offline_line_within_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    cfg = cfg_for("resnet50")
    for host in (f"127.0.0.1:{closed_port()}", "10.255.255.1"):  # refused; not routed (dropped or unreachable)
        monkeypatch.setenv(MIRROR_ENV, f"http://{host}/")
        start = time.monotonic()
        with pytest.raises(UserError) as error:
            read_source("imagenet", cfg.model, cfg.data)
        assert time.monotonic() - start < keras_imagenet.CONNECT_TIMEOUT + 2, host
        message = str(error.value)
        assert message.startswith(f"model.init_from: imagenet weights for 'resnet50' are not in Keras' cache and "
                                  f"{host} cannot be reached: " if host.startswith("127.") else
                                  # a sandbox may intercept every connection and fail the request itself
                                  "model.init_from: imagenet weights for 'resnet50' are not in Keras' cache and "
                                  ), message
        assert message.endswith(f"put resnet50_weights_tf_dim_ordering_tf_kernels.h5 (from http://{host}/{RESNET50}) "
                                f"into {tmp_path}/models/"), message
        assert "\n" not in message
        assert not os.path.isdir(tmp_path / "models") or os.listdir(tmp_path / "models") == []


def test_a_server_that_stalls_is_one_line_not_a_hang(tmp_path, monkeypatch):
    """Accepts the connection, never answers: the read timeout ends the download."""
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.setattr(keras_imagenet, "READ_TIMEOUT", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setenv(MIRROR_ENV, f"http://127.0.0.1:{silent.getsockname()[1]}/")
        cfg = cfg_for("resnet50")
        start = time.monotonic()
        with pytest.raises(UserError, match=r"^model.init_from: imagenet weights for 'resnet50' are not in Keras' "
                                            r"cache and the download from 127.0.0.1:\d+ failed \(.*timed out.*\), "
                                            r"nothing kept: put resnet50_weights_tf_dim_ordering_tf_kernels.h5"):
            read_source("imagenet", cfg.model, cfg.data)
        assert time.monotonic() - start < 10
    assert os.listdir(tmp_path / "models") == []
    assert socket.getdefaulttimeout() is None and keras.config.is_interactive_logging_enabled()  # restored


def test_the_mirror_must_be_http(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.setenv(MIRROR_ENV, "ftp://mirror/keras")
    cfg = cfg_for("resnet50")
    with pytest.raises(UserError, match=f"^{MIRROR_ENV}=ftp://mirror/keras: a mirror .* must be an http"):
        read_source("imagenet", cfg.model, cfg.data)


def test_the_mirror_holds_both_of_keras_buckets_files_at_their_paths(monkeypatch):
    """keras.applications downloads EfficientNet (V1)'s files from another bucket than the rest, at its top: the
    mirror keeps each file at its path under its bucket."""
    files = keras_imagenet.imagenet_files()
    urls = {name: files[name](224)[1] for name in ("resnet50", "efficientnet_b3", "mobilenet_v3_small")}
    assert urls["efficientnet_b3"] == "https://storage.googleapis.com/keras-applications/efficientnetb3.h5"
    monkeypatch.setenv(MIRROR_ENV, "http://127.0.0.1:8/keras/")
    assert {name: keras_imagenet.weights_url(url) for name, url in urls.items()} == {
        "resnet50": f"http://127.0.0.1:8/keras/{RESNET50}",
        "efficientnet_b3": "http://127.0.0.1:8/keras/efficientnetb3.h5",
        "mobilenet_v3_small": "http://127.0.0.1:8/keras/mobilenet_v3/weights_mobilenet_v3_small_224_1.0_float.h5"}
