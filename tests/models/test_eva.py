"""DINOv3 and EVA-02: timm's parameter counts, timm's logits from its weights (RoPE of both kinds, register tokens,
layer scale, q/v biases, SwiGLU packed and split, learned position embeddings, average pooling and fc_norm) at the
size they were saved at and at another, Meta's own DINOv3 checkpoint layout and outputs, the published key lists,
and training, saving, XLA and bfloat16.

The fixture (tests/fixtures/dinov3_*, eva02_*, eva_*, made by make_eva_fixture.py with real torch, timm and Meta's
facebookresearch/dinov3) holds four seeded random-init timm `Eva`s with the registry's switches and one Meta
`DinoVisionTransformer`, their outputs on 4 real photos, timm's parameter counts of the registry's models and the
key and shape lists of four published models.
"""

import dataclasses
import json
import os
import re
import tempfile

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO
from support.model_checks import trains_saves_and_compiles
from support.shapes import shapes_only
from tfdp.config import ModelConfig, validate
from tfdp.errors import UserError
from tfdp.models import MODELS
from tfdp.models.eva import SPECS, dinov3_angles, eva, eva02_angles
from tfdp.models.weights import layers_with_weights, load_into, read_source, torch_weights

FIXTURES = os.path.join(REPO, "tests", "fixtures")
TIMM = os.path.join(FIXTURES, "dinov3_timm_mini.safetensors")
PLUS = os.path.join(FIXTURES, "dinov3_plus_timm_mini.safetensors")
META = os.path.join(FIXTURES, "dinov3_meta_mini.safetensors")
MAX_RELATIVE = 1e-5   # float32: max |ours - theirs| / max |theirs|


def small(name: str, **changes) -> dataclasses.dataclass:
    """The registry's spec of `name` at the fixture's size (4 px patches, 2 blocks of width 32, 2 heads)."""
    return dataclasses.replace(SPECS[name], patch=4, dim=32, depth=2, heads=2, **changes)


