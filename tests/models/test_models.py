"""The model zoo: parameter counts against the reference implementations, and a real 2-replica step for each
builder (here, or in the test that already trains its representative on 2 replicas: TRAINED_ON_TWO_REPLICAS_IN)."""

import os

import numpy as np
import pytest

from tfdp.config import validate
from tfdp.errors import UserError
from tfdp.models import MIN_INPUT_SIZE, MODELS, build_model

# torchvision's counts (its parameters: conv/linear weights and biases, batch-norm scale and shift),
# compared with our trainable weights, for the architectures written here.
TORCHVISION = {
    "resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50_v1_5": 25_557_032, "resnext50_32x4d": 25_028_904,
    "vgg11": 132_863_336, "vgg11_bn": 132_868_840, "vgg13": 133_047_848, "vgg13_bn": 133_053_736,
    "vgg16": 138_357_544, "vgg16_bn": 138_365_992, "vgg19": 143_667_240, "vgg19_bn": 143_678_248,
    "squeezenet1_1": 1_235_496,
    "convnext_tiny": 28_589_128, "convnext_small": 50_223_688, "convnext_base": 88_591_464,
    "convnext_large": 197_767_336,
}
# timm's counts (its parameters), compared with our trainable weights, for models torchvision does not have.
TIMM = {
    "resnet18d": 11_708_744, "resnet34d": 21_816_904, "resnet50d": 25_576_264, "resnet101d": 44_568_392,
    "resnet152d": 60_212_040,
    "convnext_atto": 3_695_520, "convnext_femto": 5_217_784, "convnext_pico": 9_045_672, "convnext_nano": 15_593_560,
    "convnextv2_atto": 3_708_400, "convnextv2_femto": 5_233_240, "convnextv2_pico": 9_066_280,
    "convnextv2_nano": 15_623_800, "convnextv2_tiny": 28_635_496, "convnextv2_small": 50_318_440,
    "convnextv2_base": 88_717_800, "convnextv2_large": 197_956_840, "convnextv2_huge": 660_289_640,
}
# keras.applications' published totals (all weights, batch-norm statistics included).
KERAS_APPLICATIONS = {
    "resnet50": 25_636_712, "resnet101": 44_707_176, "resnet152": 60_419_944, "inception_v3": 23_851_784,
    "mobilenet_v2": 3_538_984, "mobilenet_v3_large": 5_507_432, "mobilenet_v3_small": 2_554_968,
    "efficientnetv2_b0": 7_200_312, "efficientnetv2_b1": 8_212_124, "efficientnetv2_b2": 10_178_374,
    "efficientnetv2_b3": 14_467_622, "efficientnetv2_s": 21_612_360, "efficientnetv2_m": 54_431_388,
    "efficientnetv2_l": 119_027_848,
    "efficientnet_b0": 5_330_571, "efficientnet_b1": 7_856_239, "efficientnet_b2": 9_177_569,
    "efficientnet_b3": 12_320_535, "efficientnet_b4": 19_466_823, "efficientnet_b5": 30_562_527,
    "efficientnet_b6": 43_265_143, "efficientnet_b7": 66_658_687,
}
# timm's own EfficientNets and MobileNetV3s: keras.applications' graph padded as PyTorch pads (the same layers and
# weights; the MobileNetV3s' trainable counts are timm's and torchvision's: tests/models/test_mobilenetv3.py)
KERAS_APPLICATIONS.update({f"efficientnet_b{v}_torch": KERAS_APPLICATIONS[f"efficientnet_b{v}"] for v in range(8)})
KERAS_APPLICATIONS.update({f"mobilenet_v3_{s}_torch": KERAS_APPLICATIONS[f"mobilenet_v3_{s}"]
                           for s in ("large", "small")})
