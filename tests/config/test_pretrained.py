"""Pretrained weights bring their preprocessing (tfdp/config/pretrained.py): the data config follows the weights of
`model.init_from` unless the user set the field, and the model's first layer then sees what Keras' own
`preprocess_input` (or the model's built-in preprocessing) gives it.
"""

import json
import os

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

from conftest import REPO
from tfdp.config import pretrained
from tfdp.config import IMAGENET_MEAN, IMAGENET_STD, dump_yaml, validate
from tfdp.errors import UserError
from tfdp.models import build_model
from tfdp.models.build import Standardize
from tfdp.models.keras_apps import APPS
from tfdp.models.keras_imagenet import MIRROR_ENV
from tfdp.models.weights import init_from, layers_with_weights

FIXTURES = os.path.join(REPO, "tests", "fixtures")


def photos(size: int) -> np.ndarray:
    """4 real photos (scikit-image's astronaut, coffee, chelsea, rocket), uint8, resized to `size` px."""
    full = np.load(os.path.join(FIXTURES, "photos.npy"))
    return np.round(tf.image.resize(full.astype(np.float32), (size, size), method="area").numpy()).astype(np.uint8)


def imagenet_cfg(name, image_size=64, data=None, **model):
    return validate({"model": {"name": name, "num_classes": 1000, "init_from": "imagenet", **model},
                     "data": {"image_size": image_size, "hflip": False, **(data or {})}})


def _in_model_preprocessing(constructor):
    """The Rescaling/Normalization layers keras.applications builds in front of MobileNetV3 and EfficientNetV2.

    Built in a StatelessScope: the variables are declared, not initialised (the backbone's random weights, 117M
    for EfficientNetV2-L, are never read here); the preprocessing layers hold none."""
    with keras.StatelessScope():
        model = constructor(weights=None, include_top=False, input_shape=(32, 32, 3), include_preprocessing=True)
    layers = [layer for layer in model.layers
              if isinstance(layer, (keras.layers.Rescaling, keras.layers.Normalization))]
    assert layers, constructor

    def apply(x):
        for layer in layers:
            x = layer(x)
        return keras.ops.convert_to_numpy(x)
    return apply


def efficientnet_v1_preprocessing(x):
    """EfficientNet (V1)'s built-in preprocessing with its ImageNet file: Rescaling(1/255), the file's Normalization
    (ImageNet's mean, and its std stored as the variance: tensorflow/tensorflow#49930), then keras.applications'
    mend, Rescaling(1/sqrt(std)) (keras/src/applications/efficientnet.py, `weights == "imagenet"`)."""
    from keras.src.applications.efficientnet import IMAGENET_STDDEV_RGB
    variance = np.float32(IMAGENET_STDDEV_RGB)
    normalised = keras.layers.Normalization(mean=np.float32(IMAGENET_MEAN) / 255, variance=variance)(x / 255)
    return keras.ops.convert_to_numpy(keras.layers.Rescaling(1 / np.sqrt(variance))(normalised))


def keras_reference(name):
    """How keras.applications itself prepares 0..255 RGB pixels for `name`'s ImageNet weights."""
    if name.startswith("efficientnet_b"):
        return efficientnet_v1_preprocessing
    constructor = APPS[name][0]
    by_module = {"resnet": keras.applications.resnet, "inception_v3": keras.applications.inception_v3,
                 "mobilenet_v2": keras.applications.mobilenet_v2}
    for prefix, module in by_module.items():
        if name.startswith(prefix):
            return lambda x: module.preprocess_input(np.array(x, np.float32))
    return _in_model_preprocessing(constructor)


def test_every_keras_zoo_model_has_its_preprocessing():
    from tfdp.models.keras_imagenet import imagenet_files
    assert set(pretrained.KERAS_IMAGENET) == set(imagenet_files()) == set(APPS)


