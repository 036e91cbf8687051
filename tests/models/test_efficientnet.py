"""EfficientNet B0-B7 (keras.applications' graph from its stem on) and EfficientNetV2 (tfdp/models/keras_apps.py)
with timm's TensorFlow-padded weights (`tf_efficientnet_b*`, `tf_efficientnetv2_*`), and `efficientnet_b*_torch`
(the same graph padded as PyTorch pads) with timm's own `efficientnet_b*`, checked against torch and timm's own
outputs: the fixture (tests/fixtures/make_efficientnet_fixture.py) holds a small random model of each, their logits
on real photos, and the state-dict names and shapes of four full-size ones. Keras' own ImageNet files:
tests/config/test_pretrained.py.
"""

import json
import os

import keras
import numpy as np
import pytest

from conftest import REPO
from support.timm_checks import assert_logits_are, photo_logits
from tfdp.config import IMAGENET_MEAN, validate
from tfdp.errors import UserError
from tfdp.models import build_model
from tfdp.models.keras_apps import efficientnet_layers, from_the_stem, torch_padded
from tfdp.models.weights import layers_with_weights, load_into, read_source, torch_weights
from tfdp.optim.finetune import layer_ids

FIXTURES = os.path.join(REPO, "tests", "fixtures")
SMALL = os.path.join(FIXTURES, "efficientnet_timm", "model.safetensors")