KERAS_APPLICATIONS.update({f"efficientnetv2_{s}_torch": KERAS_APPLICATIONS[f"efficientnetv2_{s}"] for s in "sml"})
# Weights of keras.applications' built-in preprocessing that tfdp leaves out (it normalises on the device): EfficientNet
# (V1)'s Normalization layer, its mean and variance per channel and its count.
LEFT_OUT = {f"efficientnet_b{v}{torch}": 3 + 3 + 1 for v in range(8) for torch in ("", "_torch")}
SMALL_IMAGE = {"resnet18_small", "resnet10_small", "simple_cnn",  # for 16-32 px inputs: no ImageNet reference
               "resnet18_d2l",   # its count: the book's PyTorch network's, tests/models/test_d2l.py
               "deit_mini_distilled_patch4_small"}   # the distillation tests' student (tests/train/test_distillation.py)
# Not built for their count here: test_convnext.py checks every ConvNeXt's count from its depths and widths, and
# builds one of each table (convnext_atto, convnext_tiny, convnextv2_atto, convnextv2_tiny); test_resnet_d.py counts
# every ResNet-D against timm's.
COUNTED_FROM_SPEC = {f"convnext_{s}" for s in ("femto", "pico", "nano", "small", "base", "large")} | {
    f"convnextv2_{s}" for s in ("femto", "pico", "nano", "small", "base", "large", "huge")} | {
    f"resnet{d}d" for d in (18, 34, 50, 101, 152)}
# Built for their count at the smallest and largest size only: the others are the same rebuild (`torch_padded`) of
# graphs counted here
COUNTED_AT_THE_ENDS_ONLY = {f"efficientnet_b{v}_torch" for v in range(1, 7)} | {"efficientnetv2_m_torch"}
# timm's counts checked in tests/models/test_vit.py from the variables' shapes, without allocating ViT-L's 300M
# (and vit_mini_patch4_small, for 16-32 px inputs)
VIT = {*(f"vit_{s}_patch{p}_224" for s in ("small", "base", "large") for p in (16, 32)), "vit_tiny_patch16_224",
       *(f"deit_{s}_{d}patch16_224" for s in ("tiny", "small", "base") for d in ("", "distilled_")),
       *(f"vit_{s}_patch14_{r}dinov2" for s in ("small", "base", "large") for r in ("", "reg4_")),
       *(f"vit_{s}_clip{a}_224" for s in ("base_patch32", "base_patch16", "large_patch14", "huge_patch14")
         for a in ("", "_quickgelu")),
       *(f"vit_base_patch16_siglip_{px}" for px in (224, 256, 384, 512)),
       *(f"vit_large_patch16_siglip_{px}" for px in (256, 384, 512)),
       *(f"vit_so400m_patch14_siglip_{px}" for px in (224, 378)),
       *(f"deit3_{s}_patch16_{px}" for s in ("small", "base", "large") for px in (224, 384)),
       "deit3_medium_patch16_224", "deit3_huge_patch14_224",
       *(f"vit_base_patch16_siglip_gap_{px}" for px in (224, 256, 384, 512)),
       *(f"vit_large_patch16_siglip_gap_{px}" for px in (256, 384, 512)),
       *(f"vit_so400m_patch14_siglip_gap_{px}" for px in (224, 378, 448)),
       *(f"vit_{n}_gap_256" for n in ("wee_patch16_reg1", "little_patch16_reg1", "little_patch16_reg4",
                                      "medium_patch16_reg1", "medium_patch16_reg4", "mediumd_patch16_reg4",
                                      "betwixt_patch16_reg1", "betwixt_patch16_reg4", "base_patch16_reg4")),
       "vit_mediumd_patch16_reg4_gap_384", "vit_betwixt_patch16_reg4_gap_384",
       "vit_mini_patch4_small"}


# timm's counts checked in tests/models/test_regnet.py, from the variables' shapes
REGNET = {f"regnet{v}_{size}" for v in "xy" for size in ("002", "004", "006", "008", "016", "032", "040", "064",
                                                         "080", "120", "160", "320")}