@pytest.mark.parametrize("name", sorted(pretrained.KERAS_IMAGENET))
def test_the_resolved_preprocessing_is_keras_own(name):
    """Standardize with the values resolved for `--init_from=imagenet` equals Keras' preprocessing, per model."""
    cfg = imagenet_cfg(name, image_size=75)
    x = photos(32)
    ours = keras.ops.convert_to_numpy(Standardize(cfg.data.mean, cfg.data.std, cfg.data.channel_order)(x))
    theirs = keras_reference(name)(x.astype(np.float32))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-4)


def test_keras_efficientnet_b0_weights_give_keras_own_logits(tmp_path, monkeypatch, capsys):
    """`--init_from=imagenet` for efficientnet_b0 (keras.applications' EfficientNetB0 from its stem on, tfdp
    normalising instead of its built-in layers): on real photos, tfdp's logits are those of the model
    keras.applications itself builds for its ImageNet file, Rescaling, Normalization and Keras' mend included,
    that file loaded by Keras (its download replaced by the file written here)."""
    from keras.src.applications import efficientnet
    from keras.src.legacy.saving.legacy_h5_format import save_weights_to_hdf5_group
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.setenv(MIRROR_ENV, "http://127.0.0.1:9/")  # never the network, should the file be missing
    keras.utils.set_random_seed(5)
    source = keras.applications.EfficientNetB0(weights=None, classifier_activation=None)
    normalization = next(layer for layer in source.layers if isinstance(layer, keras.layers.Normalization))
    normalization.set_weights(   # as in Keras' file: ImageNet's mean, its std as the variance
        [np.float32(IMAGENET_MEAN) / 255, np.float32(efficientnet.IMAGENET_STDDEV_RGB), np.int64(0)])
    file = tmp_path / "models" / "efficientnetb0.h5"
    os.makedirs(file.parent)
    with h5py.File(file, "w") as f:
        save_weights_to_hdf5_group(f, source)
    monkeypatch.setattr(efficientnet.file_utils, "get_file",
                        lambda name, *args, **kwargs: str(tmp_path / "models" / name))
    reference = keras.applications.EfficientNetB0(weights="imagenet", classifier_activation=None)

    cfg = imagenet_cfg("efficientnet_b0", image_size=224)
    model = build_model(cfg.model, cfg.data)
    capsys.readouterr()
    init_from(model, cfg.model, cfg.data, resumed=False)
    n = len(layers_with_weights(model))   # every layer, the 1,000-class classifier too; the file's Normalization unused
    assert f"tfdp: init_from: loaded {n} of {n} layers from imagenet weights" in capsys.readouterr().out

    x = photos(224)
    ours = model.predict(x, verbose=0)
    theirs = reference.predict(x.astype(np.float32), verbose=0)
    scale = np.abs(theirs).max()
    assert scale > 0 and np.ptp(theirs, axis=0).max() > 1e-3 * scale  # the photos give different logits
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * scale)
    # the file's "variance" taken as a variance (no mend) is far off: the test tells the two apart
    unmended = source.predict(x.astype(np.float32), verbose=0)
    assert np.abs(unmended - theirs).max() > 100 * 1e-4 * scale


