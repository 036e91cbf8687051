"""`model.init_from`: torchvision weights and keras-hub presets give torchvision's logits; every kind of source loads;
bad input is one line.

The torchvision fixture (tests/fixtures, made by make_torchvision_fixture.py with real torch and torchvision) holds
seeded SqueezeNet 1.1 and ResNet-18 state dicts and the logits torchvision computed for 4 real photos; the keras-hub
fixture (make_kerashub_resnet_fixture.py, real keras-hub) that ResNet-18 converted by keras-hub's own timm loader
and written by its `save_to_preset`.
"""

import json
import lzma
import os
import shutil
import zipfile

import h5py
import keras
import numpy as np
import pytest
import yaml

from conftest import CPU_DEVICES, REPO, assert_one_line_error, run_tfdp
from support.inprocess import export_in_process, train_in_process
from support.shapes import shapes_only
from tfdp.config import IMAGENET_MEAN, IMAGENET_STD, validate
from tfdp.errors import UserError
from tfdp.models import MODELS, build_model
from tfdp.models.resnet import check_keras_hub_resnet, keras_hub_resnet_layer
from tfdp.models.keras_imagenet import MIRROR_ENV, keras_cache_dir
from tfdp.models.weights import SOURCES, init_from, layers_with_weights, load_into, read_source
from tfdp.distribute.strategy import make_runtime
from tfdp.train.task import model_in_precision

FIXTURES = os.path.join(REPO, "tests", "fixtures")
SQUEEZENET = os.path.join(FIXTURES, "squeezenet1_1.safetensors")
# float32 logits against torchvision's (the differences measured are in docs/pretrained-weights.md)
LOGITS_ATOL = 1e-5
# keras.applications' weights from a loopback port nothing listens on: tests never download
OFFLINE_MIRROR = "http://127.0.0.1:9/"


@pytest.fixture(scope="module")
def resnet18_file(tmp_path_factory) -> str:
    """The committed ResNet-18 state dict is xz-compressed (its weights sit on 5 levels and compress 3x)."""
    path = str(tmp_path_factory.mktemp("torch") / "resnet18.safetensors")
    with lzma.open(os.path.join(FIXTURES, "resnet18.safetensors.xz")) as f, open(path, "wb") as out:
        shutil.copyfileobj(f, out)
    return path


def torch_cfg(name, init_from, num_classes=1000, image_size=224, **extra):
    model = {"name": name, "num_classes": num_classes, "init_from": init_from, **extra.pop("model", {})}
    return validate({"model": model, "data": {"image_size": image_size, "hflip": False}, **extra})


@pytest.mark.parametrize("name", ["squeezenet1_1", "resnet18"])
def test_torchvision_weights_give_torchvisions_logits(name, resnet18_file):
    path = SQUEEZENET if name == "squeezenet1_1" else resnet18_file
    cfg = torch_cfg(name, path)
    model = build_model(cfg.model, cfg.data)
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    photos = np.load(os.path.join(FIXTURES, "photos.npy"))  # uint8; data.mean/std are torchvision's, times 255
    expected = np.load(os.path.join(FIXTURES, "torchvision_logits.npz"))[name]
    logits = model.predict(photos, verbose=0)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGITS_ATOL)
    assert list(logits.argmax(1)) == list(expected.argmax(1))


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_other_class_count_reinitialises_the_classifier_on_every_replica(precision, capsys):
    """SqueezeNet's 1,000-class file into a 10-class model, built in a 2-replica MirroredStrategy's scope."""
    cfg = torch_cfg("squeezenet1_1", SQUEEZENET, num_classes=10, image_size=64, train={"precision": precision})
    strategy = make_runtime(validate({"distribute": {"strategy": "mirrored", "cpu_replicas": 2}}).distribute).strategy
    assert strategy.num_replicas_in_sync == 2 == len(CPU_DEVICES)
    with strategy.scope():
        model = model_in_precision(cfg)
    head = model.get_layer("squeezenet1_1_backbone").get_layer("classifier")
    head_before = keras.ops.convert_to_numpy(head.kernel)
    capsys.readouterr()
    init_from(model, cfg.model, cfg.data, resumed=False)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == (f"tfdp: init_from: loaded 25 of 26 layers from {SQUEEZENET}; "
                        f"new: classifier (10 classes, the source has 1000)")
    # then what the file's preprocessing is taken to be, and that it was assumed (the file carries no cfg)
    assert len(lines) == 3
    assert lines[1].startswith("tfdp: preprocessing from squeezenet1_1.safetensors (torchvision's ImageNet")
    assert lines[2].startswith("tfdp: assumed: squeezenet1_1.safetensors carries no pretrained cfg")
    from safetensors.numpy import load_file
    torch_conv1 = load_file(SQUEEZENET)["features.0.weight"].transpose(2, 3, 1, 0)
    conv1 = model.get_layer("squeezenet1_1_backbone").get_layer("conv1").kernel
    replicas = strategy.experimental_local_results(conv1.value)
    assert len(replicas) == 2
    for value in replicas:
        np.testing.assert_array_equal(value.numpy(), torch_conv1)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(head.kernel), head_before)