# timm's counts checked in tests/models/test_swin.py, from the variables' shapes
SWIN = {f"swin_{s}_patch4_window{w}" for s in ("tiny", "small", "base", "large") for w in ("7_224",)} | {
    f"swin_{s}_patch4_window12_384" for s in ("base", "large")}
# timm's counts checked in tests/models/test_eva.py, from the variables' shapes
EVA = {f"vit_{s}_patch16_dinov3{b}" for s in ("small", "small_plus", "base", "large", "huge_plus")
       for b in ("", "_qkvb")} | {f"eva02_{s}_patch14_{px}" for s, sizes in (
           ("tiny", (224, 336)), ("small", (224, 336)), ("base", (224, 448)), ("large", (224, 448))) for px in sizes}


def test_every_registered_model_has_a_reference_count():
    assert set(MODELS) == (set(TORCHVISION) | set(TIMM) | set(KERAS_APPLICATIONS) | SMALL_IMAGE | VIT | SWIN | EVA
                           | REGNET)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted((set(TORCHVISION) | set(TIMM) | set(KERAS_APPLICATIONS)) - COUNTED_FROM_SPEC
                                         - COUNTED_AT_THE_ENDS_ONLY))
def test_parameter_count_at_1000_classes_and_224_px(name):
    """Counted from the variables' shapes (`shapes_only`, as test_vit.py counts ViTs: the model is built, its variables
    made with their shapes, and nothing allocates or initialises VGG's 133M values)."""
    import keras
    from support.shapes import shapes_only
    with shapes_only():
        model = MODELS[name]((224, 224, 3), 1000)
        trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
        if name in TORCHVISION or name in TIMM:
            assert trainable == {**TORCHVISION, **TIMM}[name]
        else:
            assert model.count_params() == KERAS_APPLICATIONS[name] - LEFT_OUT.get(name, 0)
        assert model.output_shape == (None, 1000)
    keras.backend.clear_session()


@pytest.fixture(scope="module")
def strategy():
    """tfdp's own 2-replica strategy, as training builds it."""
    from tfdp.config import DistributeConfig
    from tfdp.distribute.strategy import make_runtime
    return make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy


# One model per builder: the other sizes of a family run the same code with other depths and widths, which
# the parameter counts above check one by one.
ONE_PER_BUILDER = {
    "resnet18": "resnet18", "resnet34": "resnet18", "resnet50_v1_5": "resnet50_v1_5",
    # the same builder and bottlenecks with grouped 3x3 convolutions (their outputs: tests/models/test_weights.py's
    # torchvision fixture); grouped convolutions train on 2 replicas in regnety_002's step (tests/models/test_regnet.py)
    "resnext50_32x4d": "resnet50_v1_5", "resnet18_small": "resnet18_small", "resnet10_small": "resnet18_small",
    "resnet18_d2l": "resnet18_d2l", "deit_mini_distilled_patch4_small": "vit_mini_patch4_small",
    # the same blocks with a deeper stem and pooled shortcuts (their outputs: tests/models/test_resnet_d.py)
    "resnet18d": "resnet18", "resnet34d": "resnet18", "resnet50d": "resnet50_v1_5", "resnet101d": "resnet50_v1_5",
    "resnet152d": "resnet50_v1_5",
    "resnet50": "resnet50", "resnet101": "resnet50", "resnet152": "resnet50", "inception_v3": "inception_v3",
    "mobilenet_v2": "mobilenet_v2", "mobilenet_v3_large": "mobilenet_v3_large",
    "mobilenet_v3_small": "mobilenet_v3_large",
    # the same layers with other paddings and epsilons (their outputs: tests/models/test_mobilenetv3.py)
    "mobilenet_v3_large_torch": "mobilenet_v3_large", "mobilenet_v3_small_torch": "mobilenet_v3_large",
    **{f"efficientnetv2_{s}": "efficientnetv2_b0" for s in ("b0", "b1", "b2", "b3", "s", "m", "l")},
    **{f"efficientnet_b{v}": "efficientnet_b0" for v in range(8)},
    # the same layers with other paddings and epsilons (their outputs: tests/models/test_efficientnet.py)
    **{f"efficientnet_b{v}_torch": "efficientnet_b0" for v in range(8)},
    **{f"efficientnetv2_{s}_torch": "efficientnetv2_b0" for s in "sml"},
    # one builder (`vgg`), with and without batch norm: the step with it takes every layer of the one without
    **{f"vgg{d}{bn}": "vgg11_bn" for d in (11, 13, 16, 19) for bn in ("", "_bn")},
    "squeezenet1_1": "squeezenet1_1", "simple_cnn": "simple_cnn",
    **{f"convnext_{s}": "convnext_atto"
       for s in ("atto", "femto", "pico", "nano", "tiny", "small", "base", "large")},
    **{f"convnextv2_{s}": "convnextv2_atto"
       for s in ("atto", "femto", "pico", "nano", "tiny", "small", "base", "large", "huge")},
    **dict.fromkeys(VIT, "vit_mini_patch4_small"),
    **dict.fromkeys(REGNET, "regnety_002"),   # squeeze-excite and grouped convolutions; RegNetX without the former
    **dict.fromkeys(SWIN, "swin_tiny_patch4_window7_224"),
    **dict.fromkeys(EVA, "vit_small_plus_patch16_dinov3_qkvb"),
}


