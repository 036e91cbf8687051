"""MobileNetV3 with timm's and torchvision's weights (tfdp/models/keras_apps.py): timm's own `mobilenetv3_*_100` and
torchvision's `mobilenet_v3_*` into `mobilenet_v3_large_torch` and `_small_torch` (keras.applications' graph padded
as PyTorch pads, torch's batch norm), timm's TensorFlow ports `tf_mobilenetv3_*_100` into keras.applications' own
graph, checked against timm's and torchvision's outputs: the fixture (tests/fixtures/make_mobilenetv3_fixture.py)
holds one small architecture as each library's own class builds it, their logits on real photos, and the key and
shape lists of the four full-size models.
"""

import json
import os
import shutil

import keras
import numpy as np
import pytest

from conftest import REPO
from support.timm_checks import assert_logits_are, photo_logits
from tfdp.config import validate
from tfdp.errors import UserError
from tfdp.models import build_model
from tfdp.models.keras_apps import mobilenetv3_layers, torch_padded
from tfdp.models.weights import layers_with_weights, load_into, read_source, torch_weights
from tfdp.optim.finetune import layer_ids

FIXTURES = os.path.join(REPO, "tests", "fixtures")
# fixture file → the zoo model its full-size kind loads into
SMALL = {"mobilenetv3_timm_mini": "mobilenet_v3_large_torch", "mobilenetv3_tf_timm_mini": "mobilenet_v3_large",
         "mobilenetv3_torchvision_mini": "mobilenet_v3_large_torch"}