def test_init_exclude_leaves_matching_layers_and_variables_as_initialised():
    cfg = torch_cfg("squeezenet1_1", SQUEEZENET, image_size=64, model={"init_exclude": ["fire9_*", "conv1/bias"]})
    model = build_model(cfg.model, cfg.data)
    backbone = model.get_layer("squeezenet1_1_backbone")
    before = {name: keras.ops.convert_to_numpy(backbone.get_layer(name).weights[i])
              for name, i in (("fire9_squeeze", 0), ("conv1", 1))}
    loaded, new = load_into(model, read_source(SQUEEZENET, cfg.model, cfg.data), cfg.model)
    assert sorted(new) == ["conv1 (partly, init_exclude)", "fire9_expand1x1 (init_exclude)",
                           "fire9_expand3x3 (init_exclude)", "fire9_squeeze (init_exclude)"]
    assert len(loaded) == 22
    for name, i in (("fire9_squeeze", 0), ("conv1", 1)):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(backbone.get_layer(name).weights[i]), before[name])
    from safetensors.numpy import load_file
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(backbone.get_layer("conv1").kernel),
                                  load_file(SQUEEZENET)["features.0.weight"].transpose(2, 3, 1, 0))


def test_an_init_exclude_pattern_that_matches_nothing_is_one_line():
    """A mistyped pattern would load the layers it meant to leave out; one that matches only the source's layers
    (what the model has no place for) is taken, as the docs say."""
    cfg = torch_cfg("squeezenet1_1", SQUEEZENET, image_size=64, model={"init_exclude": ["fire9_*", "fier8_*"]})
    model = build_model(cfg.model, cfg.data)
    with pytest.raises(UserError) as raised:
        load_into(model, read_source(SQUEEZENET, cfg.model, cfg.data), cfg.model)
    assert str(raised.value) == (f"model.init_exclude: 'fier8_*' matches no layer (or layer/variable) of model "
                                 f"'squeezenet1_1' nor of {SQUEEZENET} (the model's layers start conv1, fire2, fire3, "
                                 f"fire4, fire5, fire6, fire7, fire8, fire9, classifier, ...)")
    weights = read_source(SQUEEZENET, cfg.model, cfg.data)
    weights.values["extra_head"] = weights.values["classifier"]   # a source layer the model has no place for
    weights.names["extra_head"] = ["extra_head.weight", "extra_head.bias"]
    cfg = torch_cfg("squeezenet1_1", SQUEEZENET, image_size=64, model={"init_exclude": ["extra_*"]})
    loaded, new = load_into(model, weights, cfg.model)
    assert new == [] and len(loaded) == 26