def test_keras_resnet50_weights_see_bgr_as_in_keras(tmp_path, monkeypatch, capsys):
    """`--init_from=imagenet` for resnet50, fed a weights file in Keras' layout: tfdp's logits on real photos
    are keras.applications.ResNet50's with `preprocess_input` (BGR, the mean subtracted)."""
    from keras.src.legacy.saving.legacy_h5_format import save_weights_to_hdf5_group
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.setenv(MIRROR_ENV, "http://127.0.0.1:9/")  # never the network, should the file be missing
    keras.utils.set_random_seed(5)
    reference = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classifier_activation=None)
    os.makedirs(tmp_path / "models")
    with h5py.File(tmp_path / "models" / "resnet50_weights_tf_dim_ordering_tf_kernels.h5", "w") as f:
        save_weights_to_hdf5_group(f, reference)

    cfg = imagenet_cfg("resnet50")
    assert (cfg.data.channel_order, cfg.data.mean, cfg.data.std) == ("bgr", (123.68, 116.779, 103.939), (1, 1, 1))
    model = build_model(cfg.model, cfg.data)
    capsys.readouterr()
    init_from(model, cfg.model, cfg.data, resumed=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("tfdp: preprocessing from imagenet weights (keras resnet50, caffe): BGR, mean "
                        "123.7,116.8,103.9, std 1,1,1 (R,G,B); set data.mean/std/channel_order to override"), lines

    x = photos(64)
    ours = model.predict(x, verbose=0)
    theirs = reference.predict(keras.applications.resnet.preprocess_input(x.astype(np.float32)), verbose=0)
    scale = np.abs(theirs).max()
    assert scale > 0 and np.ptp(theirs, axis=0).max() > 1e-3 * scale  # the photos give different logits
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * scale)
    # RGB into the same weights (what tfdp fed before) is far off: the test tells the two apart
    rgb = reference.predict(x.astype(np.float32) - np.float32([123.68, 116.779, 103.939]), verbose=0)
    assert np.abs(rgb - theirs).max() > 100 * 1e-4 * scale


def test_a_field_the_user_sets_wins_and_the_rest_follow_the_weights():
    cfg = imagenet_cfg("resnet50", data={"mean": [1.0, 2.0, 3.0], "channel_order": "rgb"})
    assert (cfg.data.mean, cfg.data.std, cfg.data.channel_order) == ((1.0, 2.0, 3.0), (1.0, 1.0, 1.0), "rgb")
    assert pretrained.line(cfg.model, cfg.data) == (
        "tfdp: preprocessing from imagenet weights (keras resnet50, caffe): std 1,1,1 (R,G,B); data.mean, "
        "data.channel_order from the config; set data.mean/std/channel_order to override")
    # ... and the run says where what it set is not what the weights were trained with
    assert pretrained.differing_line(cfg.model, cfg.data) == (
        "tfdp: preprocessing: the config's data.mean 1,2,3, data.channel_order rgb differ from what the weights were "
        "trained with (imagenet weights (keras resnet50, caffe): mean 123.7,116.8,103.9, channel_order bgr); the "
        "config's are used (leave them out of it to take the weights')")
    assert pretrained.differing_line(imagenet_cfg("resnet50").model, imagenet_cfg("resnet50").data) is None
    plain = validate({"model": {"name": "resnet50"}})  # no init_from: ImageNet's RGB statistics
    assert (plain.data.mean, plain.data.std, plain.data.channel_order) == (IMAGENET_MEAN, IMAGENET_STD, "rgb")
    assert pretrained.line(plain.model, plain.data) is None and pretrained.differing_line(plain.model, plain.data) is None


def test_the_resolved_values_are_what_config_yaml_records():
    cfg = imagenet_cfg("inception_v3", image_size=75)
    saved = yaml.safe_load(dump_yaml(cfg))["data"]
    assert (saved["mean"], saved["std"], saved["channel_order"]) == ([127.5] * 3, [127.5] * 3, "rgb")
    again = validate(yaml.safe_load(dump_yaml(imagenet_cfg("resnet50"))))  # the saved config as --config
    assert (again.data.channel_order, again.data.mean) == ("bgr", (123.68, 116.779, 103.939))