def facts() -> dict:
    with open(os.path.join(FIXTURES, "eva_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


def outputs() -> dict:
    return dict(np.load(os.path.join(FIXTURES, "eva_outputs.npz")))


def photos(size: int, cfg) -> np.ndarray:
    x = np.load(os.path.join(FIXTURES, "vit_photos.npz"))[str(size)]
    return ((x - np.array(cfg.data.mean)) / np.array(cfg.data.std)).astype("float32")


def relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def features(model: keras.Model, x: np.ndarray) -> np.ndarray:
    """The pooled features (what the classifier reads)."""
    return keras.Model(model.input, model.get_layer("pool").output).predict(x, verbose=0)


def test_parameter_counts_equal_timms_at_1000_classes():
    """Built for each size and for small's `_qkvb`; the other `_qkvb` specs are their size's with the one flag
    whose parameters (a q and a v bias per block) that pair counts, as timm's counts differ."""
    counts = {n: c for n, c in facts()["parameter_counts"].items() if "dinov3" in n}
    assert sorted(counts) == sorted(n for n in MODELS if "dinov3" in n) and len(counts) == 10
    for name, count in counts.items():
        plain = name.removesuffix("_qkvb")
        if name != plain and name != "vit_small_patch16_dinov3_qkvb":
            assert SPECS[name] == dataclasses.replace(SPECS[plain], qkv_bias=True), name
            assert count - counts[plain] == 2 * SPECS[name].dim * SPECS[name].depth, name
            continue
        with shapes_only():
            model = MODELS[name]((256, 256, 3), 1000)
            assert sum(int(np.prod(w.shape)) for w in model.weights) == count, name


@pytest.mark.parametrize("size", [16, 32])
def test_timm_weights_give_timms_logits_at_any_grid(size):
    """Through the config as a run resolves it (mean, std and size from the file's pretrained cfg), every layer
    loaded, photos in: timm's logits, top-1 equal; at 32 px the same weights on an 8x8 grid, which RoPE reads
    without resampling (timm's dynamic size)."""
    cfg = validate({"model": {"name": "vit_small_patch16_dinov3_qkvb", "num_classes": 10, "init_from": TIMM},
                    "data": {"hflip": False}})
    assert cfg.data.image_size == 16 and cfg.data.mean == pytest.approx([123.675, 116.28, 103.53])
    model = eva((size, size, 3), 10, 0.0, small(cfg.model.name), "dinov3_fixture")
    loaded, new = load_into(model, read_source(TIMM, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    logits, theirs = model.predict(photos(size, cfg), verbose=0), outputs()[f"dinov3_{size}"]
    assert relative(logits, theirs) <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(theirs.argmax(1))


def test_swiglu_model_saved_headless_gives_timms_features_with_a_new_head():
    cfg = ModelConfig(name="vit_small_plus_patch16_dinov3", num_classes=10, init_from=PLUS)
    model = eva((16, 16, 3), 10, 0.0, small(cfg.name, mlp_ratio=3.1), "dinov3_fixture")
    assert model.get_layer("blocks_0_mlp_fc1_g").units == 104   # int(32 * 3.1) = 99, rounded up to 8, as timm
    loaded, new = load_into(model, torch_weights(load_file(PLUS), cfg, "plus"), cfg)
    assert new == ["head (the source has no classifier)"] and len(loaded) == len(layers_with_weights(model)) - 1
    x = photos(16, validate({}))   # ImageNet's mean and std, the default
    assert relative(features(model, x), outputs()["plus_16"]) <= MAX_RELATIVE


def test_metas_checkpoint_layout_loads_and_gives_metas_features():
    """Meta's own names (storage tokens, ls1.gamma, w1/w2/w3, the fused qkv bias with its key third masked, the
    RoPE periods and mask token it holds) read as timm's filter reads them: Meta's mean patch token."""
    tensors = load_file(META)
    assert "storage_tokens" in tensors and "rope_embed.periods" in tensors and "mask_token" in tensors
    cfg = ModelConfig(name="vit_small_plus_patch16_dinov3_qkvb", num_classes=10)
    model = eva((16, 16, 3), 10, 0.0, small(cfg.name, mlp_ratio=3.1), "dinov3_fixture")
    weights = torch_weights(tensors, cfg, "meta")
    assert weights.what == "meta (Meta's layout)"
    loaded, new = load_into(model, weights, cfg)
    assert new == ["head (the source has no classifier)"] and len(loaded) == len(layers_with_weights(model)) - 1
    assert relative(features(model, photos(16, validate({}))), outputs()["meta_16"]) <= MAX_RELATIVE


def test_a_model_without_qkv_bias_refuses_a_checkpoints_non_zero_bias_and_takes_a_zero_one():
    tensors = load_file(META)
    cfg = ModelConfig(name="vit_small_plus_patch16_dinov3", num_classes=10)
    with pytest.raises(UserError) as error:
        torch_weights(tensors, cfg, "meta.safetensors")
    assert str(error.value) == (
        "model.init_from: meta.safetensors has non-zero query/value biases (blocks.0.attn.qkv.bias), which model "
        "'vit_small_plus_patch16_dinov3' has no place for: use 'vit_small_plus_patch16_dinov3_qkvb'")
    zeroed = {k: np.zeros_like(v) if k.endswith("qkv.bias") else v for k, v in tensors.items()}
    model = eva((16, 16, 3), 10, 0.0, small(cfg.name, mlp_ratio=3.1), "dinov3_fixture")
    loaded, new = load_into(model, torch_weights(zeroed, cfg, "meta"), cfg)
    assert new == ["head (the source has no classifier)"] and len(loaded) == len(layers_with_weights(model)) - 1


@pytest.mark.parametrize("name, size", [("vit_small_patch16_dinov3", 256), ("vit_small_plus_patch16_dinov3_qkvb", 256),
                                        ("eva02_tiny_patch14_224", 224), ("eva02_base_patch14_448", 448)])
def test_published_state_dicts_map_onto_the_models(name, size):
    """timm's real key and shape lists (as published: headless, or EVA-02-B's ImageNet fine-tune with its 1,000-class
    head; timm's unfused q/k/v and packed SwiGLU among them) onto the full-size models (`shapes_only`)."""
    shapes = facts()["state_dicts"][name]
    tensors = {k: np.broadcast_to(np.float32(0), s) for k, s in shapes.items()}
    cfg = ModelConfig(name=name, num_classes=1000)
    with shapes_only():
        model = MODELS[name]((size, size, 3), 1000)
        loaded, new = load_into(model, torch_weights(tensors, cfg, name), cfg)
    headless = "head.weight" not in shapes
    assert new == (["head (the source has no classifier)"] if headless else [])
    assert len(loaded) == len(layers_with_weights(model)) - headless


def test_rope_table_is_dinov3s():
    """The angles of timm's RotaryEmbeddingDinoV3 written out for a 2x3 grid and head_dim 8 (2 periods per axis,
    100 ** 0 and 100 ** 0.5): rows' then columns' angles, tiled twice (the rotate-half layout)."""
    found = dinov3_angles((2, 3), 8, 100.0, None)
    rows, cols = np.array([-0.5, 0.5]), np.array([-2 / 3, 0.0, 2 / 3])
    r, c = np.meshgrid(rows, cols, indexing="ij")
    angles = 2 * np.pi * np.stack([r.ravel(), r.ravel() / 10, c.ravel(), c.ravel() / 10], axis=1)
    np.testing.assert_allclose(found, np.tile(angles, 2), rtol=1e-12)


def test_trains_on_two_replicas_saves_and_runs_under_xla_and_bfloat16(tmp_path):
    """The small DINOv3 (q/v biases, SwiGLU): tests/support/model_checks.py's 2-replica AdamW step, .keras round
    trip, XLA and bfloat16."""
    name, spec = ("vit_small_plus_patch16_dinov3_qkvb", small("vit_small_plus_patch16_dinov3_qkvb"))
    trains_saves_and_compiles(lambda: eva((16, 16, 3), 5, 0.0, spec, name), 16, tmp_path / "dinov3.keras")


def test_weights_of_another_architecture_are_one_line():
    """A DINOv2 file given to a DINOv3: its first tensor with no place (its layer scale, named as timm's ViT names
    it) is named."""
    cfg = ModelConfig(name="vit_small_patch16_dinov3", num_classes=10)
    with pytest.raises(UserError) as error:
        torch_weights(load_file(os.path.join(FIXTURES, "dinov2_timm_mini.safetensors")), cfg, "dinov2.safetensors")
    assert str(error.value) == ("model.init_from: dinov2.safetensors does not fit model 'vit_small_patch16_dinov3': "
                                "tensor blocks.0.ls1.gamma (32,) has no place in it (another architecture?)")


# ---------------------------------------------------------------- EVA-02


def test_eva02_parameter_counts_equal_timms_at_1000_classes():
    """Built at each width's 224 px and at tiny's and small's 336; base's and large's 448 px models differ from their
    224 px ones by the position embeddings alone, as timm's counts do."""
    counts = {n: c for n, c in facts()["parameter_counts"].items() if n.startswith("eva02")}
    assert sorted(counts) == sorted(n for n in MODELS if n.startswith("eva02")) and len(counts) == 8
    for name, count in counts.items():
        size = int(name.rsplit("_", 1)[1])
        if size == 448:
            twin = name.replace("448", "224")
            assert SPECS[name] == SPECS[twin]
            assert count - counts[twin] == (32 ** 2 - 16 ** 2) * SPECS[name].dim, name
            continue
        with shapes_only():
            model = MODELS[name]((size, size, 3), 1000)
            assert sum(int(np.prod(w.shape)) for w in model.weights) == count, name


@pytest.mark.parametrize("width, size", [("small", 16), ("base", 16), ("base", 32)])
def test_eva02_timm_weights_give_timms_logits(width, size):
    """The packed SwiGLU and fused qkv (small), the unfused q/k/v and SwiGLU with its LayerNorm (base), through the
    config; at 32 px the position embeddings resampled on load as timm's checkpoint_filter_fn resamples them and
    RoPE for the 8x8 grid, against a timm model built at 32 px."""
    path = os.path.join(FIXTURES, f"eva02_{width}_timm_mini.safetensors")
    cfg = validate({"model": {"name": f"eva02_{width}_patch14_224", "num_classes": 10, "init_from": path},
                    "data": {"hflip": False, "image_size": size}})
    model = eva((size, size, 3), 10, 0.0, small(cfg.model.name), "eva02_fixture")
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    logits, theirs = model.predict(photos(size, cfg), verbose=0), outputs()[f"eva02_{width}_{size}"]
    assert relative(logits, theirs) <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(theirs.argmax(1))


@pytest.mark.parametrize("family,name,path", [
    ("dinov3", "vit_small_patch16_dinov3_qkvb", TIMM),
    ("eva02_small", "eva02_small_patch14_224", os.path.join(FIXTURES, "eva02_small_timm_mini.safetensors"))])
def test_layer_decay_groups_are_timms(family, name, path):
    """`optimizer.layer_decay`'s layer ids for the small DINOv3 and EVA-02 are those timm's `param_groups_layer_decay`
    gives each parameter (recorded by the fixture), matched through the reader's own names: DINOv3's register
    tokens with the embeddings and its final norm with the last block, EVA-02's fc_norm with the head."""
    from support.timm_checks import tfdp_groups, timm_groups
    timm_ids = facts()["layer_ids"][family]
    weights = torch_weights(load_file(path), ModelConfig(name=name, num_classes=10), path)
    ours, count = tfdp_groups(eva((16, 16, 3), 10, 0.0, small(name), family), name)
    # EVA-02-S's packed SwiGLU fc1 is split into fc1_g and fc1_x on reading
    assert ours == timm_groups(weights.names, timm_ids, lambda p: (p, re.sub(r"\.fc1_[gx]\.", ".fc1.", p)))
    assert count == max(timm_ids.values()) + 1


def test_eva02_rope_is_timms_rotary_embedding_cat():
    """timm's RotaryEmbeddingCat (`in_pixels=False`, `ref_feat_shape=(16, 16)`) written out for a 2x4 grid and
    head_dim 8 (2 frequencies per axis, 1 and 1/100): indices scaled to the reference grid, rows' then columns',
    each repeated (the interleaved layout)."""
    found = eva02_angles((2, 4), 8, 10000.0, (16, 16))
    r, c = np.meshgrid(np.array([0.0, 8.0]), np.array([0.0, 4.0, 8.0, 12.0]), indexing="ij")
    angles = np.stack([r.ravel(), r.ravel() / 100, c.ravel(), c.ravel() / 100], axis=1)
    np.testing.assert_allclose(found, np.repeat(angles, 2, axis=1), rtol=1e-12)


def test_eva02_saves_and_runs_under_xla():
    """Its layers (the interleaved rotation, the position embeddings, fc_norm) through a .keras round trip and XLA."""
    import tensorflow as tf
    model = eva((16, 16, 3), 5, 0.0, small("eva02_base_patch14_224"), "eva02_fixture")
    x = np.random.default_rng(0).normal(size=(4, 16, 16, 3)).astype("float32")
    eager = model.predict(x, verbose=0)
    with tempfile.TemporaryDirectory() as folder:
        model.save(os.path.join(folder, "eva02.keras"))
        again = keras.models.load_model(os.path.join(folder, "eva02.keras")).predict(x, verbose=0)
    np.testing.assert_allclose(again, eager, rtol=0, atol=1e-5)
    xla = tf.function(lambda t: model(t, training=False), jit_compile=True)(x).numpy()
    np.testing.assert_allclose(xla, eager, rtol=0, atol=1e-4)
