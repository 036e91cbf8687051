"""Stochastic depth against timm 1.0.31's `drop_path` (timm/layers/drop.py), given its per-sample mask: the
fixture (tests/fixtures/make_augment_fixture.py) records the Bernoulli mask timm drew and its output."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from tfdp.models.resnet import DropPath, drop_path

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "augment_reference.npz")
RATES = (0.1, 0.25, 0.5)


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURE) as f:
        return {k: f[k] for k in f.files if k.startswith("drop/")}


@pytest.mark.parametrize("rate", RATES)
def test_drop_path_equals_timm_bit_for_bit_given_its_mask(ref, rate):
    """x * (mask / keep): timm scales the mask first (`random_tensor.div_(keep_prob)`), so every product rounds
    as timm's; x / keep * mask would round twice and differ by an ulp on some elements."""
    x, mask, want = (ref[f"drop/{rate}/{part}"] for part in ("x", "mask", "output"))
    assert 0 < mask.sum() < len(mask)  # both kept and dropped samples
    got = keras.ops.convert_to_numpy(drop_path(x, mask, rate))
    np.testing.assert_array_equal(got, want)


def test_the_layer_drops_whole_samples_at_its_rate_and_scales_the_rest():
    """The layer's own draws: a sample is kept whole (scaled by 1 / keep, as timm's scale_by_keep) or zeroed
    whole, about 1 - rate of them kept; inference passes x through."""
    layer = DropPath(0.25, seed=3)
    x = np.random.default_rng(0).normal(size=(4000, 3, 2)).astype(np.float32)
    out = keras.ops.convert_to_numpy(layer(x, training=True))
    kept = (out != 0).all(axis=(1, 2))
    assert ((out == 0).all(axis=(1, 2)) | kept).all()
    np.testing.assert_array_equal(out[kept], keras.ops.convert_to_numpy(drop_path(x[kept], np.ones((1, 1, 1)),
                                                                                  0.25)))
    assert abs(kept.mean() - 0.75) < 4 * np.sqrt(0.75 * 0.25 / 4000)
    assert (keras.ops.convert_to_numpy(layer(x, training=False)) == x).all()