def fake_run(root, **data) -> str:
    """A run directory as `tfdp train` leaves it: config.yaml, checkpoints/ (with a best file), export/."""
    os.makedirs(os.path.join(root, "checkpoints", "epoch-0001"))
    os.makedirs(os.path.join(root, "export"))
    for path in ("checkpoints/best.weights.h5", "checkpoints/epoch-0001/model.weights.h5", "export/model.keras"):
        open(os.path.join(root, path), "wb").close()
    with open(os.path.join(root, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump({"model": {"name": "simple_cnn"}, "data": {"image_size": 16, **data}}, f)
    return str(root)


def test_a_tfdp_run_brings_its_own_config(tmp_path):
    run = fake_run(tmp_path / "pre", mean=[10.0, 20.0, 30.0], std=[2.0, 3.0, 4.0], channel_order="bgr",
                   eval_crop_fraction=0.9)
    for spec in (run, f"{run}/checkpoints/epoch-0001", f"{run}/checkpoints/best.weights.h5",
                 f"{run}/export/model.keras"):
        cfg = validate({"model": {"name": "simple_cnn", "init_from": spec}, "model_dir": str(tmp_path / "new")})
        assert (cfg.data.mean, cfg.data.std, cfg.data.channel_order, cfg.data.eval_crop_fraction) == (
            (10.0, 20.0, 30.0), (2.0, 3.0, 4.0), "bgr", 0.9), spec
    assert pretrained.line(cfg.model, cfg.data) == (
        f"tfdp: preprocessing from the weights of run {run}: BGR, mean 10,20,30, std 2,3,4 (R,G,B), eval crop 0.9; "
        f"set data.mean/std/channel_order/eval_crop_fraction to override")
    # a run written before channel_order existed: RGB
    old = fake_run(tmp_path / "old", mean=[1.0, 1.0, 1.0], std=[1.0, 1.0, 1.0])
    cfg = validate({"model": {"name": "resnet50", "init_from": old}, "model_dir": str(tmp_path / "new2")})
    assert cfg.data.channel_order == "rgb"


def test_a_run_with_checkpoints_keeps_its_own_preprocessing(tmp_path):
    """Resume, evaluate, export and predict of a run use what it trained with, whatever init_from says now."""
    run = fake_run(tmp_path / "run", mean=[127.5] * 3, std=[127.5] * 3, channel_order="rgb")
    cfg = validate({"model": {"name": "resnet50", "init_from": "imagenet"}, "model_dir": run})
    assert (cfg.data.mean, cfg.data.channel_order) == ((127.5,) * 3, "rgb")
    cfg = validate({"model": {"name": "resnet50"}, "model_dir": run})
    assert cfg.data.std == (127.5,) * 3
    empty = tmp_path / "fresh"
    os.makedirs(empty / "checkpoints")  # a run that wrote no checkpoint yet follows the weights
    (empty / "config.yaml").write_text("data: {channel_order: rgb}\n")
    assert validate({"model": {"name": "resnet50", "init_from": "imagenet"},
                     "model_dir": str(empty)}).data.channel_order == "bgr"


def write_safetensors(path, metadata=None):
    from safetensors.numpy import save_file
    save_file({"fc.weight": np.zeros((2, 2), np.float32)}, str(path), metadata=metadata)
    return str(path)


def test_torch_files_take_imagenet_rgb_or_their_timm_pretrained_cfg(tmp_path):
    plain = write_safetensors(tmp_path / "tv.safetensors")
    cfg = validate({"model": {"name": "resnet18", "init_from": plain}})
    assert (cfg.data.mean, cfg.data.std, cfg.data.channel_order) == (IMAGENET_MEAN, IMAGENET_STD, "rgb")
    # torchvision's evaluation resize (bilinear, antialiased), and that nothing in the file said so
    assert pretrained.line(cfg.model, cfg.data).endswith(
        "(R,G,B), bilinear resize; set data.mean/std/channel_order/eval_interpolation to override")
    assert cfg.data.eval_interpolation == "bilinear"
    assert pretrained.assumed_line(cfg.model) == (
        "tfdp: assumed: tv.safetensors carries no pretrained cfg (no metadata, no config.json beside it): "
        "torchvision's ImageNet mean/std and bilinear resize are assumed, as timm assumes for such a file; weights "
        "trained otherwise (many ViTs: mean and std 0.5) are misread without a word: set data.mean, data.std and "
        "data.eval_interpolation to theirs")
    timm = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.5, 1.0], "crop_pct": 0.95, "interpolation": "bicubic"}
    inside = write_safetensors(tmp_path / "timm.safetensors", {"pretrained_cfg": json.dumps(timm)})
    os.makedirs(tmp_path / "hub")
    beside = write_safetensors(tmp_path / "hub" / "model.safetensors")
    (tmp_path / "hub" / "config.json").write_text(json.dumps({"architecture": "resnet18", "pretrained_cfg": timm}))
    for path in (inside, beside):
        cfg = validate({"model": {"name": "resnet18", "init_from": path}})
        assert (cfg.data.mean, cfg.data.std, cfg.data.eval_crop_fraction) == (
            (127.5,) * 3, (63.75, 127.5, 255.0), 0.95), path
    assert pretrained.line(cfg.model, cfg.data) == (
        "tfdp: preprocessing from model.safetensors (its timm pretrained cfg): RGB, mean 127.5,127.5,127.5, "
        "std 63.75,127.5,255 (R,G,B), eval crop 0.95, bicubic resize; set "
        "data.mean/std/channel_order/eval_crop_fraction/eval_interpolation to override")
    assert cfg.data.eval_interpolation == "bicubic" and pretrained.assumed_line(cfg.model) is None
    # a recipe's own normalisation: the same values as a recipe writes them say nothing, others one line
    same = validate({"model": {"name": "resnet18", "init_from": inside}, "data": {"mean": [127.5] * 3,
                                                                               "std": [63.75, 127.5, 255.0]}})
    assert pretrained.differing_line(same.model, same.data) is None
    imagenet = validate({"model": {"name": "resnet18", "init_from": inside},
                         "data": {"mean": [123.675, 116.28, 103.53], "eval_crop_fraction": 0.875}})
    assert pretrained.differing_line(imagenet.model, imagenet.data) == (
        "tfdp: preprocessing: the config's data.mean 123.7,116.3,103.5 differ from what the weights were trained "
        "with (timm.safetensors (its timm pretrained cfg): mean 127.5,127.5,127.5); the config's are used (leave "
        "them out of it to take the weights')")
    assert pretrained.differing_line(*(lambda c: (c.model, c.data))(validate(
        {"model": {"name": "resnet18", "init_from": plain}, "data": {"mean": [123.675, 116.28, 103.53]}}))) is None


