"""ViT and DeiT: timm's parameter counts, the logits of timm, torchvision and keras-hub from their weights, the
position embeddings resampled as timm does, fine-tuning at another resolution, and bad weights in one line.

The fixture (tests/fixtures/vit_*, made by make_vit_fixture.py with real torch, timm, torchvision and keras-hub)
holds seeded random-init models of `vit_mini_patch4_small`'s architecture in each framework's format, a distilled
ViT with layer scale, their logits on 4 real photos resized to 16 and 32 px, and the full-size models' state-dict
key and shape lists.
"""

import dataclasses
import json
import os
import shutil

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO
from support.shapes import shapes_only
from tfdp.config import ModelConfig, validate
from tfdp.errors import UserError
from tfdp.models import MODELS, build_model
from tfdp.models.vit import (SPECS, PositionEmbedding, ViTSpec, resample_abs_pos_embed, vision_transformer,
                             vit_state_dict)
from tfdp.models.weights import layers_with_weights, load_into, read_source, torch_weights

FIXTURES = os.path.join(REPO, "tests", "fixtures")
FILES = {"timm": os.path.join(FIXTURES, "vit_timm_mini.safetensors"),
         "torchvision": os.path.join(FIXTURES, "vit_torchvision_mini.safetensors"),
         "keras-hub": os.path.join(FIXTURES, "vit_kerashub_mini")}
DISTILLED = os.path.join(FIXTURES, "vit_timm_distilled.safetensors")
# float32 logits against the source framework's: max |ours - theirs| / max |theirs|
MAX_RELATIVE = 1e-5
# timm's parameter counts at 1,000 classes (timm 1.0.31, `sum(p.numel() for p in model.parameters())`, in
# vit_fixture.json); torchvision's vit_b_16, vit_b_32, vit_l_16 and vit_l_32 have the ViT-B/L counts exactly.
TIMM_COUNTS = {
    "vit_tiny_patch16_224": 5_717_416, "vit_small_patch16_224": 22_050_664, "vit_small_patch32_224": 22_878_952,
    "vit_base_patch16_224": 86_567_656, "vit_base_patch32_224": 88_224_232, "vit_large_patch16_224": 304_326_632,
    "vit_large_patch32_224": 306_535_400, "deit_tiny_patch16_224": 5_717_416, "deit_small_patch16_224": 22_050_664,
    "deit_base_patch16_224": 86_567_656, "deit_tiny_distilled_patch16_224": 5_910_800,
    "deit_small_distilled_patch16_224": 22_436_432, "deit_base_distilled_patch16_224": 87_338_192,
}


def relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    return dict(np.load(os.path.join(FIXTURES, "vit_photos.npz")))


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    return dict(np.load(os.path.join(FIXTURES, "vit_logits.npz")))


def test_parameter_counts_equal_timms_at_1000_classes():
    """Counted from the variables' shapes (`shapes_only`: nothing is allocated)."""
    with open(os.path.join(FIXTURES, "vit_fixture.json"), encoding="utf-8") as f:
        assert {k: v for k, v in json.load(f)["parameter_counts"].items() if k in TIMM_COUNTS} == TIMM_COUNTS
    for name, count in TIMM_COUNTS.items():
        with shapes_only():
            model = MODELS[name]((224, 224, 3), 1000)
            assert sum(int(np.prod(w.shape)) for w in model.weights) == count, name
            assert model.output_shape == (None, 1000)


