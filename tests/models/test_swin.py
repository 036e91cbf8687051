"""Swin Transformer: timm's parameter counts, timm's logits from its weights (shifted windows, their mask, the
patch merging, a stage that is one window), the published key list, and training, saving, XLA and bfloat16.

The fixture (tests/fixtures/swin_*, made by make_swin_fixture.py with real torch and timm) holds a seeded
random-init timm SwinTransformer of 3 small stages, its logits on 4 real photos at 32 px, the parameter counts of
the registry's Swins and the key and shape list of timm's swin_tiny_patch4_window7_224.
"""

import dataclasses
import json
import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO
from support.model_checks import trains_saves_and_compiles
from support.shapes import shapes_only
from tfdp.config import ModelConfig, validate
from tfdp.errors import UserError
from tfdp.models import MODELS, build_model
from tfdp.models.swin import SPECS, swin_state_dict, swin_transformer
from tfdp.models.weights import layers_with_weights, load_into, read_source, torch_weights

FIXTURES = os.path.join(REPO, "tests", "fixtures")
WEIGHTS = os.path.join(FIXTURES, "swin_timm_mini.safetensors")
# the fixture's architecture, every other setting the registry's swin_tiny's
SMALL = dataclasses.replace(SPECS["swin_tiny_patch4_window7_224"], patch=2, window=4, dim=16, depths=(2, 2, 2),
                            heads=(2, 4, 8))
MAX_RELATIVE = 1e-5   # float32 logits: max |ours - timm's| / max |timm's|