def test_weights_that_say_nothing_leave_the_config_as_it_is(tmp_path):
    loose = tmp_path / "w.weights.h5"
    loose.write_bytes(b"")
    cfg = validate({"model": {"name": "simple_cnn", "init_from": str(loose)}, "data": {"eval_crop_fraction": 1.0}})
    assert (cfg.data.mean, cfg.data.channel_order, cfg.data.eval_crop_fraction) == (IMAGENET_MEAN, "rgb", 1.0)
    missing = validate({"model": {"name": "simple_cnn", "init_from": str(tmp_path / "nope.safetensors")}})
    assert missing.data.mean == IMAGENET_MEAN  # the reader says the file is missing, later


def test_bad_preprocessing_in_a_file_is_one_line(tmp_path):
    bad = write_safetensors(tmp_path / "bad.safetensors", {"pretrained_cfg": json.dumps({"mean": [0.5],
                                                                                        "std": [0.5]})})
    with pytest.raises(UserError, match=r"^model.init_from: .*bad.safetensors: its preprocessing .* set data.mean"):
        validate({"model": {"name": "resnet18", "init_from": bad}})
    run = fake_run(tmp_path / "run", channel_order="grb", mean=[1.0, 1.0, 1.0])
    with pytest.raises(UserError, match="is not 3 means, 3 positive stds, rgb|bgr"):
        validate({"model": {"name": "simple_cnn", "init_from": run}, "model_dir": str(tmp_path / "n")})