# Representatives whose real 2-replica training is asserted elsewhere (AdamW steps on 2 replicas of
# tfdp's strategy, the weights moved, finite and equal to 1 replica's): not stepped again here.
TRAINED_ON_TWO_REPLICAS_IN = {"vit_mini_patch4_small": "tests/models/test_transformer_runs.py",
                              # its builder, at the fixture's size (the same code with 3 small stages)
                              "swin_tiny_patch4_window7_224": "tests/models/test_swin.py",
                              # its builder (DINOv3's and EVA-02's) at the fixture's size, q/v biases and SwiGLU
                              "vit_small_plus_patch16_dinov3_qkvb": "tests/models/test_eva.py",
                              # its builder at the fixture's size (4 stages, 6 blocks; the full size took 48 s here)
                              "regnety_002": "tests/models/test_regnet.py"}


def test_every_model_has_a_representative_that_trains():
    assert set(ONE_PER_BUILDER) == set(MODELS)
    assert set(TRAINED_ON_TWO_REPLICAS_IN) <= set(ONE_PER_BUILDER.values())
    from conftest import REPO
    for name, path in TRAINED_ON_TWO_REPLICAS_IN.items():   # the test that steps it still names it
        with open(os.path.join(REPO, path)) as f:
            assert f'("{name}", ' in f.read(), (name, path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(ONE_PER_BUILDER.values()) - set(TRAINED_ON_TWO_REPLICAS_IN)))
def test_one_training_step_with_two_replicas(name, strategy):
    """One eager step on 4 images at the model's smallest input (8 px at least: the small-image models are
    convolved at 8, the ImageNet ones at 32, Inception at 75)."""
    from support.model_checks import steps_on_replicas
    size = max(8, MIN_INPUT_SIZE[name])
    cfg = validate({"model": {"name": name, "num_classes": 7}, "data": {"image_size": size}})
    images = np.random.default_rng(0).integers(0, 256, (4, size, size, 3), dtype=np.uint8)
    steps_on_replicas(strategy, lambda: build_model(cfg.model, cfg.data), images, 7)


def test_input_too_small_for_the_architecture():
    cfg = validate({"model": {"name": "inception_v3"}, "data": {"image_size": 64}})
    with pytest.raises(UserError, match="model 'inception_v3' needs data.image_size of at least 75, got 64"):
        build_model(cfg.model, cfg.data)


