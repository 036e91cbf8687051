"""timm's ResNet-D (`resnet18d` ... `resnet152d`: a deep stem and average-pool shortcuts; tfdp/models/resnet.py)
against real timm: the fixture (tests/fixtures/make_resnet_d_fixture.py) holds two small random timm ResNet-Ds (basic
and bottleneck blocks), their logits on 4 real photos, timm's parameter counts, the full-size resnet50d key list and
timm's layer-decay group of every parameter.
"""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO
from support.timm_checks import (assert_logits_are, counts_and_key_list_are_timms, photo_logits, tfdp_groups,
                                 timm_groups)
from tfdp.config import ModelConfig, validate
from tfdp.models import MODELS
from tfdp.models.resnet import ResNetSpec, basic_block, bottleneck, resnet
from tfdp.models.weights import layers_with_weights, load_into, read_source, torch_weights

FIXTURES = os.path.join(REPO, "tests", "fixtures")
# fixture file → (the zoo model of its kind, block)
SMALL = {"resnet_d_timm_basic": ("resnet18d", basic_block), "resnet_d_timm_bottleneck": ("resnet50d", bottleneck)}


def fixture() -> dict:
    with open(os.path.join(FIXTURES, "resnet_d_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


def small(name: str):
    """tfdp's ResNet-D builder at the fixture's widths, one block per stage."""
    spec = fixture()["small"]
    block = SMALL[name][1]
    size = spec["image_size"]
    return resnet((size, size, 3), spec["num_classes"], 0.0,
                  ResNetSpec(block, (1, 1, 1, 1), name, block_kwargs=(("avg_down", True),),
                             deep_stem=spec["stem_width"], widths=tuple(spec[name]["widths"])))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_timm_resnet_d_weights_give_timms_logits_on_real_photos(name):
    """Every layer loaded through the config (a state dict without a config: ImageNet's normalisation), then
    timm's logits on the photos at 56 px, whose 7 px stage makes the shortcut's average pool take a one-pixel
    window."""
    path = os.path.join(FIXTURES, f"{name}.safetensors")
    cfg = validate({"model": {"name": SMALL[name][0], "num_classes": 10, "init_from": path},
                    "data": {"image_size": 56}})
    model = small(name)
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    assert {"stem_a_conv", "stem_b_bn", "stem_conv", "stage3_block1_down_conv"} <= set(loaded)
    theirs = np.load(os.path.join(FIXTURES, "resnet_d_logits.npz"))[name]
    assert_logits_are(photo_logits(model, cfg.data, every=4), theirs)


def test_counts_and_the_published_key_list_are_timms():
    """At 1,000 classes every ResNet-D has timm's parameter count (its trainable weights, built for their shapes
    only), and timm's full-size resnet50d key list fills every layer of the zoo's resnet50d."""
    counts = fixture()["parameter_counts"]
    assert sorted(counts) == sorted(n for n in MODELS if n.startswith("resnet") and n.endswith("d"))
    counts_and_key_list_are_timms(counts, "resnet50d", fixture()["state_dicts"]["resnet50d"])


@pytest.mark.parametrize("name", sorted(SMALL))
def test_layer_decay_groups_are_timms(name):
    """`optimizer.layer_decay`'s layer ids are those timm's `param_groups_layer_decay` gives each parameter: the
    deep stem one group, one per block (its shortcut with it), the classifier last."""
    timm_ids = fixture()["layer_ids"][name]
    path = os.path.join(FIXTURES, f"{name}.safetensors")
    weights = torch_weights(load_file(path), ModelConfig(name=SMALL[name][0], num_classes=10), path)
    ours, count = tfdp_groups(small(name), SMALL[name][0])
    assert ours == timm_groups(weights.names, timm_ids)
    assert count == max(timm_ids.values()) + 1 == 6