def test_bgr_survives_saving_the_model(tmp_path):
    """The channel order is part of the saved model (tfdp export's .keras file)."""
    cfg = imagenet_cfg("resnet50", image_size=32)
    layer = Standardize(cfg.data.mean, cfg.data.std, cfg.data.channel_order)
    inputs = keras.Input((8, 8, 3), dtype="uint8")
    model = keras.Model(inputs, layer(inputs))
    model.save(tmp_path / "m.keras")
    again = keras.saving.load_model(tmp_path / "m.keras")
    x = photos(8)
    np.testing.assert_array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))
    assert again.layers[-1].channel_order == "bgr"



def test_a_model_named_for_its_size_builds_at_it():
    """timm's names end in the side the model was made for (vit_small_patch16_224): unless the config or the weights
    say another, it is data.image_size (the demo's 32 would resample a ViT's position embeddings to a 2x2 grid)."""
    assert validate({"model": {"name": "vit_small_patch16_224"}}).data.image_size == 224
    assert validate({"model": {"name": "swin_base_patch4_window12_384"}}).data.image_size == 384
    assert validate({"model": {"name": "vit_mediumd_patch16_reg4_gap_384"}}).data.image_size == 384
    assert validate({"model": {"name": "vit_small_patch16_224"}, "data": {"image_size": 64}}).data.image_size == 64
    # a torchvision file carries no size: the name's; a timm file's pretrained cfg says its own (16 px)
    torchvision = os.path.join(FIXTURES, "vit_torchvision_mini.safetensors")
    assert validate({"model": {"name": "vit_base_patch16_224", "init_from": torchvision}}).data.image_size == 224
    timm = os.path.join(FIXTURES, "vit_timm_mini.safetensors")
    assert validate({"model": {"name": "vit_base_patch16_224", "init_from": timm}}).data.image_size == 16
    # a number that names a width or a variant is no size
    for name in ("regnety_320", "regnetx_016", "efficientnet_b0", "resnet50", "vit_base_patch14_dinov2"):
        assert validate({"model": {"name": name}}).data.image_size == 32, name


def test_what_a_command_from_weights_assumes_is_said_with_how_to_change_it(tmp_path):
    """A timm state dict saved without its pretrained cfg: ImageNet's mean/std and a bilinear resize are assumed,
    and said so (a ViT trained with 0.5/0.5 fed them is 47 % off with no other sign); the size from the name."""
    bare = write_safetensors(tmp_path / "vit.safetensors")
    cfg = validate({"model": {"name": "vit_small_patch16_224", "init_from": bare}}, from_run=False)
    assert pretrained.assumptions(cfg) == [
        "tfdp: assumed: RGB, mean 123.7,116.3,103.5, std 58.4,57.12,57.38 (R,G,B, 0..255 units), from vit.safetensors "
        "(torchvision's ImageNet normalisation) (vit.safetensors carries no pretrained cfg (no metadata, no "
        "config.json beside it): torchvision's ImageNet mean/std and bilinear resize are assumed, as timm assumes for "
        "such a file); set data.mean, data.std, data.channel_order to change",
        "tfdp: assumed: image size 224 px, the one model vit_small_patch16_224's name says; set data.image_size to "
        "change",
        "tfdp: assumed: evaluation crop 0.875 of the shorter side at 224 px, after a bilinear resize of the shorter "
        "side to 256 px antialiased as Pillow's; set data.eval_crop_fraction, data.eval_interpolation (fast, "
        "bilinear, bicubic) to change"]
    told = validate({"model": {"name": "vit_small_patch16_224", "init_from": bare},
                     "data": {"mean": [127.5] * 3, "std": [127.5] * 3, "image_size": 256}}, from_run=False)
    assert pretrained.assumptions(told)[1] == ("tfdp: assumed: image size 256 px, the config's; set data.image_size "
                                               "to change")