def test_logits_stay_float32_under_mixed_precision():
    import keras
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        cfg = validate({"model": {"name": "simple_cnn"}, "data": {"image_size": 16}})
        model = build_model(cfg.model, cfg.data)
        assert model.get_layer("simple_cnn_backbone").get_layer("conv1").compute_dtype == "bfloat16"
        assert model(np.zeros((1, 16, 16, 3), np.uint8)).dtype == "float32"
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_adaptive_pool_matches_pytorch_bins():
    from tfdp.models.vgg import AdaptiveAveragePool2D
    x = np.arange(2 * 5 * 3 * 1, dtype="float32").reshape(2, 5, 3, 1)
    out = np.asarray(AdaptiveAveragePool2D(2)(x))
    # PyTorch bins for 5 -> 2: rows [0, 3) and [2, 5); for 3 -> 2: cols [0, 2) and [1, 3).
    expected = np.array([[x[b, r0:r1, c0:c1, 0].mean() for c0, c1 in ((0, 2), (1, 3))]
                         for b in range(2) for r0, r1 in ((0, 3), (2, 5))]).reshape(2, 2, 2, 1)
    np.testing.assert_allclose(out, expected)
    one = np.ones((1, 1, 1, 4), "float32") * 3
    np.testing.assert_allclose(np.asarray(AdaptiveAveragePool2D(7)(one)), np.full((1, 7, 7, 4), 3.0))


def test_flip_runs_on_the_device_per_image_and_only_in_training():
    cfg = validate({"model": {"name": "simple_cnn"}, "data": {"image_size": 16}})
    flip = build_model(cfg.model, cfg.data).get_layer("hflip")
    images = np.random.default_rng(0).integers(0, 256, (64, 16, 16, 3), dtype=np.uint8)
    flipped = np.asarray(flip(images, training=True))
    mirrored = [np.array_equal(out, image[:, ::-1]) for out, image in zip(flipped, images)]
    unchanged = [np.array_equal(out, image) for out, image in zip(flipped, images)]
    assert all(m != u for m, u in zip(mirrored, unchanged))  # each image is exactly itself or its mirror
    assert 10 < sum(mirrored) < 54  # drawn per image (a fair coin gives 32 +- 4)
    assert np.array_equal(np.asarray(flip(images, training=False)), images)
    no_flip = validate({"model": {"name": "simple_cnn"}, "data": {"image_size": 16, "hflip": False}})
    assert "hflip" not in [layer.name for layer in build_model(no_flip.model, no_flip.data).layers]


def _dropout_rates(model):
    import keras
    backbone = model.layers[-2]  # build_model's wrapper: ..., backbone, logits_float32
    return {layer.name: layer.rate for layer in backbone.layers if isinstance(layer, keras.layers.Dropout)
            and not layer.name.endswith("_drop")}  # EfficientNet's per-block stochastic depth is not the head's


@pytest.mark.parametrize("name, layers", [("vgg11", ("dropout1", "dropout2")), ("squeezenet1_1", ("dropout",))])
def test_vgg_and_squeezenet_dropout_defaults_to_half_and_a_configured_zero_removes_it(name, layers):
    """Built for their layers only (`shapes_only`: no values for VGG's 133M weights, which the rates do not need)."""
    import keras
    from support.shapes import shapes_only
    rates = {}
    for dropout in (None, 0.0, 0.3):
        cfg = validate({"model": {"name": name, "dropout": dropout}, "data": {"image_size": 32}})
        with shapes_only():
            rates[dropout] = _dropout_rates(build_model(cfg.model, cfg.data))
        keras.backend.clear_session()
    assert rates == {None: dict.fromkeys(layers, 0.5), 0.0: {}, 0.3: dict.fromkeys(layers, 0.3)}


