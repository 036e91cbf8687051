"""EfficientNet B0-B7 (keras.applications' graph from its stem on) and EfficientNetV2 (tfdp/models/keras_apps.py)
with timm's TensorFlow-padded weights (`tf_efficientnet_b*`, `tf_efficientnetv2_*`), checked against torch and
timm's own outputs: the fixture (tests/fixtures/make_efficientnet_fixture.py) holds a small random model of each,
their logits on real photos, and the state-dict names and shapes of four full-size ones. Keras' own ImageNet
files: tests/config/test_pretrained.py.
"""

import json
import os
import shutil

import keras
import numpy as np
import pytest

from conftest import REPO
from tfdp.config import IMAGENET_MEAN, validate
from tfdp.errors import UserError
from tfdp.models import build_model
from tfdp.models.keras_apps import from_the_stem
from tfdp.models.weights import layers_with_weights, load_into, read_source, torch_weights

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
    preprocessing, as the zoo builds its models (V1 cut at its stem, V2 with include_preprocessing off)."""
    from keras.src.applications.efficientnet import EfficientNet
    from keras.src.applications.efficientnet_v2 import EfficientNetV2
    spec = fixture()["small"]
    common = dict(width_coefficient=spec["width"], depth_coefficient=spec["depth"], default_size=224, weights=None,
                  input_shape=(224, 224, 3), classes=classes, classifier_activation=None)
    if folder == "efficientnet_timm":
        return from_the_stem(EfficientNet)(**common)
    return EfficientNetV2(**common, name="efficientnetv2-b0", include_preprocessing=False)


@pytest.mark.parametrize("folder,name,mean", [("efficientnet_timm", "efficientnet_b0", IMAGENET_MEAN),
                                              ("efficientnetv2_timm", "efficientnetv2_b0", (127.5,) * 3)])
def test_timms_tf_efficientnets_give_timms_logits_on_real_photos(folder, name, mean):
    """The fixture's small tf_efficientnet and tf_efficientnetv2 (width 0.25, depth 0.34 of B0; every block kind)
    read by tfdp's timm reader into keras.applications' builder at the same width and depth: on 4 real photos,
    normalised as each file's pretrained cfg says (V2's: mean and std 0.5), the logits are timm's."""
    path = os.path.join(FIXTURES, folder, "model.safetensors")
    model = keras_small(folder, fixture()["small"]["num_classes"])
    cfg = cfg_for(name, init_from=path)
    np.testing.assert_allclose(cfg.data.mean, mean)   # from its pretrained cfg
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    photos = np.load(os.path.join(FIXTURES, "photos.npy")).astype(np.float32)
    ours = model.predict((photos - np.float32(cfg.data.mean)) / np.float32(cfg.data.std), verbose=0)
    theirs = np.load(os.path.join(FIXTURES, "efficientnet_logits.npz"))[folder]
    scale = np.abs(theirs).max()
    assert np.ptp(theirs, axis=0).max() > 0.1 * scale   # the photos give different logits
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("timm_name,name,second", [("tf_efficientnet_b0", "efficientnet_b0", None),
                                                   ("tf_efficientnet_b3", "efficientnet_b3", "block1b_dwconv"),
                                                   ("tf_efficientnetv2_b0", "efficientnetv2_b0", None),
                                                   ("tf_efficientnetv2_s", "efficientnetv2_s", "block1b_project_conv")])
def test_full_size_state_dicts_fill_every_layer_of_the_zoo_model(timm_name, name, second):
    """Every tensor of timm's full-size state dict (names and shapes; zeros here) finds its layer and shape in the
    zoo model at 1,000 classes, and every layer of the model gets its values (B3 and V2-S: a second block in the
    first stage, which the small models lack)."""
    tensors = {k: np.zeros(shape, np.float32) for k, shape in fixture()["state_dicts"][timm_name].items()}
    cfg = cfg_for(name, num_classes=1000)
    model = build_model(cfg.model, cfg.data)
    loaded, new = load_into(model, torch_weights(tensors, cfg.model, timm_name), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    assert second is None or second in loaded
    keras.backend.clear_session()


def test_timms_pytorch_padded_efficientnet_and_another_size_are_one_line_each(tmp_path):
    """timm's own efficientnet_b0 (PyTorch's padding, named in its config.json) is refused, not loaded into a graph
    that pads otherwise; the small fixture into the full-size B0 fails on its first shape."""
    folder = tmp_path / "efficientnet_b0.ra_in1k"
    shutil.copytree(os.path.dirname(SMALL), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architecture": "efficientnet_b0"}))
    cfg = cfg_for("efficientnet_b0", init_from=str(folder / "model.safetensors"))
    with pytest.raises(UserError, match=r"holds timm's efficientnet_b0, which pads its convolutions as PyTorch does; "
                                        r".*: use tf_efficientnet_b0 weights$"):
        read_source(str(folder / "model.safetensors"), cfg.model, cfg.data)
    cfg = cfg_for("efficientnet_b0", init_from=SMALL)
    model = build_model(cfg.model, cfg.data)
    with pytest.raises(UserError, match=r"does not fit model 'efficientnet_b0': stem_conv/kernel is \(3, 3, 3, 8\) "
                                        r"there \(conv_stem.weight\), the model's is \(3, 3, 3, 32\)"):
        load_into(model, read_source(SMALL, cfg.model, cfg.data), cfg.model)