def facts() -> dict:
    with open(os.path.join(FIXTURES, "swin_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


def relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def test_parameter_counts_equal_timms_at_1000_classes():
    counts = facts()["parameter_counts"]
    assert sorted(counts) == sorted(n for n in MODELS if n.startswith("swin_")) and len(counts) == 6
    for name, found in counts.items():
        size = found["image_size"]
        with shapes_only():
            model = MODELS[name]((size, size, 3), 1000)
            assert sum(int(np.prod(w.shape)) for w in model.weights) == found["count"], name
            assert model.output_shape == (None, 1000)


def test_timm_weights_give_timms_logits():
    """Through the config as a run resolves it (ImageNet's mean and std, crop 0.9 and 32 px from the file's
    pretrained cfg), every layer loaded, uint8 photos in: timm's logits, top-1 equal."""
    cfg = validate({"model": {"name": "swin_tiny_patch4_window7_224", "num_classes": 10, "init_from": WEIGHTS},
                    "data": {"hflip": False}})
    assert (cfg.data.image_size, cfg.data.eval_crop_fraction) == (32, 0.9)
    model = swin_transformer((32, 32, 3), 10, 0.0, SMALL, "swin_fixture")
    loaded, new = load_into(model, read_source(WEIGHTS, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    attention = {layer.name: (layer.window, layer.shift) for layer in model.layers if layer.name.endswith("_attn")}
    assert attention == {"layers_0_blocks_0_attn": (4, 0), "layers_0_blocks_1_attn": (4, 2),
                         "layers_1_blocks_0_attn": (4, 0), "layers_1_blocks_1_attn": (4, 2),
                         "layers_2_blocks_0_attn": (4, 0), "layers_2_blocks_1_attn": (4, 0)}   # 4x4: one window
    photos = np.load(os.path.join(FIXTURES, "vit_photos.npz"))["32"]
    x = ((photos - np.array(cfg.data.mean)) / np.array(cfg.data.std)).astype("float32")
    logits, theirs = model.predict(x, verbose=0), np.load(os.path.join(FIXTURES, "swin_logits.npz"))["32"]
    assert relative(logits, theirs) <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(theirs.argmax(1))


def test_checkpoints_of_timm_before_0_9_load_as_timms_filter_renames_them():
    """The old layout (patch merging at the end of stage N, `head`), and the buffers old files hold, skipped."""
    tensors = load_file(WEIGHTS)
    old = {re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k).replace(
        "head.fc.", "head."): v for k, v in tensors.items()}
    old["layers.0.blocks.1.attn_mask"] = np.zeros((16, 16, 16), np.float32)
    old["layers.0.blocks.0.attn.relative_position_index"] = np.zeros((16, 16), np.int64)
    assert "layers.0.downsample.reduction.weight" in old and "head.weight" in old
    cfg = ModelConfig(name="swin_tiny_patch4_window7_224", num_classes=10)
    new, renamed = swin_state_dict(tensors, cfg, "new"), swin_state_dict(old, cfg, "old")
    assert sorted(new.values) == sorted(renamed.values)
    for layer, values in new.values.items():
        for a, b in zip(values, renamed.values[layer]):
            np.testing.assert_array_equal(a, b)


def test_published_state_dict_maps_onto_the_model():
    """timm's real swin_tiny_patch4_window7_224 keys and shapes onto the full-size model (`shapes_only`)."""
    shapes = facts()["state_dicts"]["swin_tiny_patch4_window7_224"]
    tensors = {k: np.broadcast_to(np.float32(0), s) for k, s in shapes.items()}
    cfg = ModelConfig(name="swin_tiny_patch4_window7_224", num_classes=1000)
    with shapes_only():
        model = MODELS[cfg.name]((224, 224, 3), 1000)
        loaded, new = load_into(model, torch_weights(tensors, cfg, "swin_tiny"), cfg)
    assert new == [] and len(loaded) == len(layers_with_weights(model))


def test_layer_groups_and_weight_decay_follow_timm():
    """timm's group_matcher(coarse=False): the patch embedding, one group per block with a stage's patch merging
    in its first block's, the final norm with the last block, the head (each parameter's id as timm's
    `param_groups_layer_decay` gives it, recorded by the fixture); the bias tables undecayed with
    decay_norm_and_bias false; drop path rising linearly over all the blocks."""
    from tfdp.models.resnet import DropPath
    from tfdp.optim.finetune import layer_ids, weight_layers
    from tfdp.optim.optimizers import build_optimizer
    model = swin_transformer((32, 32, 3), 10, 0.0, SMALL, "swin_fixture", drop_path=0.5)
    ids, count = layer_ids(model, "swin_tiny_patch4_window7_224")
    group = {layer.name: ids[id(layer.trainable_weights[0])] for layer in weight_layers(model)}
    assert count == 8 and group["patch_embed"] == group["patch_embed_norm"] == 0
    assert [group[f"layers_{s}_blocks_{b}_attn_qkv"] for s in range(3) for b in range(2)] == [1, 2, 3, 4, 5, 6]
    assert group["layers_1_downsample_reduction"] == group["layers_1_blocks_0_norm1"] == 3
    assert (group["norm"], group["head_fc"]) == (6, 7)
    theirs: dict[str, set[int]] = {}
    for param, layer_id in facts()["layer_ids"].items():
        module = param.rpartition(".")[0]
        theirs.setdefault("patch_embed" if module == "patch_embed.proj" else module.replace(".", "_"), set()).add(
            layer_id)
    assert {layer.name: {ids[id(w)] for w in layer.trainable_weights} for layer in weight_layers(model)} == theirs
    rates = sorted(layer.rate for layer in model.layers if isinstance(layer, DropPath))
    np.testing.assert_allclose(rates, np.repeat(np.linspace(0, 0.5, 6)[1:], 2))   # two branches a block
    optimizer = build_optimizer(validate({"optimizer": {"name": "adamw", "weight_decay": 0.05,
                                                        "decay_norm_and_bias": False}}).optimizer, 0.001)
    table = model.get_layer("layers_0_blocks_1_attn").relative_position_bias_table
    assert table.shape == (49, 2) and not optimizer._use_weight_decay(table)
    assert {w.path for w in model.trainable_weights if optimizer._use_weight_decay(w)} == {
        w.path for w in model.trainable_weights if w.name == "kernel"}


def test_trains_on_two_replicas_saves_and_runs_under_xla_and_bfloat16(tmp_path):
    """The small Swin: tests/support/model_checks.py's 2-replica AdamW step, .keras round trip, XLA and bfloat16."""
    trains_saves_and_compiles(lambda: swin_transformer((32, 32, 3), 5, 0.0, SMALL, "swin_fixture"), 32,
                              tmp_path / "swin.keras")


def test_an_image_size_the_windows_do_not_divide_is_one_line():
    for name, size, fit in (("swin_tiny_patch4_window7_224", 256, "224, 448, 672, 896"),
                            ("swin_base_patch4_window12_384", 224, "32, 96, 192, 384")):
        cfg = validate({"model": {"name": name}, "data": {"image_size": size}})
        with shapes_only(), pytest.raises(UserError) as error:
            build_model(cfg.model, cfg.data)
        assert str(error.value) == (
            f"model '{name}' attends within {SPECS[name].window}x{SPECS[name].window} windows of every stage's grid "
            f"(tfdp does not pad them as timm does): data.image_size must divide into them at every stage ({fit}, "
            f"…), got {size}")


def test_weights_of_another_architecture_are_one_line():
    """A ViT's timm file given to a Swin: its first tensor with no place in a Swin is named."""
    cfg = ModelConfig(name="swin_tiny_patch4_window7_224", num_classes=10)
    with pytest.raises(UserError) as error:
        torch_weights(load_file(os.path.join(FIXTURES, "vit_timm_mini.safetensors")), cfg, "vit.safetensors")
    text = str(error.value)
    assert "\n" not in text and text.startswith(
        "model.init_from: vit.safetensors does not fit model 'swin_tiny_patch4_window7_224': tensor ") and text.endswith(
        "has no place in it (another architecture?)"), text
