"""d2l's ResNet-18 (`resnet18_d2l`, tfdp/models/d2l.py) against the book's section 13.6 network: its logits with
the same weights as the book's PyTorch code on real Fashion-MNIST images (tests/fixtures/make_d2l_fixture.py), its
stem, blocks and shortcuts, its feature-map sides, its parameter count and its N(0, 0.01^2) initialisation."""

import json
import os
import re
import sys

import keras
import numpy as np
import pytest

from conftest import REPO
from tfdp.config import validate
from tfdp.models import MODELS, build_model

FIXTURES = os.path.join(REPO, "tests", "fixtures")
sys.path.insert(0, FIXTURES)
from make_d2l_fixture import draw  # noqa: E402 (numpy only: the rule the fixture's torch weights were drawn by)

# torch's state_dict name (the book's nn.Sequential) -> tfdp's layer name
TORCH_NAMES = ((r"^0$", "stem_conv"), (r"^1$", "stem_bn"), (r"^fc\.1$", "logits"),
               (r"^resnet_block(\d)\.(\d)\.(conv|bn)(\d)$",
                lambda m: f"stage{m[1]}_block{int(m[2]) + 1}_{m[3]}{m[4]}"))
# torch's leaf -> its place among the Keras layer's weights (conv/dense: kernel, bias; batch norm: gamma, beta,
# moving mean, moving variance)
LEAVES = {"weight": 0, "bias": 1, "running_mean": 2, "running_var": 3}

# sum(p.numel() for p in resnet18(10).parameters()) of the book's PyTorch network (benchmarks/d2l_table.py's
# torch_twin, after its lazy modules are materialised on a 1x1x28x28 input; torch 2.13)
BOOK_PARAMETERS = 11_175_818


@pytest.fixture(scope="module")
def backbone():
    keras.utils.set_random_seed(0)
    return MODELS["resnet18_d2l"]((28, 28, 3), 10)


def test_parameter_count_is_the_books(backbone):
    """torch's parameters() are Keras' trainable weights (batch norm's moving statistics are torch's buffers)."""
    assert sum(int(np.prod(w.shape)) for w in backbone.trainable_weights) == BOOK_PARAMETERS


def keras_layer_name(module: str) -> str:
    for pattern, name in TORCH_NAMES:
        if (match := re.match(pattern, module)):
            return name if isinstance(name, str) else name(match)
    raise KeyError(module)


def test_logits_are_the_books_pytorch_networks():
    """Every weight and batch-norm statistic of the book's network as the fixture drew them, put into tfdp's: the
    logits on 4 real Fashion-MNIST test images (eval mode) agree. This pins the padding of every strided
    convolution (PyTorch's 1 on every side), the shortcuts, the biases and batch norm's epsilon. Tolerance: both
    sum in float32 in their own order; logits of order 10 agree to 1e-3 (measured here: 3.4e-5)."""
    with open(os.path.join(FIXTURES, "d2l_fixture.json"), encoding="utf-8") as f:
        fixture = json.load(f)
    values: dict[str, list] = {}
    for name, shape in fixture["state_dict"]:
        module, leaf = name.rsplit(".", 1)
        value = draw(name, tuple(shape))
        value = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.T if value.ndim == 2 else value
        values.setdefault(keras_layer_name(module), [None] * 4)[LEAVES[leaf]] = value
    backbone = MODELS["resnet18_d2l"]((28, 28, 3), 10)
    with_weights = {layer.name for layer in backbone.layers if layer.weights}
    assert set(values) == with_weights
    for layer_name, weights in values.items():
        backbone.get_layer(layer_name).set_weights([w for w in weights if w is not None])
    images = np.asarray(fixture["images"], np.float32)[..., None] / 255
    logits = np.asarray(backbone(np.repeat(images, 3, axis=-1), training=False))
    np.testing.assert_allclose(logits, np.asarray(fixture["logits"]), atol=1e-3)


def test_stem_and_blocks_as_the_book_builds_them(backbone):
    """3x3 stride-1 stem on one channel, no max-pool; a 1x1 stride-2 shortcut convolution only where a stage
    halves the side (stages 2-4, their first block); biases on every convolution; 28 -> 28 -> 14 -> 7 -> 4 px."""
    stem = backbone.get_layer("stem_conv")
    assert stem.kernel.shape == (3, 3, 1, 64) and stem.strides == (1, 1) and stem.use_bias
    assert not [layer for layer in backbone.layers if "pool" in type(layer).__name__.lower()
                and "Global" not in type(layer).__name__]
    shortcuts = sorted(layer.name for layer in backbone.layers if layer.name.endswith("_conv3"))
    assert shortcuts == ["stage2_block1_conv3", "stage3_block1_conv3", "stage4_block1_conv3"]
    for name in shortcuts:
        layer = backbone.get_layer(name)
        assert layer.kernel.shape[:2] == (1, 1) and layer.strides == (2, 2)
    sides = [backbone.get_layer(f"stage{s}_block2_out").output.shape[1] for s in (1, 2, 3, 4)]
    assert sides == [28, 14, 7, 4]
    convs = [layer for layer in backbone.layers if isinstance(layer, keras.layers.Conv2D)]
    assert len(convs) == 1 + 16 + 3 and all(layer.use_bias for layer in convs)
    norms = [layer for layer in backbone.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 1 + 16 and all(n.epsilon == 1e-5 and n.momentum == 0.9 for n in norms)


def test_kernels_drawn_from_the_books_normal(backbone):
    """Every convolution and dense kernel from N(0, 0.01^2), biases 0. Each layer's sample std is within 10% of
    0.01: the smallest kernel, the stem's 576 values, has a relative standard error of 1/sqrt(2 x 576) = 3%, so 10%
    is 3.4 of them for it and more for every other (Keras' default, Glorot uniform, gives 0.04 on a 3x3x64x64)."""
    for layer in backbone.layers:
        if isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)):
            kernel = np.asarray(layer.kernel)
            assert abs(kernel.std() - 0.01) < 0.001, layer.name
            assert abs(kernel.mean()) < 0.002, layer.name
            assert not np.asarray(layer.bias).any(), layer.name


def test_reads_the_first_of_three_identical_channels():
    """tfdp's pipeline replicates a greyscale image into 3 channels; the model's logits depend on the first only."""
    cfg = validate({"model": {"name": "resnet18_d2l"}, "data": {"image_size": 28, "hflip": False}})
    model = build_model(cfg.model, cfg.data)
    grey = np.random.default_rng(0).integers(0, 256, (2, 28, 28, 1), dtype=np.uint8)
    other = np.concatenate([grey, 255 - grey, grey // 2], axis=-1)
    np.testing.assert_array_equal(np.asarray(model(np.repeat(grey, 3, axis=-1))), np.asarray(model(other)))