def fixture() -> dict:
    with open(os.path.join(FIXTURES, "mobilenetv3_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


def keras_small(torch: bool) -> keras.Model:
    """keras.applications' MobileNetV3 of the fixture's architecture (its `stack_fn`, block by block), without its
    built-in preprocessing as the zoo builds it; `torch`: padded as PyTorch pads (`torch_padded`)."""
    from keras.src.applications import mobilenet_v3 as upstream
    spec = fixture()["small"]

    def stack(x, kernel, activation, se_ratio):
        for i, (_, cin, mid, cout, k, stride, se, act) in enumerate(spec["arch"]):
            x = upstream._inverted_res_block(x, mid / cin, cout, k, stride, 0.25 if se else None,
                                             upstream.relu if act == "RE" else upstream.hard_swish, i)
        return x

    def build(**kwargs):
        return upstream.MobileNetV3(stack, spec["head"], input_shape=(spec["size"], spec["size"], 3), weights=None,
                                    include_preprocessing=False, classes=spec["num_classes"],
                                    classifier_activation=None, dropout_rate=0.0, **kwargs)
    return torch_padded(build)() if torch else build()


def cfg_for(name: str, init_from: str = "", num_classes: int = 10):
    return validate({"model": {"name": name, "num_classes": num_classes, "init_from": init_from},
                     "data": {"image_size": 64}})


@pytest.mark.parametrize("file", sorted(SMALL))
def test_timm_and_torchvision_mobilenetv3s_give_their_logits_on_real_photos(file):
    """The fixture's architecture as timm builds mobilenetv3_large_100 (PyTorch's padding, epsilon 1e-5) and
    tf_mobilenetv3_large_100 (padding "same", epsilon 1e-3), and as torchvision builds its MobileNetV3 (PyTorch's
    padding, epsilon 1e-3, folded into the moving variances), read into keras.applications' builder of the same
    blocks: every layer filled, and on 4 real photos the logits are timm's and torchvision's."""
    path = os.path.join(FIXTURES, f"{file}.safetensors")
    model = keras_small(torch=SMALL[file].endswith("_torch"))
    cfg = cfg_for(SMALL[file], init_from=path)
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    theirs = np.load(os.path.join(FIXTURES, "mobilenetv3_logits.npz"))[file]
    assert_logits_are(photo_logits(model, cfg.data, every=3, size=fixture()["small"]["size"]), theirs)


@pytest.mark.parametrize("file,torch", [("mobilenetv3_timm_mini", False), ("mobilenetv3_tf_timm_mini", True)])
def test_the_other_padding_gives_other_logits(file, torch):
    """Each timm file in the graph padded the other way (and normalised with the other epsilon) gives logits far from
    timm's: the test above tells the graphs apart, and the refusals below are not about a near miss."""
    path = os.path.join(FIXTURES, f"{file}.safetensors")
    model = keras_small(torch=torch)
    cfg = cfg_for(SMALL[file], init_from=path)
    load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    theirs = np.load(os.path.join(FIXTURES, "mobilenetv3_logits.npz"))[file]
    ours = photo_logits(model, cfg.data, every=3, size=fixture()["small"]["size"])
    assert np.abs(ours - theirs).max() > 0.05 * np.abs(theirs).max()


@pytest.mark.parametrize("source,name", [("mobilenetv3_large_100", "mobilenet_v3_large_torch"),
                                         ("mobilenetv3_large_100", "mobilenet_v3_large"),
                                         ("mobilenetv3_small_100", "mobilenet_v3_small_torch"),
                                         ("torchvision_mobilenet_v3_large", "mobilenet_v3_large_torch"),
                                         ("torchvision_mobilenet_v3_small", "mobilenet_v3_small_torch")])
def test_full_size_state_dicts_fill_every_layer_of_the_zoo_model(source, name):
    """Every tensor of the full-size state dicts (names and shapes; zeros here) finds its layer and shape in the zoo
    model at 1,000 classes, every layer gets its values, and the model's trainable count is timm's and
    torchvision's (the same)."""
    shapes = fixture()["state_dicts"][source]
    tensors = {k: np.zeros(shape, np.float32) for k, shape in shapes.items()}
    cfg = cfg_for(name, num_classes=1000)
    model = build_model(cfg.model, cfg.data)
    loaded, new = load_into(model, torch_weights(tensors, cfg.model, source), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert trainable == fixture()["parameter_counts"][source]
    keras.backend.clear_session()


def with_config(tmp_path, file: str, architecture: str) -> str:
    """A copy of a fixture file with a timm `config.json` beside it naming `architecture`, as timm's hub files have."""
    path = tmp_path / "model.safetensors"
    shutil.copy(os.path.join(FIXTURES, f"{file}.safetensors"), path)
    (tmp_path / "config.json").write_text(json.dumps({"architecture": architecture}))
    return str(path)


@pytest.mark.parametrize("file,architecture,name,line", [
    ("mobilenetv3_timm_mini", "mobilenetv3_large_100", "mobilenet_v3_large",
     r"holds timm's mobilenetv3_large_100, padded as PyTorch pads; model 'mobilenet_v3_large' is padded as "
     r"TensorFlow pads: set model.name: mobilenet_v3_large_torch$"),
    ("mobilenetv3_tf_timm_mini", "tf_mobilenetv3_small_100", "mobilenet_v3_small_torch",
     r"holds timm's tf_mobilenetv3_small_100, padded as TensorFlow pads; model 'mobilenet_v3_small_torch' is padded "
     r"as PyTorch pads: set model.name: mobilenet_v3_small$"),
    ("mobilenetv3_torchvision_mini", None, "mobilenet_v3_large",
     r"holds torchvision's layout, padded as PyTorch pads; model 'mobilenet_v3_large' is padded as TensorFlow "
     r"pads: set model.name: mobilenet_v3_large_torch$")])
def test_a_mobilenetv3_of_the_other_padding_is_one_line(tmp_path, file, architecture, name, line):
    """timm's own and its TensorFlow ports have the same names and shapes, and torchvision's fit either graph by
    shape: each is refused by the zoo model padded the other way (timm's by the architecture its config.json names),
    the line naming the one that fits."""
    path = (with_config(tmp_path, file, architecture) if architecture
            else os.path.join(FIXTURES, f"{file}.safetensors"))
    cfg = cfg_for(name, init_from=path)
    with pytest.raises(UserError, match=line):
        read_source(path, cfg.model, cfg.data)


@pytest.mark.parametrize("file", ["mobilenetv3_timm_mini", "mobilenetv3_tf_timm_mini"])
def test_layer_decay_groups_are_timms(file):
    """`optimizer.layer_decay`'s layer ids for the small MobileNetV3s are those timm's `param_groups_layer_decay`
    gives each parameter (recorded by the fixture), matched through the weights' own mapping: the stem first, one
    group per block (Keras' unnumbered first block before `expanded_conv_1_`), the last 1x1 convolution's stage,
    then the head's 1x1 convolution with the classifier."""
    timm_ids = fixture()["layer_ids"][file]
    layer_of = mobilenetv3_layers({param.rpartition(".")[0] for param in timm_ids})
    theirs: dict[str, set[int]] = {}
    for param, layer_id in timm_ids.items():
        theirs.setdefault(layer_of[param.rpartition(".")[0]], set()).add(layer_id)
    model = keras_small(torch=file == "mobilenetv3_timm_mini")
    ids, count = layer_ids(model, SMALL[file])
    ours = {layer.name: {ids[id(w)] for w in layer.trainable_weights} for layer in layers_with_weights(model)}
    assert ours == theirs and count == max(timm_ids.values()) + 1 == 8
    assert ours["conv_2"] == ours["logits"] == {7} and ours["expanded_conv_depthwise"] == {1}