def test_imagenet_reads_keras_own_file_from_keras_home(tmp_path, monkeypatch):
    """A file in Keras' legacy h5 format under the name keras.applications gives it, in a temporary KERAS_HOME."""
    from keras.src.legacy.saving.legacy_h5_format import save_weights_to_hdf5_group
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.setenv(MIRROR_ENV, OFFLINE_MIRROR)  # a server that is not there (downloads: test_imagenet_download.py)
    cfg = validate({"model": {"name": "mobilenet_v2", "num_classes": 10, "init_from": "imagenet"},
                    "data": {"image_size": 32}})
    with pytest.raises(UserError, match=r"cannot be reached: put mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_"
                                        r"224.h5 \(from " + OFFLINE_MIRROR + r"mobilenet_v2/.*\) into " + str(tmp_path)
                                        + "/models/"):
        read_source("imagenet", cfg.model, cfg.data)
    keras.utils.set_random_seed(3)
    imagenet = keras.applications.MobileNetV2(weights=None, input_shape=(224, 224, 3), classes=1000)
    assert keras_cache_dir() == str(tmp_path / "models")
    os.makedirs(keras_cache_dir())
    with h5py.File(os.path.join(keras_cache_dir(), "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_224.h5"),
                   "w") as f:
        save_weights_to_hdf5_group(f, imagenet)
    model = build_model(cfg.model, cfg.data)
    loaded, new = load_into(model, read_source("imagenet", cfg.model, cfg.data), cfg.model)
    assert new == ["predictions (10 classes, the source has 1000)"]
    assert len(loaded) == len(layers_with_weights(model)) - 1
    for name in ("Conv1", "bn_Conv1", "block_16_project"):
        for ours, theirs in zip(model.layers[-2].get_layer(name).weights, imagenet.get_layer(name).weights):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs))


# ---------------------------------------------------------------- sources from a real `tfdp train` and `tfdp export`


def train_args(data_dir, model_dir, *extra):
    return ("train", "--config=configs/digits.yaml", f"--data_dir={data_dir}", "--data_format=image_folder",
            f"--model_dir={model_dir}", "--model=simple_cnn", "--set=data.image_size=16", "--epochs=1",
            "--set=schedule.warmup_epochs=0", *extra)


@pytest.fixture(scope="module")
def trained_run(small_dir, tmp_path_factory):
    """A real one-epoch run of simple_cnn on digits, and its export (`tfdp train` and `tfdp export` from these
    flags, run in this process: inprocess)."""
    run = str(tmp_path_factory.mktemp("pre") / "run")
    train_in_process(*train_args(small_dir, run)[1:])
    export_in_process(*train_args(small_dir, run)[1:])
    return run


def test_every_keras_source_loads_the_same_weights(trained_run):
    cfg = validate({"model": {"name": "simple_cnn", "num_classes": 10}, "data": {"image_size": 16, "hflip": False}})
    reference = build_model(cfg.model, cfg.data)
    reference.load_weights(os.path.join(trained_run, "checkpoints", "best.weights.h5"))
    sources = {"run_dir": trained_run, "checkpoint": os.path.join(trained_run, "checkpoints", "epoch-0001"),
               "keras_weights": os.path.join(trained_run, "checkpoints", "best.weights.h5"),
               "keras": os.path.join(trained_run, "export", "model.keras")}
    for kind, path in sources.items():
        assert SOURCES[kind].matches(path) and [k for k, s in SOURCES.items() if s.matches(path)][0] == kind
        model = build_model(cfg.model, cfg.data)
        loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
        assert (len(loaded), new) == (4, []), kind
        for ours, theirs in zip(model.weights, reference.weights):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs),
                                          err_msg=f"{kind}: {ours.path}")