@pytest.mark.parametrize("name, layer, default", [("mobilenet_v2", "top_dropout", None),  # none upstream: inserted
                                                  ("efficientnetv2_b0", "top_dropout", 0.2),  # rate set afterwards
                                                  ("efficientnet_b5", "top_dropout", 0.4),  # V1: by size
                                                  ("mobilenet_v3_large", "dropout", 0.2)])  # `dropout_rate`
def test_keras_applications_models_honour_the_configured_dropout(name, layer, default):
    """Built for their layers only (`shapes_only`: the rates and the output shape need no weight values)."""
    import keras
    from support.shapes import shapes_only
    rates = {}
    for dropout in (None, 0.3):
        cfg = validate({"model": {"name": name, "num_classes": 5, "dropout": dropout}, "data": {"image_size": 32}})
        with shapes_only():
            model = build_model(cfg.model, cfg.data)
            rates[dropout] = _dropout_rates(model)
            assert model.output_shape == (None, 5)
        keras.backend.clear_session()
    assert rates == {None: {layer: default} if default else {}, 0.3: {layer: 0.3}}


@pytest.mark.parametrize("name", ["efficientnet_b0", "efficientnetv2_b0"])
def test_efficientnets_take_model_drop_path_as_keras_drop_connect_rate(name):
    """0 (the default, as for every model): no stochastic depth, where Keras' wrappers fix 0.2; 0.3: each residual
    block b of n drops at 0.3 * b / n (Keras' and timm's schedule)."""
    import keras
    from support.shapes import shapes_only
    rates = {}
    for drop_path in (0.0, 0.3):
        cfg = validate({"model": {"name": name, "drop_path": drop_path}, "data": {"image_size": 32}})
        with shapes_only():
            backbone = build_model(cfg.model, cfg.data).layers[-2]
            blocks = sorted({layer.name.split("_")[0] for layer in backbone.layers if layer.name.startswith("block")})
            rates[drop_path] = {layer.name.split("_")[0]: layer.rate for layer in backbone.layers
                                if isinstance(layer, keras.layers.Dropout) and layer.name.endswith("_drop")}
        keras.backend.clear_session()
    assert rates[0.0] == {} and len(rates[0.3]) > 5
    assert all(rate == pytest.approx(0.3 * blocks.index(block) / len(blocks)) for block, rate in rates[0.3].items())


def test_stochastic_depth_drops_whole_residual_branches_per_sample_at_rising_rates():
    """resnet18 with drop_path 0.3: 8 blocks at rates 0, 0.3/7, ..., 0.3; in training each sample's branch is
    either dropped (all zeros) or scaled by 1/(1 - rate); at inference it passes unchanged."""
    import keras
    from tfdp.models.resnet import DropPath
    model = MODELS["resnet18"]((32, 32, 3), 10, drop_path_rate=0.3)
    rates = [layer.rate for layer in model.layers if isinstance(layer, DropPath)]
    np.testing.assert_allclose(rates, [0.3 * i / 7 for i in range(1, 8)])   # the first block (rate 0) has none
    layer = DropPath(0.25, seed=1)
    x = keras.ops.ones((4000, 3, 3, 2))
    out = keras.ops.convert_to_numpy(layer(x, training=True))
    per_sample = out.reshape(4000, -1)
    assert np.isclose(np.unique(per_sample), [0.0, 1 / 0.75]).all() and (per_sample == per_sample[:, :1]).all()
    assert abs((per_sample[:, 0] == 0).mean() - 0.25) < 0.03
    assert np.array_equal(keras.ops.convert_to_numpy(layer(x, training=False)), np.ones((4000, 3, 3, 2)))


def test_drop_path_on_a_model_without_residual_blocks_is_one_line():
    cfg = validate({"model": {"name": "vgg11", "drop_path": 0.1}})
    with pytest.raises(UserError, match="model.drop_path: model 'vgg11' has no residual blocks"):
        build_model(cfg.model, cfg.data)