def fixture() -> dict:
    with open(os.path.join(FIXTURES, "efficientnet_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


def cfg_for(name: str, init_from: str = "", num_classes: int = 10):
    return validate({"model": {"name": name, "num_classes": num_classes, "init_from": init_from},
                     "data": {"image_size": 224}})


def keras_small(folder: str, classes: int):
    """keras.applications' builder of the fixture's small model, at its width and depth, without the built-in
    preprocessing, as the zoo builds its models (V1 cut at its stem, V2 with include_preprocessing off; timm's own
    EfficientNet padded as PyTorch pads)."""
    from keras.src.applications.efficientnet import EfficientNet
    from keras.src.applications.efficientnet_v2 import EfficientNetV2
    spec = fixture()["small"]
    common = dict(width_coefficient=spec["width"], depth_coefficient=spec["depth"], default_size=224, weights=None,
                  input_shape=(224, 224, 3), classes=classes, classifier_activation=None)
    if folder == "efficientnet_timm":
        return from_the_stem(EfficientNet)(**common)
    if folder in ("efficientnet_torch_timm", "efficientnet_torchvision"):
        return torch_padded(from_the_stem(EfficientNet))(**common)
    if folder == "efficientnetv2_torchvision":   # its own small table, at width and depth 1
        blocks = [{"kernel_size": k, "num_repeat": n, "input_filters": cin, "output_filters": cout, "expand_ratio": e,
                   "se_ratio": 0 if kind == "fused" else 0.25, "strides": s, "conv_type": int(kind == "fused")}
                  for kind, e, k, s, cin, cout, n in spec["efficientnetv2_torchvision"]["arch"]]
        common.update(width_coefficient=1.0, depth_coefficient=1.0, blocks_args=blocks)
        return torch_padded(EfficientNetV2)(**common, name="efficientnetv2-s", include_preprocessing=False)
    return EfficientNetV2(**common, name="efficientnetv2-b0", include_preprocessing=False)


@pytest.mark.parametrize("folder,name,mean", [("efficientnet_timm", "efficientnet_b0", IMAGENET_MEAN),
                                              ("efficientnetv2_timm", "efficientnetv2_b0", (127.5,) * 3),
                                              ("efficientnet_torch_timm", "efficientnet_b0_torch", IMAGENET_MEAN),
                                              ("efficientnet_torchvision", "efficientnet_b0_torch", IMAGENET_MEAN),
                                              ("efficientnetv2_torchvision", "efficientnetv2_s_torch", IMAGENET_MEAN)])
def test_timm_and_torchvision_efficientnets_give_their_logits_on_real_photos(folder, name, mean):
    """The fixture's small tf_efficientnet, tf_efficientnetv2, timm's own (PyTorch-padded) efficientnet and
    torchvision's EfficientNet (width 0.25, depth 0.34 of B0; every block kind) read by tfdp's reader into
    keras.applications' builder at the same width and depth (the last two padded as PyTorch pads), and torchvision's
    EfficientNetV2 of a small table (fused blocks with and without expansion, squeeze-excite blocks; epsilon 1e-3,
    folded) into Keras' V2 builder of the same table padded as PyTorch pads: on 4 real photos, normalised as each
    file's pretrained cfg says (V2's: mean and std 0.5; torchvision's, which has none: ImageNet's), the logits are
    timm's and torchvision's."""
    path = (os.path.join(FIXTURES, f"{folder}.safetensors") if folder.endswith("torchvision")
            else os.path.join(FIXTURES, folder, "model.safetensors"))
    model = keras_small(folder, fixture()["small"]["num_classes"])
    cfg = cfg_for(name, init_from=path)
    np.testing.assert_allclose(cfg.data.mean, mean)   # from its pretrained cfg
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    assert_logits_are(photo_logits(model, cfg.data), np.load(os.path.join(FIXTURES, "efficientnet_logits.npz"))[folder])


@pytest.mark.parametrize("timm_name,name,second", [("tf_efficientnet_b0", "efficientnet_b0", None),
                                                   ("tf_efficientnet_b3", "efficientnet_b3", "block1b_dwconv"),
                                                   ("tf_efficientnetv2_b0", "efficientnetv2_b0", None),
                                                   ("tf_efficientnetv2_s", "efficientnetv2_s", "block1b_project_conv"),
                                                   ("torchvision_efficientnet_b3", "efficientnet_b3_torch",
                                                    "block1b_dwconv"),
                                                   ("torchvision_efficientnet_v2_s", "efficientnetv2_s_torch",
                                                    "block1b_project_conv")])
def test_full_size_state_dicts_fill_every_layer_of_the_zoo_model(timm_name, name, second):
    """Every tensor of timm's (or torchvision's) full-size state dict (names and shapes; zeros here) finds its layer
    and shape in the zoo model at 1,000 classes, and every layer of the model gets its values (B3 and V2-S: a second
    block in the first stage, which the small models lack)."""
    tensors = {k: np.zeros(shape, np.float32) for k, shape in fixture()["state_dicts"][timm_name].items()}
    cfg = cfg_for(name, num_classes=1000)
    model = build_model(cfg.model, cfg.data)
    loaded, new = load_into(model, torch_weights(tensors, cfg.model, timm_name), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    assert second is None or second in loaded
    keras.backend.clear_session()


def test_layer_decay_groups_are_timms():
    """`optimizer.layer_decay`'s layer ids for the small EfficientNet are those timm's `param_groups_layer_decay`
    gives each parameter (recorded by the fixture), matched through the weights' own mapping: the stem first, one
    group per block (Keras' `block4b` after `block4a`), the head's convolution with the last block, the classifier
    last."""
    timm_ids = fixture()["small"]["efficientnet_torch_timm"]["layer_ids"]
    layer_of = efficientnet_layers({param.rpartition(".")[0] for param in timm_ids}, "dwconv")
    theirs: dict[str, set[int]] = {}
    for param, layer_id in timm_ids.items():
        theirs.setdefault(layer_of[param.rpartition(".")[0]], set()).add(layer_id)
    model = keras_small("efficientnet_torch_timm", fixture()["small"]["num_classes"])
    ids, count = layer_ids(model, "efficientnet_b0_torch")
    ours = {layer.name: {ids[id(w)] for w in layer.trainable_weights} for layer in layers_with_weights(model)}
    assert ours == theirs and count == max(timm_ids.values()) + 1 == 12
    assert ours["top_conv"] == ours["block7a_project_bn"] == {10}


def test_pytorch_padding_is_what_timms_own_efficientnet_needs():
    """timm's own efficientnet_b0 weights in Keras' graph (padded "same", epsilon 1e-3) give logits far from timm's:
    the logits test above tells the two graphs apart, and a file in the other graph is not a near miss."""
    path = os.path.join(FIXTURES, "efficientnet_torch_timm", "model.safetensors")
    model = keras_small("efficientnet_timm", fixture()["small"]["num_classes"])
    cfg = cfg_for("efficientnet_b0_torch", init_from=path)
    load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    ours = photo_logits(model, cfg.data)
    theirs = np.load(os.path.join(FIXTURES, "efficientnet_logits.npz"))["efficientnet_torch_timm"]
    assert np.abs(ours - theirs).max() > 0.05 * np.abs(theirs).max()


@pytest.mark.parametrize("folder,name,line", [
    ("efficientnet_torch_timm", "efficientnet_b0",
     r"holds timm's efficientnet_b0, padded as PyTorch pads; model 'efficientnet_b0' is padded as TensorFlow pads: "
     r"set model.name: efficientnet_b0_torch$"),
    ("efficientnet_timm", "efficientnet_b0_torch",
     r"holds timm's tf_efficientnet_b0, padded as TensorFlow pads; model 'efficientnet_b0_torch' is padded as "
     r"PyTorch pads: set model.name: efficientnet_b0$")])
def test_a_timm_efficientnet_of_the_other_padding_is_one_line(folder, name, line):
    """timm's own efficientnet_b0 and its tf_efficientnet_b0 (the architecture named in the file's config.json) have
    the same names and shapes: each is refused by the zoo model padded the other way, the line naming the one that
    fits."""
    path = os.path.join(FIXTURES, folder, "model.safetensors")
    cfg = cfg_for(name, init_from=path)
    with pytest.raises(UserError, match=line):
        read_source(path, cfg.model, cfg.data)


@pytest.mark.parametrize("name,line", [
    ("efficientnet_b3", r"torchvision_efficientnet_b3 is in torchvision's layout, padded as PyTorch pads; model "
                        r"'efficientnet_b3' is padded as TensorFlow pads: set model.name: efficientnet_b3_torch$"),
    ("efficientnetv2_s", r"model 'efficientnetv2_s' is padded as TensorFlow pads: set model.name: "
                         r"efficientnetv2_s_torch$"),
    ("efficientnetv2_b0", r"model 'efficientnetv2_b0' is padded as TensorFlow pads: no tfdp model of its size is "
                          r"padded as it is$")])
def test_torchvisions_efficientnet_where_it_does_not_fit_is_one_line(name, line):
    """torchvision's EfficientNets pad as PyTorch does, so they are refused by Keras' graph (TensorFlow's padding);
    the key lists stand for the files."""
    tensors = {k: np.zeros(shape, np.float32)
               for k, shape in fixture()["state_dicts"]["torchvision_efficientnet_b3"].items()}
    with pytest.raises(UserError, match=line):
        torch_weights(tensors, cfg_for(name).model, "torchvision_efficientnet_b3")


def test_torchvisions_b5_to_b7_normalise_as_torchvision_in_a_graph_of_torchs_epsilon():
    """torchvision builds its B5, B6 and B7 with batch-norm epsilon 1e-3, `efficientnet_b*_torch` normalise with
    torch's 1e-5: the small torchvision model built with epsilon 1e-3, read for `efficientnet_b5_torch` (the
    difference folded into each moving variance), gives torchvision's logits; read as a B0-B4 file (nothing folded),
    it does not; and torchvision's full-size B5 key list fills every layer of `efficientnet_b5_torch`."""
    path = os.path.join(FIXTURES, "efficientnet_torchvision_eps1e-3.safetensors")
    theirs = np.load(os.path.join(FIXTURES, "efficientnet_logits.npz"))["efficientnet_torchvision_eps1e-3"]
    for name, folded in (("efficientnet_b5_torch", True), ("efficientnet_b0_torch", False)):
        model = keras_small("efficientnet_torchvision", fixture()["small"]["num_classes"])
        cfg = cfg_for(name, init_from=path)
        load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
        ours = photo_logits(model, cfg.data)
        if folded:
            assert_logits_are(ours, theirs)
        else:
            assert np.abs(ours - theirs).max() > 0.05 * np.abs(theirs).max()
    tensors = {k: np.zeros(shape, np.float32)
               for k, shape in fixture()["state_dicts"]["torchvision_efficientnet_b5"].items()}
    cfg = cfg_for("efficientnet_b5_torch", num_classes=1000)
    model = build_model(cfg.model, cfg.data)
    loaded, new = load_into(model, torch_weights(tensors, cfg.model, "torchvision_efficientnet_b5"), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    keras.backend.clear_session()


def test_another_size_is_one_line():
    """The small fixture into the full-size B0 fails on its first shape."""
    cfg = cfg_for("efficientnet_b0", init_from=SMALL)
    model = build_model(cfg.model, cfg.data)
    with pytest.raises(UserError, match=r"does not fit model 'efficientnet_b0': stem_conv/kernel is \(3, 3, 3, 8\) "
                                        r"there \(conv_stem.weight\), the model's is \(3, 3, 3, 32\)"):
        load_into(model, read_source(SMALL, cfg.model, cfg.data), cfg.model)
