"""DINOv3: timm's parameter counts, timm's logits from its weights (RoPE, register tokens, layer scale, q/v biases,
average pooling) at the size it was saved at and at another, SwiGLU, Meta's own checkpoint layout and outputs, the
published key lists, and training, saving, XLA and bfloat16.

The fixture (tests/fixtures/dinov3_*, made by make_dinov3_fixture.py with real torch, timm and Meta's
facebookresearch/dinov3) holds two seeded random-init timm `Eva`s with the registry's DINOv3 switches and one Meta
`DinoVisionTransformer`, their outputs on 4 real photos, timm's parameter counts of the registry's DINOv3s and the
key and shape lists of two published models.
"""

import dataclasses
import json
import os

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO
from support.shapes import shapes_only
from tfdp.config import ModelConfig, validate
from tfdp.errors import UserError
from tfdp.models import MODELS
from tfdp.models.eva import SPECS, dinov3, rope_table
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
    with open(os.path.join(FIXTURES, "dinov3_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


def outputs() -> dict:
    return dict(np.load(os.path.join(FIXTURES, "dinov3_outputs.npz")))


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
    counts = facts()["parameter_counts"]
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
    model = dinov3((size, size, 3), 10, 0.0, small(cfg.model.name), "dinov3_fixture")
    loaded, new = load_into(model, read_source(TIMM, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    logits, theirs = model.predict(photos(size, cfg), verbose=0), outputs()[f"timm_{size}"]
    assert relative(logits, theirs) <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(theirs.argmax(1))


def test_swiglu_model_saved_headless_gives_timms_features_with_a_new_head():
    cfg = ModelConfig(name="vit_small_plus_patch16_dinov3", num_classes=10, init_from=PLUS)
    model = dinov3((16, 16, 3), 10, 0.0, small(cfg.name, mlp_ratio=3.1), "dinov3_fixture")
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
    model = dinov3((16, 16, 3), 10, 0.0, small(cfg.name, mlp_ratio=3.1), "dinov3_fixture")
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
    model = dinov3((16, 16, 3), 10, 0.0, small(cfg.name, mlp_ratio=3.1), "dinov3_fixture")
    loaded, new = load_into(model, torch_weights(zeroed, cfg, "meta"), cfg)
    assert new == ["head (the source has no classifier)"] and len(loaded) == len(layers_with_weights(model)) - 1


@pytest.mark.parametrize("name", ["vit_small_patch16_dinov3", "vit_small_plus_patch16_dinov3_qkvb"])
def test_published_state_dicts_map_onto_the_models(name):
    """timm's real key and shape lists (headless, as published) onto the full-size models (`shapes_only`)."""
    shapes = facts()["state_dicts"][name]
    tensors = {k: np.broadcast_to(np.float32(0), s) for k, s in shapes.items()}
    cfg = ModelConfig(name=name, num_classes=1000)
    with shapes_only():
        model = MODELS[name]((256, 256, 3), 1000)
        loaded, new = load_into(model, torch_weights(tensors, cfg, name), cfg)
    assert new == ["head (the source has no classifier)"] and len(loaded) == len(layers_with_weights(model)) - 1


def test_rope_table_is_dinov3s():
    """The angles of timm's RotaryEmbeddingDinoV3 written out for a 2x3 grid and head_dim 8 (2 periods per axis,
    100 ** 0 and 100 ** 0.5): rows' then columns' angles, tiled twice (the rotate-half layout)."""
    sin, cos = rope_table((2, 3), 8, 100.0)
    rows, cols = np.array([-0.5, 0.5]), np.array([-2 / 3, 0.0, 2 / 3])
    r, c = np.meshgrid(rows, cols, indexing="ij")
    angles = 2 * np.pi * np.stack([r.ravel(), r.ravel() / 10, c.ravel(), c.ravel() / 10], axis=1)
    np.testing.assert_allclose(sin, np.sin(np.tile(angles, 2)), atol=1e-6)
    np.testing.assert_allclose(cos, np.cos(np.tile(angles, 2)), atol=1e-6)


def test_trains_on_two_replicas_saves_and_runs_under_xla_and_bfloat16(tmp_path):
    """The small DINOv3 (q/v biases, SwiGLU) under tfdp's 2-replica strategy: an AdamW step (eager, as
    test_swin.py) moves every weight and stays finite; a .keras round trip gives the same outputs; XLA-compiled
    inference equals eager; mixed_bfloat16 stays close."""
    import tensorflow as tf
    from tfdp.distribute.strategy import make_runtime
    from tfdp.models import Standardize
    strategy = make_runtime(validate({"distribute": {"strategy": "mirrored", "cpu_replicas": 2}}).distribute).strategy
    name, spec = ("vit_small_plus_patch16_dinov3_qkvb", small("vit_small_plus_patch16_dinov3_qkvb"))

    def wrapped():
        inputs = keras.Input((16, 16, 3), dtype="uint8")
        logits = dinov3((16, 16, 3), 5, 0.0, spec, name)(Standardize((127.5,) * 3, (127.5,) * 3)(inputs))
        return keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(logits))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = wrapped()
        model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    images = np.random.default_rng(0).integers(0, 256, (8, 16, 16, 3), dtype=np.uint8)
    before = [w.numpy().copy() for w in model.trainable_weights]
    history = model.fit(images, np.arange(8) % 5, batch_size=8, epochs=1, verbose=0).history["loss"]
    assert np.all(np.isfinite(history))
    assert all(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights))
    eager = model.predict(images, verbose=0)
    model.save(tmp_path / "dinov3.keras")
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "dinov3.keras").predict(images, verbose=0), eager,
                               rtol=0, atol=1e-5)
    plain = wrapped()
    plain.set_weights(model.get_weights())
    xla = tf.function(lambda x: plain(x, training=False), jit_compile=True)(images).numpy()
    np.testing.assert_allclose(xla, eager, rtol=0, atol=1e-4)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        half = wrapped()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    assert relative(half.predict(images, verbose=0), eager) < 0.1


def test_weights_of_another_architecture_are_one_line():
    """A DINOv2 file given to a DINOv3: its first tensor with no place (its layer scale, named as timm's ViT names
    it) is named."""
    cfg = ModelConfig(name="vit_small_patch16_dinov3", num_classes=10)
    with pytest.raises(UserError) as error:
        torch_weights(load_file(os.path.join(FIXTURES, "dinov2_timm_mini.safetensors")), cfg, "dinov2.safetensors")
    assert str(error.value) == ("model.init_from: dinov2.safetensors does not fit model 'vit_small_patch16_dinov3': "
                                "tensor blocks.0.ls1.gamma (32,) has no place in it (another architecture?)")
