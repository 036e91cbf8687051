"""`tfdp models`: the kept parameter counts are those of the built models, every model has one, and the weights
each model is listed with are the readers registered for it."""

from __future__ import annotations

import keras
import pytest

from tfdp.commands.models import count_trainable, list_models, matching, weight_sources
from tfdp.errors import UserError
from tfdp.models import MODELS
from tfdp.models.param_counts import PARAM_COUNTS


@pytest.mark.parametrize("name, size, published", [
    ("resnet18", 224, 11_689_512),               # torchvision's resnet18
    ("vit_tiny_patch16_224", 224, 5_717_416),    # timm's vit_tiny_patch16_224 (its position embeddings: 224 px)
    ("efficientnet_b0", 224, None),
])
def test_kept_counts_are_those_of_the_built_models(name, size, published):
    model = MODELS[name]((size, size, 3), 1000)   # built as training builds it: variables allocated
    built = sum(int(w.numpy().size) for w in model.trainable_weights)
    keras.backend.clear_session()
    assert PARAM_COUNTS[name] == built == count_trainable(name)
    assert published is None or built == published


def test_every_registry_model_has_a_kept_count():
    """A model added to the registry is counted once (`python -m tfdp.commands.models`), not at every listing."""
    assert sorted(set(MODELS) - set(PARAM_COUNTS)) == [] and sorted(set(PARAM_COUNTS) - set(MODELS)) == []


@pytest.mark.parametrize("name, sources", [
    ("convnext_tiny", ["timm", "torchvision"]),
    ("efficientnet_b0", ["timm", "Keras imagenet"]),          # timm's tf_efficientnet_b0; Keras' own file
    ("efficientnet_b0_torch", ["timm", "torchvision"]),
    ("efficientnetv2_s_torch", ["torchvision"]),
    ("resnet50", ["Keras imagenet"]),
    ("resnet18", ["torchvision", "timm", "keras-hub"]),
    ("vgg16_bn", ["torchvision"]),
    ("vit_base_patch16_224", ["timm", "torchvision", "keras-hub"]),
    ("vit_base_patch16_clip_224", ["timm", "torchvision"]),    # no keras-hub ViT preset is a CLIP tower
    ("simple_cnn", []),
])
def test_weight_sources_are_the_registered_readers(name, sources):
    assert weight_sources(name) == sources


def test_patterns_match_as_timm_list_models_and_a_bare_word_within_names():
    assert matching("convnext") == matching("*convnext*") == sorted(n for n in MODELS if "convnext" in n)
    assert matching("resnet5?d") == ["resnet50d"]
    assert matching("vgg1[19]") == ["vgg11", "vgg19"]
    with pytest.raises(UserError, match=r"^no model matches 'resnet9000' \(\d+ models; try"):
        matching("resnet9000")
    lines = list_models("resnet18d")
    assert lines[1].split() == ["resnet18d", f"{PARAM_COUNTS['resnet18d']:,}", "any", "timm"]