@pytest.mark.parametrize("source", ["timm", "torchvision", "keras-hub"])
def test_weights_give_the_source_frameworks_logits(source, photos, expected):
    """Through the config as a run builds it: the weights' preprocessing (and, where they say it, their image size)
    resolved, the model built, the weights loaded, uint8 photos in."""
    data = {"hflip": False} | ({"image_size": 16} if source == "torchvision" else {})
    cfg = validate({"model": {"name": "vit_mini_patch4_small", "init_from": FILES[source]}, "data": data})
    assert cfg.data.image_size == 16
    model = build_model(cfg.model, cfg.data)
    loaded, new = load_into(model, read_source(FILES[source], cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    logits = model.predict(photos["16"], verbose=0)
    want = expected[{"timm": "timm_mini", "torchvision": "torchvision_mini", "keras-hub": "kerashub_mini"}[source]]
    assert relative(logits, want) <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(want.argmax(1))


def test_distilled_deit_with_layer_scale_gives_timms_logits(photos, expected):
    """The distillation token and its head (averaged with the class token's), and layer scale's gammas."""
    spec = ViTSpec(patch=4, dim=32, depth=2, heads=2, distilled=True, init_values=1e-5)
    model = vision_transformer((16, 16, 3), 10, 0.0, spec, "deit_fixture")
    cfg = ModelConfig(name="deit_tiny_distilled_patch16_224", num_classes=10)
    loaded, new = load_into(model, vit_state_dict(load_file(DISTILLED), cfg, DISTILLED), cfg)
    assert new == [] and {"cls_token", "head_dist", "blocks_1_2_ls"} <= set(loaded)
    mean, std = np.array([123.675, 116.28, 103.53]), np.array([58.395, 57.12, 57.375])
    logits = model.predict(((photos["16"] - mean) / std).astype("float32"), verbose=0)
    assert relative(logits, expected["timm_distilled"]) <= MAX_RELATIVE


@pytest.mark.parametrize("name,source", [("vit_base_patch16_224", "vit_base_patch16_224"),
                                         ("deit_small_patch16_224", "deit_small_patch16_224"),
                                         ("deit_base_distilled_patch16_224", "deit_base_distilled_patch16_224"),
                                         ("vit_base_patch16_224", "torchvision_vit_b_16")])
def test_full_size_state_dicts_map_onto_their_models(name, source):
    """timm's and torchvision's real keys and shapes (zeros for values), onto the full-size model built in a
    `shapes_only`: every tensor finds its layer, every layer its tensors."""
    with open(os.path.join(FIXTURES, "vit_state_dicts.json"), encoding="utf-8") as f:
        shapes = json.load(f)[source]
    tensors = {k: np.broadcast_to(np.float32(0), shape) for k, shape in shapes.items()}
    cfg = ModelConfig(name=name, num_classes=1000)
    with shapes_only():
        model = MODELS[name]((224, 224, 3), 1000)
        loaded, new = load_into(model, torch_weights(tensors, cfg, source), cfg)
    assert new == [] and len(loaded) == len(layers_with_weights(model))


def variants() -> dict:
    with open(os.path.join(FIXTURES, "vit_variants_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def outputs() -> dict[str, np.ndarray]:
    return dict(np.load(os.path.join(FIXTURES, "vit_variants_outputs.npz")))


@pytest.mark.full(reason="50 CPU-s of full-size builds: the counts' rule is "
                         "test_parameter_counts_equal_timms_at_1000_classes, each family's layers are its "
                         "weights' logits tests")
def test_dinov2_clip_siglip_deit3_and_gap_parameter_counts_equal_timms():
    """At 1,000 classes, DINOv2 at its published 518 px (a 37x37 grid), the CLIP towers at 224 px, the SigLIP
    towers, DeiT III and the average-pooling ViTs at the size in their names: layer scale, register tokens, CLIP's
    norm_pre and bias-free patch embedding, SigLIP's attention pooling and no class token, DeiT III's class token
    without a position embedding, fc_norm."""
    counts = variants()["parameter_counts"]
    assert sorted(counts) == sorted(n for n in MODELS if n.endswith("_dinov2") or "_clip" in n or "_siglip_" in n
                                    or n.startswith("deit3_") or "_gap_" in n)
    assert len(counts) == 23 + 8 + 21
    for name, found in counts.items():
        size = found["image_size"]
        with shapes_only():
            model = MODELS[name]((size, size, 3), 1000)
            assert sum(int(np.prod(w.shape)) for w in model.weights) == found["count"], name


def small(spec: ViTSpec) -> ViTSpec:
    """A registry architecture at the fixtures' size (4 px patches, 2 blocks of width 32, 2 heads), every other
    setting of it kept."""
    return dataclasses.replace(spec, patch=4, dim=32, depth=2, heads=2)


@pytest.mark.parametrize("size", [16, 32])
def test_dinov2_weights_without_a_classifier_give_timms_features(size, photos, outputs):
    """A timm DINOv2 with registers (small, random), saved without a classifier as the Hub's DINOv2 files are:
    every layer but the head loads, the head starts new and says so, and the class token after the final norm
    is timm's; at 32 px the patch-only position embeddings are resampled as timm's checkpoint_filter_fn does."""
    spec = small(SPECS["vit_small_patch14_reg4_dinov2"])
    model = vision_transformer((size, size, 3), 10, 0.0, spec, "dinov2_fixture")
    cfg = ModelConfig(name="vit_small_patch14_reg4_dinov2", num_classes=10)
    path = os.path.join(FIXTURES, "dinov2_timm_mini.safetensors")
    loaded, new = load_into(model, vit_state_dict(load_file(path), cfg, path), cfg)
    assert new == ["head (the source has no classifier)"]
    assert len(loaded) == len(layers_with_weights(model)) - 1 and {"cls_token", "blocks_1_2_ls"} <= set(loaded)
    assert model.get_layer("cls_token").reg_token.shape == (1, 4, 32)
    mean, std = np.array([123.675, 116.28, 103.53]), np.array([58.395, 57.12, 57.375])
    features = keras.Model(model.input, model.get_layer("head_token").output)
    ours = features.predict(((photos[str(size)] - mean) / std).astype("float32"), verbose=0)
    assert relative(ours, outputs[f"dinov2_{size}"]) <= MAX_RELATIVE


def test_clip_tower_weights_give_timms_logits(photos, outputs):
    """A timm CLIP tower (small, random; QuickGELU, norm_pre, epsilon 1e-5, no patch-embedding bias; its tokens'
    variance below the epsilon, so a wrong one shows) through the config: OpenAI CLIP's mean and std, crop 0.95
    and the image size from its pretrained cfg, then timm's logits."""
    path = os.path.join(FIXTURES, "clip_timm_mini.safetensors")
    cfg = validate({"model": {"name": "vit_base_patch16_clip_quickgelu_224", "num_classes": 10, "init_from": path},
                    "data": {"hflip": False}})
    assert (cfg.data.image_size, cfg.data.eval_crop_fraction) == (16, 0.95)
    np.testing.assert_allclose(cfg.data.mean, np.array([0.48145466, 0.4578275, 0.40821073]) * 255, rtol=1e-6)
    model = vision_transformer((16, 16, 3), 10, 0.0, small(SPECS["vit_base_patch16_clip_quickgelu_224"]), "clip")
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and "norm_pre" in loaded and len(model.get_layer("patch_embed").weights) == 1
    x = ((photos["16"] - np.array(cfg.data.mean)) / np.array(cfg.data.std)).astype("float32")
    logits = model.predict(x, verbose=0)
    assert relative(logits, outputs["clip_16"]) <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(outputs["clip_16"].argmax(1))


def test_siglip_tower_weights_give_timms_logits(photos, outputs):
    """A timm SigLIP tower (small, random; no class token, attention pooling with a learned latent query) through
    the config: mean and std 0.5 and the image size from its pretrained cfg, then timm's logits."""
    path = os.path.join(FIXTURES, "siglip_timm_mini.safetensors")
    cfg = validate({"model": {"name": "vit_base_patch16_siglip_224", "num_classes": 10, "init_from": path},
                    "data": {"hflip": False}})
    assert (cfg.data.image_size, cfg.data.mean) == (16, (127.5,) * 3)
    model = vision_transformer((16, 16, 3), 10, 0.0, small(SPECS["vit_base_patch16_siglip_224"]), "siglip")
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and {"attn_pool", "attn_pool_kv", "attn_pool_mlp_fc2"} <= set(loaded)
    assert len(loaded) == len(layers_with_weights(model))
    x = ((photos["16"] - np.array(cfg.data.mean)) / np.array(cfg.data.std)).astype("float32")
    logits = model.predict(x, verbose=0)
    assert relative(logits, outputs["siglip_16"]) <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(outputs["siglip_16"].argmax(1))


def test_deit3_weights_give_timms_logits(photos, outputs):
    """A timm DeiT III (small, random; layer scale, its class token without a position embedding) through the
    config: ImageNet's mean and std and the image size from its pretrained cfg, then timm's logits."""
    path = os.path.join(FIXTURES, "deit3_timm_mini.safetensors")
    cfg = validate({"model": {"name": "deit3_base_patch16_224", "num_classes": 10, "init_from": path},
                    "data": {"hflip": False}})
    assert cfg.data.image_size == 16
    model = vision_transformer((16, 16, 3), 10, 0.0, small(SPECS["deit3_base_patch16_224"]), "deit3")
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and {"pos_embed", "blocks_1_2_ls"} <= set(loaded)
    assert len(loaded) == len(layers_with_weights(model))
    x = ((photos["16"] - np.array(cfg.data.mean)) / np.array(cfg.data.std)).astype("float32")
    logits = model.predict(x, verbose=0)
    assert relative(logits, outputs["deit3_16"]) <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(outputs["deit3_16"].argmax(1))


@pytest.mark.parametrize("family,name", [("gap", "vit_betwixt_patch16_reg4_gap_256"),
                                         ("siglip_gap", "vit_large_patch16_siglip_gap_512")])
def test_average_pooling_weights_give_timms_logits(family, name, photos, outputs):
    """timm's average-pooling ViTs (small, random): registers without a class token and fc_norm after the patch
    tokens' mean; a SigLIP tower averaging after its final norm, with GELU's tanh approximation. Through the config,
    every layer loaded, then timm's logits."""
    path = os.path.join(FIXTURES, f"{family}_timm_mini.safetensors")
    cfg = validate({"model": {"name": name, "num_classes": 10, "init_from": path}, "data": {"hflip": False}})
    assert cfg.data.image_size == 16
    model = vision_transformer((16, 16, 3), 10, 0.0, small(SPECS[name]), family)
    loaded, new = load_into(model, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    assert ({"reg_token", "fc_norm"} if family == "gap" else {"norm"}) <= set(loaded)
    x = ((photos["16"] - np.array(cfg.data.mean)) / np.array(cfg.data.std)).astype("float32")
    logits = model.predict(x, verbose=0)
    assert relative(logits, outputs[f"{family}_16"]) <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(outputs[f"{family}_16"].argmax(1))


@pytest.mark.parametrize("name,size", [("vit_base_patch14_dinov2", 518), ("vit_small_patch14_reg4_dinov2", 224),
                                       ("vit_base_patch16_clip_224", 224), ("vit_base_patch16_siglip_224", 384),
                                       ("deit3_base_patch16_224", 384), ("vit_betwixt_patch16_reg4_gap_256", 256),
                                       ("vit_base_patch16_siglip_gap_224", 224)])
def test_published_state_dicts_map_onto_their_models(name, size):
    """timm's real keys and shapes (DINOv2's and SigLIP's towers without a classifier; CLIP's ImageNet fine-tunes,
    DeiT III and the average-pooling ViTs with 1,000 classes), onto the full-size model in a `shapes_only`; DINOv2
    also at 224 px, as fine-tuning usually runs (the 37x37 grid resampled to 16x16), SigLIP's 224 px tower and
    DeiT III at 384 (14x14 to 24x24)."""
    tensors = {k: np.broadcast_to(np.float32(0), s) for k, s in variants()["state_dicts"][name].items()}
    cfg = ModelConfig(name=name, num_classes=1000)
    with shapes_only():
        model = MODELS[name]((size, size, 3), 1000)
        loaded, new = load_into(model, torch_weights(tensors, cfg, name), cfg)
    headless = "head.weight" not in tensors
    assert new == (["head (the source has no classifier)"] if headless else [])
    assert len(loaded) == len(layers_with_weights(model)) - headless


def test_position_embeddings_resample_as_timms(expected):
    """The fixture's 4x4 grid to 8x8: timm's resample_abs_pos_embed (bicubic, antialias) against the numpy one,
    and the layer's load hook, which keeps the class token's embedding."""
    pos_embed = load_file(FILES["timm"])["pos_embed"]
    ours = resample_abs_pos_embed(pos_embed, (8, 8), prefix_tokens=1)
    assert relative(ours, expected["timm_resampled_pos_embed"]) <= 1e-6
    layer = PositionEmbedding((8, 8), 1, name="pos_embed")
    layer.build((None, 65, 64))
    (fitted,), note = layer.adapt_loaded([pos_embed])
    np.testing.assert_array_equal(fitted, ours)
    np.testing.assert_array_equal(fitted[:, 0], pos_embed[:, 0])
    assert note == "pos_embed resampled from a 4x4 to a 8x8 grid (bicubic, antialiased, as timm's resample_abs_pos_embed)"
    (kept,), note = layer.adapt_loaded([pos_embed[:, :-1]])   # not a square grid: left as is (and does not fit)
    assert kept.shape == (1, 16, 64) and note is None


def test_fine_tuning_at_twice_the_weights_resolution(photos, expected, capsys):
    """16 px timm weights into a 32 px model through the task, as a fresh run starts: the first forward pass is
    timm's own model at 32 px with the resampled embeddings, then AdamW with layer decay brings the loss down."""
    from tfdp.train.task import ClassificationTask, Plan
    cfg = validate({"model": {"name": "vit_mini_patch4_small", "init_from": FILES["timm"], "drop_path": 0.1},
                    "data": {"image_size": 32, "hflip": False},
                    "optimizer": {"name": "adamw", "lr": 0.3, "weight_decay": 0.05, "layer_decay": 0.75,
                                  "decay_norm_and_bias": False},
                    "schedule": {"name": "constant"}, "train": {"epochs": 1}})
    task = ClassificationTask(cfg)
    model = task.build_model("train", Plan(4, 8, 32, 0, 10))
    task.initialize(model, resumed=False)
    out = capsys.readouterr().out
    assert "tfdp: init_from: pos_embed resampled from a 4x4 to a 8x8 grid" in out
    # 0.75 ** 5: six groups (the embeddings, 4 blocks, the final norm with the last of them, the head)
    assert "tfdp: fine-tuning: per-layer learning rates (layer_decay 0.75): x0.237 to x1 of the schedule" in out
    assert relative(model.predict(photos["32"], verbose=0), expected["timm_mini_32"]) <= MAX_RELATIVE
    labels = np.arange(4) % 10
    history = model.fit(photos["32"], labels, batch_size=4, epochs=6, verbose=0).history["loss"]
    assert history[-1] < 0.5 * history[0], history


def test_layer_groups_freezing_and_weight_decay_follow_timm():
    """timm's group_matcher(coarse=False): patch_embed/cls_token/pos_embed 0, block i i+1, norm with the last block,
    head last; `backbone` leaves the head, `blocks_0` exactly block 0; norms, biases, tokens and position
    embeddings undecayed with decay_norm_and_bias false; drop path rising linearly to model.drop_path."""
    from tfdp.models.resnet import DropPath
    from tfdp.optim.finetune import frozen_layers, layer_ids, weight_layers
    from tfdp.optim.optimizers import build_optimizer
    model = MODELS["vit_mini_patch4_small"]((16, 16, 3), 10, drop_path_rate=0.3)
    ids, count = layer_ids(model, "vit_mini_patch4_small")
    by_layer = {layer.name: ids[id(layer.trainable_weights[0])] for layer in weight_layers(model)}
    assert count == 6 and by_layer["patch_embed"] == by_layer["cls_token"] == by_layer["pos_embed"] == 0
    assert [by_layer[f"blocks_{i}_attn_qkv"] for i in range(4)] == [1, 2, 3, 4]
    assert (by_layer["norm"], by_layer["head"]) == (4, 5)
    assert [layer.name for layer in weight_layers(model)
            if layer not in frozen_layers(model, "vit_mini_patch4_small", ("backbone",))] == ["head"]
    assert {layer.name for layer in frozen_layers(model, "vit_mini_patch4_small", ("blocks_0",))} == {
        "blocks_0_norm1", "blocks_0_attn_qkv", "blocks_0_attn_proj", "blocks_0_norm2", "blocks_0_mlp_fc1",
        "blocks_0_mlp_fc2"}
    rates = sorted({layer.rate for layer in model.layers if isinstance(layer, DropPath)})
    np.testing.assert_allclose(rates, [0.1, 0.2, 0.3])   # block 0's rate is 0: no layer
    cfg = validate({"optimizer": {"name": "adamw", "weight_decay": 0.05, "decay_norm_and_bias": False}})
    optimizer = build_optimizer(cfg.optimizer, 0.001)
    decayed = {w.path for w in model.trainable_weights if optimizer._use_weight_decay(w)}
    assert decayed == {w.path for w in model.trainable_weights if w.name == "kernel"}
    assert {"pos_embed/pos_embed", "cls_token/cls_token"} <= {w.path for w in model.trainable_weights} - decayed
    # DINOv2's register tokens: with the class token in the first group, and undecayed (timm's no_weight_decay)
    spec = ViTSpec(patch=4, dim=32, depth=2, heads=2, init_values=1e-5, reg_tokens=4, no_embed_class=True)
    dinov2 = vision_transformer((16, 16, 3), 10, 0.0, spec, "dinov2_fixture")
    ids, count = layer_ids(dinov2, "vit_small_patch14_reg4_dinov2")
    reg_token = dinov2.get_layer("cls_token").reg_token
    assert ids[id(reg_token)] == 0 and count == 4 and not optimizer._use_weight_decay(reg_token)


def timm_parameter_layer(param: str, class_token: bool) -> str:
    """tfdp's layer of a timm ViT parameter: the module's (`timm_layer`), the tokens' and position embeddings' own,
    the register tokens in the class token's layer where there is one."""
    from tfdp.models.vit import timm_layer
    module = param.rpartition(".")[0]
    if not module:
        return "cls_token" if param == "reg_token" and class_token else param
    return timm_layer(module)


@pytest.mark.parametrize("family,name", [("dinov2", "vit_small_patch14_reg4_dinov2"),
                                         ("clip", "vit_base_patch16_clip_quickgelu_224"),
                                         ("siglip", "vit_base_patch16_siglip_224"),
                                         ("deit3", "deit3_base_patch16_224"),
                                         ("gap", "vit_betwixt_patch16_reg4_gap_256"),
                                         ("siglip_gap", "vit_large_patch16_siglip_gap_512")])
def test_layer_decay_groups_are_timms(family, name):
    """`optimizer.layer_decay`'s layer ids for the small DINOv2, CLIP, SigLIP, DeiT III and average-pooling ViTs are
    those timm's `param_groups_layer_decay` gives each of their parameters (recorded by the fixture): the final norm
    with the last block, CLIP's norm_pre and the register tokens with the embeddings, SigLIP's attention pool and
    fc_norm with the head. (timm's DINOv2 file has no classifier: tfdp's model adds its head as one group more.)"""
    from tfdp.optim.finetune import layer_ids
    timm_ids = variants()["layer_ids"][family]
    theirs: dict[str, set[int]] = {}
    for param, layer_id in timm_ids.items():
        theirs.setdefault(timm_parameter_layer(param, "cls_token" in timm_ids), set()).add(layer_id)
    model = vision_transformer((16, 16, 3), 10, 0.0, small(SPECS[name]), family)
    ids, count = layer_ids(model, name)
    ours = {layer.name: {ids[id(w)] for w in layer.trainable_weights} for layer in layers_with_weights(model)}
    headless = "head.weight" not in timm_ids
    assert {k: v for k, v in ours.items() if k in theirs} == theirs
    assert set(ours) - set(theirs) == ({"head"} if headless else set())
    assert count == max(timm_ids.values()) + 1 + headless


def wrapped(spec: ViTSpec) -> keras.Model:
    """A 32 px ViT of `spec` (5 classes) wrapped as `build_model` wraps the registry's: uint8 in, float32 out."""
    from tfdp.models import Standardize
    inputs = keras.Input((32, 32, 3), dtype="uint8")
    logits = vision_transformer((32, 32, 3), 5, 0.0, spec, "deit_fixture")(
        Standardize((127.5,) * 3, (127.5,) * 3)(inputs))
    return keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(logits))


@pytest.mark.parametrize("spec", [ViTSpec(patch=16, dim=192, depth=2, heads=3, distilled=True),
                                  ViTSpec(patch=16, dim=192, depth=2, heads=3, init_values=0.1, reg_tokens=4,
                                          no_embed_class=True),
                                  ViTSpec(patch=16, dim=192, depth=2, heads=3, pre_norm=True, norm_eps=1e-5,
                                          act="quick_gelu"),
                                  ViTSpec(patch=16, dim=192, depth=2, heads=3, class_token=False, pool="map"),
                                  ViTSpec(patch=16, dim=192, depth=2, heads=3, init_values=0.1, reg_tokens=4,
                                          no_embed_class=True, class_token=False, pool="avg", fc_norm=True,
                                          act="gelu_tanh")],
                         ids=["distilled", "dinov2_registers", "clip", "siglip", "gap"])
def test_builds_in_a_strategy_scope_saves_and_runs_under_xla_and_bfloat16(spec, tmp_path):
    """Two replicas' mirrored variables, a .keras round trip with the same outputs, XLA-compiled inference on
    the CPU equal to eager, and mixed_bfloat16 close to float32 (attention in bfloat16). At DeiT-Tiny's width,
    2 blocks deep: the distilled architecture (two heads, two prefix tokens), DINOv2's (layer scale, four
    register tokens, position embeddings for the patches only), a CLIP tower's (norm_pre, QuickGELU), a SigLIP
    tower's (no class token, attention pooling) and an average-pooling one's (registers without a class token,
    the patches' mean, fc_norm, GELU's tanh approximation)."""
    import tensorflow as tf
    from tfdp.distribute.strategy import make_runtime
    strategy = make_runtime(validate({"distribute": {"strategy": "mirrored", "cpu_replicas": 2}}).distribute).strategy
    with strategy.scope():
        model = wrapped(spec)
    assert len(strategy.experimental_local_results(model.weights[0].value)) == 2
    images = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    eager = model.predict(images, verbose=0)
    model.save(tmp_path / "vit.keras")
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "vit.keras").predict(images, verbose=0), eager,
                               rtol=0, atol=1e-5)
    plain = wrapped(spec)
    plain.set_weights(model.get_weights())
    xla = tf.function(lambda x: plain(x, training=False), jit_compile=True)(images).numpy()
    np.testing.assert_allclose(xla, eager, rtol=0, atol=1e-4)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        half = wrapped(spec)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    assert half.get_layer("deit_fixture_backbone").get_layer("blocks_0_attn").compute_dtype == "bfloat16"
    assert relative(half.predict(images, verbose=0), eager) < 0.1


# ---------------------------------------------------------------- bad input: one line each


def one_line(error: pytest.ExceptionInfo, *fragments: str) -> str:
    text = str(error.value)
    assert "\n" not in text and all(f in text for f in fragments), text
    return text


def test_another_architecture_or_patch_size_is_one_line():
    cfg = validate({"model": {"name": "vit_tiny_patch16_224", "init_from": FILES["timm"]}, "data": {"image_size": 32}})
    with pytest.raises(UserError) as error:
        load_into(build_model(cfg.model, cfg.data), read_source(FILES["timm"], cfg.model, cfg.data), cfg.model)
    one_line(error, "does not fit model 'vit_tiny_patch16_224'", "patch_embed/kernel is (4, 4, 3, 64) there",
             "the model's is (16, 16, 3, 192)")
    resnet = os.path.join(FIXTURES, "squeezenet1_1.safetensors")
    with pytest.raises(UserError) as error:
        torch_weights(load_file(resnet), cfg.model, resnet)
    one_line(error, "squeezenet1_1.safetensors does not fit model 'vit_tiny_patch16_224': tensor ",
             "has no place in it (another architecture?)")
    with open(os.path.join(FIXTURES, "vit_state_dicts.json"), encoding="utf-8") as f:
        shapes = json.load(f)["deit_small_patch16_224"]   # patch 16 into a patch-32 ViT-S
    patch32 = ModelConfig(name="vit_small_patch32_224", num_classes=1000)
    with shapes_only(), pytest.raises(UserError) as error:
        load_into(MODELS["vit_small_patch32_224"]((64, 64, 3), 1000),
                  torch_weights({k: np.broadcast_to(np.float32(0), s) for k, s in shapes.items()}, patch32, "deit_s"),
                  patch32)
    one_line(error, "patch_embed/kernel is (16, 16, 3, 384) there", "the model's is (32, 32, 3, 384)")


def test_an_image_size_the_patch_does_not_divide_is_one_line():
    cfg = validate({"model": {"name": "vit_mini_patch4_small"}, "data": {"image_size": 18}})
    with pytest.raises(UserError) as error:
        build_model(cfg.model, cfg.data)
    assert one_line(error) == ("model 'vit_mini_patch4_small' cuts the image into 4x4 patches: data.image_size must "
                               "be a multiple of 4, got 18")


def test_keras_hub_presets_without_weights_or_task_or_local_copy_are_one_line(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(FILES["keras-hub"], "config.json"), bare)
    cfg = validate({"model": {"name": "vit_mini_patch4_small", "init_from": str(bare)}, "data": {"image_size": 16}})
    with pytest.raises(UserError) as error:
        read_source(str(bare), cfg.model, cfg.data)
    one_line(error, f"keras-hub preset {bare} has no weights (no model.weights.h5")
    # A backbone alone loads, the classifier starting new (and says why), with or without init_exclude
    shutil.copy(os.path.join(FILES["keras-hub"], "model.weights.h5"), bare)
    loaded, new = load_into(build_model(cfg.model, cfg.data), read_source(str(bare), cfg.model, cfg.data), cfg.model)
    assert new == ["head (the source has no classifier)"] and len(loaded) == 4 * 6 + 4
    cfg = validate({"model": {"name": "vit_mini_patch4_small", "init_from": str(bare), "init_exclude": ["head"]},
                    "data": {"image_size": 16}})
    loaded, new = load_into(build_model(cfg.model, cfg.data), read_source(str(bare), cfg.model, cfg.data), cfg.model)
    assert new == ["head (init_exclude)"] and len(loaded) == 4 * 6 + 4
    # Handles reach the readers only as the local files `tfdp train` fetched (tests/rundir/test_hub.py)
    for handle, said in (("kaggle://keras/vit/keras/vit_base_patch16_224_imagenet/4", "is a keras-hub preset handle "
                          "on Kaggle, which tfdp does not fetch from"),
                         ("hf://google/vit", "the weights' readers take a local path"),
                         ("hf-hub:timm/vit_small_patch16_224.augreg_in21k", "the weights' readers take a local path")):
        with pytest.raises(UserError) as error:
            read_source(handle, cfg.model, cfg.data)
        one_line(error, f"{handle}", said)
