"""RegNetX and RegNetY (tfdp/models/regnet.py) against real timm: the fixture (tests/fixtures/make_regnet_fixture.py)
holds a small random timm RegNetX and RegNetY (grouped convolutions, squeeze-excite, projection and identity
shortcuts), their logits on 4 real photos, timm's parameter counts of the registry's 24 RegNets, the full-size
regnety_040 key list and timm's layer-decay group of every parameter.
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
from tfdp.errors import UserError
from tfdp.models import build_model
from tfdp.models.regnet import SPECS, RegNetSpec, regnet
from tfdp.models.weights import layers_with_weights, load_into, read_source, torch_weights

FIXTURES = os.path.join(REPO, "tests", "fixtures")
SMALL = {"regnetx_timm_mini": "regnetx_002", "regnety_timm_mini": "regnety_002"}   # file → a zoo model of its kind
# torchvision's RegNets whose stage tables are timm's (the others' widths are their own): what each loads into
TORCHVISION = {"regnet_y_400mf": "regnety_004", "regnet_y_1_6gf": "regnety_016", "regnet_y_3_2gf": "regnety_032",
               "regnet_y_16gf": "regnety_160", "regnet_y_32gf": "regnety_320", "regnet_x_800mf": "regnetx_008",
               "regnet_x_1_6gf": "regnetx_016", "regnet_x_3_2gf": "regnetx_032", "regnet_x_8gf": "regnetx_080",
               "regnet_x_16gf": "regnetx_160", "regnet_x_32gf": "regnetx_320"}


def fixture() -> dict:
    with open(os.path.join(FIXTURES, "regnet_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


def small(name: str):
    """tfdp's RegNet at the fixture model's stages, 56 px."""
    spec = fixture()["small"][name]
    depths, widths, group_widths = zip(*spec["stages"])
    return regnet((56, 56, 3), fixture()["small"]["num_classes"], 0.0,
                  RegNetSpec(depths, widths, group_widths, se=spec["se_ratio"] > 0), name)


@pytest.mark.parametrize("name", sorted(SMALL) + ["regnety_torchvision_mini"])
def test_timm_regnet_weights_give_timms_logits_on_real_photos(name):
    """Every layer loaded through the config (a state dict without a config: ImageNet's normalisation), then timm's
    logits on the photos at 56 px; and torchvision's RegNet class of the same stages, in its own layout."""
    path = os.path.join(FIXTURES, f"{name}.safetensors")
    cfg = validate({"model": {"name": SMALL.get(name, "regnety_002"), "num_classes": 10, "init_from": path},
                    "data": {"image_size": 56}})
    model = small(name)
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    assert ({"s1_b1_se_fc1"} <= set(loaded)) == name.startswith("regnety")
    theirs = np.load(os.path.join(FIXTURES, "regnet_logits.npz"))[name]
    assert_logits_are(photo_logits(model, cfg.data, every=4), theirs)


def test_counts_and_the_published_key_list_are_timms():
    """At 1,000 classes every registry RegNet has timm's parameter count (its weights, built for their shapes only),
    and timm's full-size regnety_040 key list fills every layer of the zoo's regnety_040."""
    counts = fixture()["parameter_counts"]
    assert sorted(counts) == sorted(SPECS)
    counts_and_key_list_are_timms(counts, "regnety_040", fixture()["state_dicts"]["regnety_040"])


@pytest.mark.parametrize("name", sorted(SMALL))
def test_layer_decay_groups_are_timms(name):
    """`optimizer.layer_decay`'s layer ids are those timm's `param_groups_layer_decay` gives each parameter: the
    stem, one group per block, the classifier last."""
    timm_ids = fixture()["layer_ids"][name]
    path = os.path.join(FIXTURES, f"{name}.safetensors")
    weights = torch_weights(load_file(path), ModelConfig(name=SMALL[name], num_classes=10), path)
    ours, count = tfdp_groups(small(name), SMALL[name])
    assert ours == timm_groups(weights.names, timm_ids)
    assert count == max(timm_ids.values()) + 1 == 8


def test_torchvisions_regnets_of_timms_tables_fill_their_zoo_model():
    """The torchvision RegNets whose stage tables (blocks, widths, group widths, squeeze-excite) are a zoo model's
    are `TORCHVISION`'s, with timm's parameter counts; torchvision's full-size regnet_y_400mf key list fills every
    layer of regnety_004, and regnet_x_400mf's (widths of its own) is refused by regnetx_004 in one line."""
    timm_counts = fixture()["parameter_counts"]
    same = {}
    for tv_name, table in fixture()["torchvision"].items():
        for name, spec in SPECS.items():
            if ([list(s) for s in zip(spec.depths, spec.widths, spec.group_widths)] == table["stages"]
                    and spec.se == (table["se_ratio"] > 0)):
                same[tv_name] = name
                assert table["num_params"] == timm_counts[name], tv_name
    assert same == TORCHVISION
    for tv_name, name in (("regnet_y_400mf", "regnety_004"), ("regnet_x_400mf", "regnetx_004")):
        shapes = fixture()["state_dicts"][f"torchvision_{tv_name}"]
        tensors = {k: np.zeros(shape, np.float32) for k, shape in shapes.items()}
        cfg = ModelConfig(name=name, num_classes=1000)
        model = build_model(cfg, validate({"data": {"image_size": 224}}).data)
        if tv_name in TORCHVISION:
            loaded, new = load_into(model, torch_weights(tensors, cfg, tv_name), cfg)
            assert new == [] and len(loaded) == len(layers_with_weights(model))
        else:
            with pytest.raises(UserError, match=r"^model\.init_from: regnet_x_400mf does not fit model 'regnetx_004': "
                                                r"s4_b1_conv1_conv/kernel is \(1, 1, 160, 400\) there .*"
                                                r"the model's is \(1, 1, 160, 384\)$"):
                load_into(model, torch_weights(tensors, cfg, tv_name), cfg)


# test_models.py steps each builder's representative on 2 replicas; the RegNets' is this test's (regnety_002 at 32 px
# took 48 s there, eagerly, its grouped convolutions compiled per call), which steps its builder at the fixture's size
STEPPED = ("regnety_002", "the fixture's RegNetY: grouped convolutions, squeeze-excite, both kinds of shortcut")


def test_a_small_regnety_trains_on_two_replicas():
    """One eager SGD step on tfdp's 2-replica strategy (the replicated step and all-reduce test_models.py runs for
    the zoo): the loss is finite, the weights move, the logits come out for every image."""
    from support.model_checks import steps_on_replicas
    from tfdp.config import DistributeConfig
    from tfdp.distribute.strategy import make_runtime
    strategy = make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy
    images = np.random.default_rng(0).uniform(-1, 1, (4, 56, 56, 3)).astype(np.float32)
    model = steps_on_replicas(strategy, lambda: small("regnety_timm_mini"), images, 10)
    assert len(strategy.experimental_local_results(model.weights[0].value)) == 2
