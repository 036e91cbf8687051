"""ConvNeXt: timm's and torchvision's weights give their logits; full-size state dicts map; counts; the training
controls (drop path, layer scale, dropout, head, layer groups, weight decay, any image size) reach Keras' layers.

The fixture (tests/fixtures/convnext_*, made by make_convnext_fixture.py with real torch, timm and torchvision)
holds a small timm ConvNeXt (conv_mlp, as atto..nano) saved by timm's own `save_for_hf`, a small torchvision
ConvNeXt, every parameter drawn at random, their logits on the 4 photos at 224 px, the full-size convnext_tiny
state-dict keys and shapes of both libraries, and their parameter counts.
"""

import json
import os

import keras
import numpy as np
import pytest

from conftest import REPO
from test_models import TIMM, TORCHVISION
from tfdp.config import DistributeConfig, OptimizerConfig, pretrained, validate
from tfdp.errors import UserError
from tfdp.models import MODELS, build_model
from tfdp.models.convnext import SPECS, ConvNeXtSpec, GELUResponseNorm, LayerScale, convnext
from tfdp.models.registry import DROP_PATH
from tfdp.models.resnet import DropPath
from tfdp.models.weights import layers_with_weights, load_into, read_source, torch_weights
from tfdp.optim.finetune import frozen_layers, layer_ids
from tfdp.optim.optimizers import build_optimizer

FIXTURES = os.path.join(REPO, "tests", "fixtures")
FILES = {"timm": os.path.join(FIXTURES, "convnext_timm", "model.safetensors"),
         "torchvision": os.path.join(FIXTURES, "convnext_torchvision.safetensors")}
# float32 logits against the source's: max |ours - theirs| / max |theirs|
MAX_RELATIVE = 1e-5
MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)