def test_a_resumed_run_continues_from_its_own_checkpoint(trained_run, small_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    _, stdout = train_in_process(*train_args(small_dir, run, "--epochs=2", f"--init_from={SQUEEZENET}")[1:])
    lines = [line for line in stdout.splitlines() if line.startswith("tfdp: init_from")]
    assert lines == [f"tfdp: init_from: resumed run, continuing from its own checkpoint; model.init_from "
                     f"({SQUEEZENET}) applies to a fresh run only"], stdout[-2000:]
    assert "tfdp: resuming at epoch 2 of 2" in stdout


def test_a_fresh_run_starts_from_a_run_directory(trained_run, small_dir, tmp_path):
    _, stdout = train_in_process(*train_args(small_dir, tmp_path / "run", f"--init_from={trained_run}")[1:])
    assert (f"tfdp: init_from: loaded 4 of 4 layers from the best checkpoint of run {trained_run}; new: none"
            in stdout), stdout[-2000:]


def standardize_config(keras_file) -> dict:
    """The Standardize layer's config inside a .keras file (its mean, std and channel order)."""
    import zipfile
    with zipfile.ZipFile(keras_file) as archive:
        text = archive.read("config.json").decode()
    found = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("class_name") == "Standardize":
                found.append(node["config"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(json.loads(text))
    assert len(found) == 1, found
    return found[0]


def test_the_weights_preprocessing_reaches_config_yaml_and_the_export(trained_run, small_dir, tmp_path):
    """A run whose config.yaml says BGR and its own mean/std (as a Keras ResNet's would): a fresh run from it
    takes them, says so in one line, records them in its config.yaml, and its export (no --init_from) builds them."""
    source = tmp_path / "source"
    shutil.copytree(trained_run, source)
    saved = yaml.safe_load((source / "config.yaml").read_text())
    saved["data"].update(mean=[120.0, 110.0, 100.0], std=[60.0, 50.0, 40.0], channel_order="bgr")
    (source / "config.yaml").write_text(yaml.safe_dump(saved))
    run = tmp_path / "run"
    _, stdout = train_in_process(*train_args(small_dir, run, f"--init_from={source}")[1:])
    assert (f"tfdp: preprocessing from the weights of run {source}: BGR, mean 120,110,100, std 60,50,40 (R,G,B), "
            f"eval crop 1, fast resize; set data.mean/std/channel_order/eval_crop_fraction/eval_interpolation to "
            f"override") in stdout
    data = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert (data["mean"], data["std"], data["channel_order"]) == ([120.0, 110.0, 100.0], [60.0, 50.0, 40.0], "bgr")
    export_in_process(*train_args(small_dir, run)[1:], formats=("keras",), verify_images=None)  # --verify=false
    layer = standardize_config(run / "export" / "model.keras")
    assert (layer["mean"], layer["std"], layer["channel_order"]) == ([120.0, 110.0, 100.0], [60.0, 50.0, 40.0], "bgr")


# ---------------------------------------------------------------- bad input: one line, exit 2


def bad_input_cases(trained_run, tmp_path):
    pth = tmp_path / "resnet18.pth"
    pth.write_bytes(b"PK\x03\x04 not really a zip")
    cut_keras = tmp_path / "cut.keras"   # the run's exported .keras with the weights inside cut to a third
    with zipfile.ZipFile(os.path.join(trained_run, "export", "model.keras")) as whole, \
            zipfile.ZipFile(cut_keras, "w") as cut:
        for item in whole.infolist():
            data = whole.read(item)
            cut.writestr(item, data[: len(data) // 3] if item.filename == "model.weights.h5" else data)
    return {
        "another architecture (shapes)": (["--set=data.image_size=24", f"--init_from={trained_run}"],
                                          ["does not fit model 'simple_cnn'", "fc/kernel is (1024, 128) there",
                                           "the model's is (2304, 128)"]),
        "another architecture (layers)": (["--model=resnet18_small", f"--init_from={trained_run}"],
                                          ["does not fit model 'resnet18_small'", "nothing for stem_conv/kernel"]),
        "torch file of another architecture": (["--model=resnet18", "--set=data.image_size=32",
                                                f"--init_from={SQUEEZENET}"],
                                               ["does not fit model 'resnet18'", "has no place in it"]),
        "missing file": (["--init_from=/no/such/dir/w.weights.h5"],
                         ["no such file or directory: /no/such/dir/w.weights.h5"]),
        "offline imagenet": (["--model=mobilenet_v2", "--set=data.image_size=32", "--init_from=imagenet"],
                             ["imagenet weights for 'mobilenet_v2' are not in Keras' cache and 127.0.0.1:9 cannot "
                              "be reached", "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_224.h5",
                              f"{tmp_path}/keras/models/"]),
        "unknown kind": (["--init_from=imagenet21k"], ["unknown kind of weights 'imagenet21k'"]),
        "no torchvision layout": (["--model=resnet18_small", f"--init_from={SQUEEZENET}"],
                                  ["model 'resnet18_small' has no torchvision or timm layout"]),
        "pickled torch file": ([f"--init_from={pth}"], ["is a pickled PyTorch file", ".safetensors"]),
        "a .keras whose weights were cut short": ([f"--init_from={cut_keras}"],
                                                  [f"cannot read the weights inside {cut_keras}", "truncated file"]),
        "a bucket, to the reader": (["--init_from=gs://bucket/run"],   # `tfdp train` copies it first
                                    ["gs://bucket/run: the weights' readers take a local path"]),
        "exclude without init_from": (["--set=model.init_exclude=[logits]"], ["model.init_exclude needs"]),
    }


def test_bad_weights_are_one_line_each(trained_run, small_dir, tmp_path, monkeypatch):
    """Each case stops `tfdp train` with a one-line UserError naming the problem: every case in this process (the
    trainer from the same flags: inprocess), which is where the error is made and worded; and one case through the
    real command line, which turns any UserError into that line on stderr and exit status 2 (`tfdp.cli.main`)."""
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    monkeypatch.setenv(MIRROR_ENV, OFFLINE_MIRROR)
    cases = bad_input_cases(trained_run, tmp_path)
    for case, (args, fragments) in cases.items():
        with pytest.raises(UserError) as raised:
            train_in_process(*train_args(small_dir, tmp_path / case.replace(" ", "_"), *args)[1:])
        message = str(raised.value)
        assert raised.value.exit_code == 2 and "\n" not in message, (case, message)
        for fragment in fragments:
            assert fragment in message, (case, message)
    args, fragments = cases["another architecture (shapes)"]
    result = run_tfdp(*train_args(small_dir, tmp_path / "command_line", *args), timeout=300,
                      env_extra={"KERAS_HOME": str(tmp_path / "keras"), MIRROR_ENV: OFFLINE_MIRROR})
    assert_one_line_error(result, 2, "tfdp: error: ", *fragments)


@pytest.mark.parametrize("torch_name,name", [("resnet34", "resnet34"), ("resnet50", "resnet50_v1_5"),
                                             ("resnext50_32x4d", "resnext50_32x4d"), ("vgg11_bn", "vgg11_bn")])
def test_every_torchvision_state_dict_maps_onto_its_model(torch_name, name):
    """Real torchvision state dicts' keys and shapes (torchvision_state_dicts.json), zeros for values: every
    tensor finds its layer with the shape it needs, and every layer its tensors."""
    from tfdp.models.weights import torch_weights
    with open(os.path.join(FIXTURES, "torchvision_state_dicts.json"), encoding="utf-8") as f:
        shapes = json.load(f)[torch_name]
    cfg = torch_cfg(name, "x.safetensors", num_classes=1000, image_size=32)
    model = build_model(cfg.model, cfg.data)
    tensors = {k: np.zeros(shape, np.float16) for k, shape in shapes.items()}
    loaded, new = load_into(model, torch_weights(tensors, cfg.model, torch_name), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    assert not np.any(keras.ops.convert_to_numpy(model.weights[0]))


@pytest.fixture(scope="module")
def kerashub_resnet18(tmp_path_factory) -> str:
    """The committed keras-hub preset, its two weights files xz-compressed (their weights sit on 5 levels)."""
    preset = str(tmp_path_factory.mktemp("kerashub") / "resnet18_kerashub")
    shutil.copytree(os.path.join(FIXTURES, "resnet18_kerashub"), preset)
    for name in ("model.weights.h5", "task.weights.h5"):
        with lzma.open(os.path.join(preset, name + ".xz")) as f, open(os.path.join(preset, name), "wb") as out:
            shutil.copyfileobj(f, out)
        os.remove(os.path.join(preset, name + ".xz"))
    return preset


def test_a_keras_hub_resnet_preset_gives_torchvisions_logits(kerashub_resnet18):
    """Through the config as a run builds it: the preset's image converter read as ImageNet's mean and std at
    224 px, the backbone and the `predictions` head loaded. keras-hub's own logits for the preset matched
    torchvision's to 1e-6 when it was made (kerashub_resnet_fixture.json)."""
    cfg = validate({"model": {"name": "resnet18", "num_classes": 1000, "init_from": kerashub_resnet18},
                    "data": {"hflip": False}})
    assert cfg.data.image_size == 224 and cfg.data.eval_crop_fraction == 1.0
    np.testing.assert_allclose(cfg.data.mean, IMAGENET_MEAN, rtol=1e-6)
    np.testing.assert_allclose(cfg.data.std, IMAGENET_STD, rtol=1e-6)
    model = build_model(cfg.model, cfg.data)
    loaded, new = load_into(model, read_source(kerashub_resnet18, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    photos = np.load(os.path.join(FIXTURES, "photos.npy"))
    expected = np.load(os.path.join(FIXTURES, "torchvision_logits.npz"))["resnet18"]
    logits = model.predict(photos, verbose=0)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGITS_ATOL)
    assert list(logits.argmax(1)) == list(expected.argmax(1))


@pytest.mark.parametrize("architecture,name", [("resnet34", "resnet34"), ("resnet50", "resnet50_v1_5")])
def test_keras_hub_resnet_backbones_map_onto_their_models(architecture, name):
    """The backbones keras-hub builds for timm's ResNet-34 and ResNet-50 (their config, layer names and shapes in
    kerashub_resnet_fixture.json; no weights): the config fits the model, every layer finds tfdp's with the
    same shapes, and every tfdp layer but the classifier is found."""
    with open(os.path.join(FIXTURES, "kerashub_resnet_fixture.json"), encoding="utf-8") as f:
        backbone = json.load(f)["backbones"][architecture]
    check_keras_hub_resnet(backbone["config"], validate({"model": {"name": name}}).model, architecture)
    with shapes_only():
        model = MODELS[name]((224, 224, 3), 1000)
    ours = {layer.name: [list(w.shape) for w in layer.weights] for layer in layers_with_weights(model)}
    theirs = {keras_hub_resnet_layer(layer): shapes for layer, shapes in backbone["layers"].items()}
    assert theirs == {layer: shapes for layer, shapes in ours.items() if layer != "logits"}
    keras.backend.clear_session()


@pytest.mark.parametrize("name,change,fragments", [
    ("resnet50_v1_5", {}, ["does not fit model 'resnet50_v1_5': its ResNetBackbone has block_type=basic_block, "
                           "tfdp's resnet50_v1_5 bottleneck_block (set model.name: resnet18)"]),
    ("resnet18", {"block_type": "bottleneck_block_vd", "input_conv_filters": [32, 32, 64],
                  "input_conv_kernel_sizes": [3, 3, 3]},      # keras-hub's resnet_vd_* presets
     ["does not fit model 'resnet18': its ResNetBackbone has input_conv_filters=[32, 32, 64], tfdp's resnet18 [64]"]),
    ("resnet18", {"use_pre_activation": True}, ["has use_pre_activation=True"]),      # resnet_v2_*
    ("resnet18_small", {}, ["is a keras-hub ResNet; it fits resnet18, resnet34, resnet50_v1_5 (torchvision's "
                            "layout), not model 'resnet18_small'"]),
])
def test_a_keras_hub_resnet_preset_of_another_architecture_is_one_line(name, change, fragments, kerashub_resnet18,
                                                                      tmp_path):
    """Read in this process (`read_source`'s UserError is what `tfdp train` prints as its one line, exit 2:
    test_bad_weights_are_one_line_each); the settings that tell keras-hub's ResNets apart are named."""
    preset = str(tmp_path / "preset")
    shutil.copytree(kerashub_resnet18, preset)
    with open(os.path.join(preset, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["config"].update(change)
    with open(os.path.join(preset, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    cfg = validate({"model": {"name": name, "num_classes": 1000}})
    with pytest.raises(UserError) as raised:
        read_source(preset, cfg.model, cfg.data)
    assert "\n" not in str(raised.value)
    for fragment in fragments:
        assert fragment in str(raised.value)


@pytest.mark.parametrize("damaged", ["model.weights.h5", "task.weights.h5"])
def test_a_keras_hub_preset_with_a_weights_file_cut_short_is_one_line(damaged, kerashub_resnet18, tmp_path):
    """A preset copied in part (a download or sync that stopped): h5py's error on the file is named in one line,
    not raised as its OSError."""
    preset = tmp_path / "preset"
    shutil.copytree(kerashub_resnet18, preset)
    with open(preset / damaged, "r+b") as f:
        f.truncate(3000)
    cfg = validate({"model": {"name": "resnet18", "num_classes": 1000}})
    with pytest.raises(UserError) as raised:
        read_source(str(preset), cfg.model, cfg.data)
    message = str(raised.value)
    assert message.startswith(f"model.init_from: cannot read {preset / damaged} as a Keras weights file (") and \
        "truncated file" in message and "\n" not in message, message
