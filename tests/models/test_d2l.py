"""d2l's ResNet-18 (`resnet18_d2l`, tfdp/models/d2l.py) against the book's section 13.6 network: its stem,
its blocks and shortcuts, its feature-map sides, its parameter count and its N(0, 0.01^2) initialisation."""

import keras
import numpy as np
import pytest

from tfdp.config import validate
from tfdp.models import MODELS, build_model

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