@pytest.fixture(scope="module")
def fixture() -> dict:
    with open(os.path.join(FIXTURES, "convnext_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


def convnext_parameters(spec: ConvNeXtSpec, classes: int) -> int:
    """ConvNeXt's parameter count from its depths and widths: the 4x4 stem and its LayerNorm; per block the 7x7
    depthwise convolution, LayerNorm, the 4x MLP and the layer scale (8d^2 + 58d), or in V2 the GRN's scale and
    shift over the 4d channels instead of the layer scale (8d^2 + 65d); per downsampling a LayerNorm and a 2x2
    convolution; the head's LayerNorm and Dense layer."""
    dims = spec.dims
    stem = 48 * dims[0] + dims[0] + 2 * dims[0]
    per_block = 65 if spec.grn else 58
    blocks = sum(depth * (8 * d * d + per_block * d) for depth, d in zip(spec.depths, dims))
    downsampling = sum(2 * a + 4 * a * b + b for a, b in zip(dims, dims[1:]))
    return stem + blocks + downsampling + 2 * dims[-1] + dims[-1] * classes + classes


def test_counts_are_timms_and_torchvisions(fixture):
    """Every variant's depths and widths give timm's count at 1,000 classes (measured in the side venv; timm's
    tiny..large equal torchvision's), the numbers test_models.py holds; atto is built here, tiny in the
    full-size mapping test below (test_models builds the other sizes only where it must, see there)."""
    counts = fixture["counts"]
    assert {name: convnext_parameters(spec, 1000) for name, spec in SPECS.items() if not spec.grn} == counts["timm"]
    assert {name: counts["timm"][name] for name in counts["torchvision"]} == counts["torchvision"]
    assert {name: TIMM.get(name, TORCHVISION.get(name)) for name in SPECS if not SPECS[name].grn} == counts["timm"]
    model = MODELS["convnext_atto"]((32, 32, 3), 1000)
    assert model.count_params() == sum(int(np.prod(w.shape)) for w in model.trainable_weights) == 3_695_520


@pytest.mark.parametrize("source", ["timm", "torchvision"])
def test_weights_give_the_sources_logits(source, fixture):
    """The small fixture model (its own depths and widths, Keras' ConvNeXt builder) loads every tensor and gives
    the source library's logits on the 4 photos."""
    small = fixture["small"]
    cfg = validate({"model": {"name": "convnext_atto", "num_classes": small["num_classes"],
                              "init_from": FILES[source]}, "data": {"image_size": 224}})
    model = convnext((224, 224, 3), small["num_classes"], 0.0,
                     ConvNeXtSpec("convnext_atto", tuple(small["depths"]), tuple(small["dims"])))
    loaded, new = load_into(model, read_source(FILES[source], cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    photos = np.load(os.path.join(FIXTURES, "photos.npy"))
    logits = model.predict((photos.astype(np.float32) / 255 - MEAN) / STD, verbose=0)
    expected = np.load(os.path.join(FIXTURES, "convnext_logits.npz"))[source]
    assert np.abs(logits - expected).max() / np.abs(expected).max() <= MAX_RELATIVE
    assert list(logits.argmax(1)) == list(expected.argmax(1))


def test_timm_files_bring_their_pretrained_cfg():
    """The config.json timm's save_for_hf wrote beside the file: convnext_tiny.fb_in1k's ImageNet mean/std,
    crop 0.875 and bicubic; the torchvision file (nothing beside it) takes torchvision's ImageNet normalisation."""
    cfg = validate({"model": {"name": "convnext_atto", "init_from": FILES["timm"]}})
    found = pretrained.from_weights(cfg.model)
    assert found.what == "model.safetensors (its timm pretrained cfg)"
    np.testing.assert_allclose(found.mean, 255 * MEAN, rtol=1e-6)
    np.testing.assert_allclose(found.std, 255 * STD, rtol=1e-6)
    assert (found.eval_crop_fraction, found.interpolation) == (0.875, "bicubic")
    assert cfg.data.eval_crop_fraction == 0.875
    torchvision = validate({"model": {"name": "convnext_tiny", "init_from": FILES["torchvision"]}})
    assert "torchvision's ImageNet normalisation" in pretrained.from_weights(torchvision.model).what


def test_full_size_state_dicts_map_onto_convnext_tiny(fixture):
    """timm's and torchvision's convnext_tiny keys and shapes, zeros for values: every tensor finds its layer
    with the shape it needs, and every layer its tensors."""
    cfg = validate({"model": {"name": "convnext_tiny", "num_classes": 1000}, "data": {"image_size": 32}})
    model = build_model(cfg.model, cfg.data)
    assert model.count_params() == fixture["counts"]["timm"]["convnext_tiny"]
    for source, shapes in fixture["state_dicts"].items():
        tensors = {k: np.zeros(shape, np.float16) for k, shape in shapes.items()}
        loaded, new = load_into(model, torch_weights(tensors, cfg.model, source), cfg.model)
        assert new == [] and len(loaded) == len(layers_with_weights(model)), source


def test_another_architecture_is_one_line(fixture):
    cfg = validate({"model": {"name": "convnext_atto"}, "data": {"image_size": 32}})
    with open(os.path.join(FIXTURES, "torchvision_state_dicts.json"), encoding="utf-8") as f:
        resnet34 = {k: np.zeros(shape, np.float16) for k, shape in json.load(f)["resnet34"].items()}
    with pytest.raises(UserError) as error:
        torch_weights(resnet34, cfg.model, "resnet34.safetensors")
    assert str(error.value) == ("model.init_from: resnet34.safetensors does not fit model 'convnext_atto': tensor "
                                "conv1.weight (64, 3, 7, 7) has no place in it (another architecture?)")
    tiny = {k: np.zeros(shape, np.float16) for k, shape in fixture["state_dicts"]["timm"].items()}
    model = build_model(cfg.model, cfg.data)
    with pytest.raises(UserError) as error:
        load_into(model, torch_weights(tiny, cfg.model, "convnext_tiny.safetensors"), cfg.model)
    assert str(error.value) == ("model.init_from: convnext_tiny.safetensors does not fit model 'convnext_atto': "
                                "convnext_atto_stem_conv/kernel is (4, 4, 3, 96) there (stem.0.weight), the model's "
                                "is (4, 4, 3, 40)")


def test_drop_path_layer_scale_dropout_head_and_groups():
    """timm's schedule and controls on Keras' layers: drop path rising linearly over the 12 blocks of atto (none
    on the first), layer scale 1e-6 named gamma, dropout before the head's Dense layer (the only head layer),
    and timm's 14 layer groups (stem, one per block, a stage's downsampling with its first block, the head)."""
    assert "convnext_atto" in DROP_PATH
    model = MODELS["convnext_atto"]((32, 32, 3), 10, dropout=0.3, drop_path_rate=0.2)
    rates = [layer.rate for layer in model.layers if isinstance(layer, DropPath)]
    np.testing.assert_allclose(rates, [0.2 * i / 11 for i in range(1, 12)])
    scales = [layer for layer in model.layers if isinstance(layer, LayerScale)]
    assert len(scales) == 12 and {w.name for s in scales for w in s.weights} == {"gamma"}
    assert all(np.all(keras.ops.convert_to_numpy(s.gamma) == np.float32(1e-6)) for s in scales)
    assert [(layer.name, getattr(layer, "rate", None)) for layer in model.layers[-3:]] == [
        ("convnext_atto_head_layernorm", None), ("convnext_atto_head_dropout", 0.3), ("convnext_atto_head_dense", None)]
    unfrozen = {layer.name for layer in layers_with_weights(model)} - {
        layer.name for layer in frozen_layers(model, "convnext_atto", ("backbone",))}
    assert unfrozen == {"convnext_atto_head_dense"}
    ids, groups = layer_ids(model, "convnext_atto")
    assert groups == 14
    v2 = MODELS["convnextv2_atto"]((32, 32, 3), 10)
    assert layer_ids(v2, "convnextv2_atto")[1] == 14 and "convnextv2_atto" in DROP_PATH
    layer_id = {layer.name.removeprefix("convnext_atto_"): ids[id(layer.trainable_weights[0])]
                for layer in layers_with_weights(model)}
    assert (layer_id["stem_conv"], layer_id["stage_0_block_1_depthwise_conv"]) == (0, 2)
    assert layer_id["downsampling_conv_0"] == layer_id["stage_1_block_0_layer_scale"] == 3
    assert layer_id["head_layernorm"] == layer_id["head_dense"] == 13


@pytest.mark.parametrize("grn", [False, True])
def test_norms_layer_scale_and_biases_are_not_decayed_on_request(grn):
    """AdamW with decay_norm_and_bias false, one step of zero gradients: only the decay moves a variable, and it
    moves the kernels alone (not LayerNorm's gamma/beta, the layer scale or V2's GRN, the biases)."""
    model = convnext((32, 32, 3), 5, 0.0, ConvNeXtSpec("convnext_atto", (1, 1, 1, 1), (8, 8, 8, 8), grn=grn))
    if grn:   # away from zero, so the decay would move them
        for layer in model.layers:
            if isinstance(layer, GELUResponseNorm):
                layer.gamma.assign(np.ones(layer.dim, np.float32))
                layer.beta.assign(np.ones(layer.dim, np.float32))
    optimizer = build_optimizer(OptimizerConfig(name="adamw", weight_decay=0.5, decay_norm_and_bias=False), 0.1)
    variables = model.trainable_variables
    before = [keras.ops.convert_to_numpy(v).copy() for v in variables]
    optimizer.apply([keras.ops.zeros_like(v) for v in variables], variables)
    moved = {v.path.removeprefix("convnext_atto_") for v, b in zip(variables, before)
             if not np.array_equal(keras.ops.convert_to_numpy(v), b)}
    kernels = {v.path.removeprefix("convnext_atto_") for v in variables if v.name == "kernel"}
    assert moved == kernels and "stage_0_block_0_pointwise_conv_1/kernel" in kernels


def test_a_saved_model_loads_back(tmp_path):
    """A `.keras` file (what `tfdp export` writes) rebuilds tfdp's layers, ConvNeXt's layer scale among them."""
    model = convnext((32, 32, 3), 5, 0.1, ConvNeXtSpec("convnext_atto", (1, 1, 1, 1), (8, 8, 8, 8)), 0.2)
    for layer in model.layers:
        if isinstance(layer, LayerScale):
            layer.gamma.assign(np.full(layer.dim, 0.5, np.float32))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert sum(isinstance(layer, LayerScale) for layer in loaded.layers) == 4
    images = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(images)), keras.ops.convert_to_numpy(model(images)))


def test_takes_any_image_size():
    """A separate evaluation size: the backbone takes 64 and 96 px alike."""
    cfg = validate({"model": {"name": "convnext_atto", "num_classes": 3},
                    "data": {"image_size": 64, "eval_image_size": 96}})
    model = build_model(cfg.model, cfg.data)
    assert model.input_shape == (None, None, None, 3)
    for size in (64, 96):
        assert tuple(model(np.zeros((2, size, size, 3), np.uint8)).shape) == (2, 3)


def test_drop_path_runs_traced_on_two_replicas():
    """The forward pass in training, traced, on each replica of a 2-replica MirroredStrategy, drops residual
    branches per sample (Keras' own StochasticDepth cannot run there: its global seed generator's variable is
    created inside the traced function)."""
    import tensorflow as tf
    from tfdp.distribute.strategy import make_runtime
    strategy = make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy
    with strategy.scope():
        model = convnext((32, 32, 3), 5, 0.0, ConvNeXtSpec("convnext_atto", (1, 1, 1, 1), (8, 8, 8, 8)), 0.5)
    assert [layer.rate for layer in model.layers if isinstance(layer, DropPath)] == [0.5 / 3, 0.5 * 2 / 3, 0.5]
    for layer in model.layers:
        if isinstance(layer, LayerScale):
            layer.gamma.assign(np.ones(layer.dim, np.float32))  # branches that count, so a dropped one shows
    images = tf.constant(np.random.default_rng(0).normal(size=(16, 32, 32, 3)).astype(np.float32))
    train = tf.function(lambda x: strategy.run(lambda y: model(y, training=True), args=(x,)))
    steps = [[t.numpy() for t in strategy.experimental_local_results(train(images))] for _ in range(2)]
    inference = keras.ops.convert_to_numpy(model(images, training=False))
    assert [len(replicas) for replicas in steps] == [2, 2]
    assert all(np.isfinite(r).all() and not np.allclose(r, inference) for replicas in steps for r in replicas)
    assert not np.allclose(steps[0][0], steps[1][0])  # new masks each step


# ---------------------------------------------------------------- ConvNeXt V2

V2_FILE = os.path.join(FIXTURES, "convnextv2_timm", "model.safetensors")


@pytest.fixture(scope="module")
def v2_fixture() -> dict:
    """tests/fixtures/convnextv2_* (make_convnextv2_fixture.py, real torch and timm): a small timm ConvNeXt V2
    (conv_mlp, as atto..nano; every parameter drawn, the GRN's scales away from their zero start) saved by timm's
    `save_for_hf`, its logits on the 4 photos, the full-size convnextv2_tiny's keys and shapes, timm's counts."""
    with open(os.path.join(FIXTURES, "convnextv2_fixture.json"), encoding="utf-8") as f:
        return json.load(f)


def test_v2_counts_are_timms(v2_fixture):
    """Every V2's depths and widths give timm's count at 1,000 classes (atto..huge); atto is built."""
    v2 = {name: spec for name, spec in SPECS.items() if spec.grn}
    assert {name: convnext_parameters(spec, 1000) for name, spec in v2.items()} == v2_fixture["counts"]
    assert {name: TIMM[name] for name in v2} == v2_fixture["counts"]
    assert MODELS["convnextv2_atto"]((32, 32, 3), 1000).count_params() == v2_fixture["counts"]["convnextv2_atto"]


def test_v2_weights_give_timms_logits_and_bring_their_preprocessing(v2_fixture, tmp_path):
    """The small V2 loads every tensor (GRN's scale and shift among them) and gives timm's logits on the photos;
    config.json's pretrained cfg (convnextv2_tiny.fcmae_ft_in22k_in1k: ImageNet's mean and std, bicubic) reaches
    the data config; a `.keras` file of it (what `tfdp export` writes) loads back to the same logits; under
    mixed_bfloat16 (GRN's norms in float32) it stays within bfloat16's rounding of them."""
    small = v2_fixture["small"]
    cfg = validate({"model": {"name": "convnextv2_atto", "num_classes": small["num_classes"], "init_from": V2_FILE},
                    "data": {"image_size": 224}})
    found = pretrained.from_weights(cfg.model)
    np.testing.assert_allclose(found.mean, 255 * MEAN, rtol=1e-6)
    np.testing.assert_allclose(found.std, 255 * STD, rtol=1e-6)
    assert (found.eval_crop_fraction, found.interpolation) == (small["timm_crop_pct"], "bicubic")
    spec = ConvNeXtSpec("convnextv2_atto", tuple(small["depths"]), tuple(small["dims"]), grn=True)
    model = convnext((224, 224, 3), small["num_classes"], 0.0, spec)
    assert not any(isinstance(layer, LayerScale) for layer in model.layers)
    grns = [layer for layer in model.layers if isinstance(layer, GELUResponseNorm)]
    assert [g.name for g in grns][:2] == ["convnextv2_atto_stage_0_block_0_grn", "convnextv2_atto_stage_1_block_0_grn"]
    loaded, new = load_into(model, read_source(V2_FILE, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    assert all(np.abs(keras.ops.convert_to_numpy(g.gamma)).max() > 0.1 for g in grns)
    photos = (np.load(os.path.join(FIXTURES, "photos.npy")).astype(np.float32) / 255 - MEAN) / STD
    logits = model.predict(photos, verbose=0)
    expected = np.load(os.path.join(FIXTURES, "convnextv2_logits.npz"))["timm"]
    assert np.abs(logits - expected).max() / np.abs(expected).max() <= MAX_RELATIVE
    model.save(tmp_path / "v2.keras")
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "v2.keras").predict(photos, verbose=0), logits,
                               rtol=1e-6, atol=1e-6)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        half = convnext((224, 224, 3), small["num_classes"], 0.0, spec)
        half.set_weights(model.get_weights())
        low = keras.ops.convert_to_numpy(half(photos)).astype(np.float32)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert np.abs(low - expected).max() / np.abs(expected).max() < 0.05


def test_v2_full_size_state_dict_maps_and_v1_weights_do_not_fit(v2_fixture, fixture):
    """timm's convnextv2_tiny keys and shapes, zeros for values: every tensor finds its layer and every layer its
    tensors. A V1 file in a V2 model, and a V2 file in a V1 model, are one line naming what the file lacks (the
    GRN, the layer scale)."""
    cfg = validate({"model": {"name": "convnextv2_tiny", "num_classes": 1000}, "data": {"image_size": 32}})
    model = build_model(cfg.model, cfg.data)
    assert model.count_params() == v2_fixture["counts"]["convnextv2_tiny"]
    tensors = {k: np.zeros(shape, np.float16) for k, shape in v2_fixture["state_dict_tiny"].items()}
    loaded, new = load_into(model, torch_weights(tensors, cfg.model, "timm"), cfg.model)
    assert new == [] and len(loaded) == len(layers_with_weights(model))
    v1 = {k: np.zeros(shape, np.float16) for k, shape in fixture["state_dicts"]["timm"].items()}
    with pytest.raises(UserError, match=r"^model.init_from: convnext_tiny.safetensors does not fit model "
                                        r"'convnextv2_tiny': it has nothing for convnextv2_tiny_stage_0_block_0_grn/"
                                        r"gamma \(384,\) \(another architecture\?\)$"):
        load_into(model, torch_weights(v1, cfg.model, "convnext_tiny.safetensors"), cfg.model)
    v1_cfg = validate({"model": {"name": "convnext_tiny", "num_classes": 1000}, "data": {"image_size": 32}})
    with pytest.raises(UserError, match=r"^model.init_from: convnextv2_tiny.safetensors does not fit model "
                                        r"'convnext_tiny': it has nothing for convnext_tiny_stage_0_block_0_"
                                        r"layer_scale/gamma \(96,\) \(another architecture\?\)$"):
        load_into(build_model(v1_cfg.model, v1_cfg.data),
                  torch_weights(tensors, v1_cfg.model, "convnextv2_tiny.safetensors"), v1_cfg.model)


def test_v2_grn_of_a_channel_zero_everywhere_has_a_finite_gradient():
    """A channel that is zero at every position (on a 1x1 map, one value), where the square root of its sum of
    squares has an infinite derivative: gradients stay finite (0 for that norm, as PyTorch's), in float32 and in
    bfloat16. A V2 trained with that NaN in bfloat16 under XLA went to a NaN validation loss at its second step."""
    import tensorflow as tf
    for dtype in ("float32", "bfloat16"):
        layer = GELUResponseNorm(4, dtype=keras.DTypePolicy(f"mixed_{dtype}" if dtype == "bfloat16" else dtype))
        layer.build((None, 1, 1, 4))
        layer.gamma.assign(np.ones(4, np.float32))
        x = tf.constant(np.array([[[[0.0, 1.5, -0.5, 2.0]]], [[[0.0, 0.0, 0.0, 0.0]]]], np.float32))
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = tf.cast(layer(x), tf.float32)
            loss = tf.reduce_sum(out * out)
        grads = tape.gradient(loss, [x, layer.gamma, layer.beta])
        assert all(np.isfinite(g.numpy()).all() for g in grads), dtype
        assert np.isfinite(out.numpy()).all() and np.all(out.numpy()[1] == 0), dtype
