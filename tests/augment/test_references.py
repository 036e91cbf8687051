"""The random augmentations against timm 1.0.31 and torchvision 0.28, conditionally: given the draws the reference
made (recorded by tests/fixtures/make_augment_fixture.py), tfdp computes what the reference computed.

Their random draws cannot be compared run for run (Python's `random`, NumPy's and torch's generators against
stateless Philox), so each test fixes the draws: the op and its magnitude and sign, lambda and the CutMix box
centre, the erasing attempts, box and noise. The photos are 48 px crops of scikit-image's photos.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tfdp import augment as aug
from tfdp.config import IMAGENET_MEAN, IMAGENET_STD
from tfdp.config.rand_augment import RandAugmentSpec

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
META = json.load(open(os.path.join(FIXTURES, "augment_fixture.json")))
FILL = tuple(float(f) for f in META["fill"])
TA_NAMES = [name for name, _, _ in aug.TRIVIAL_AUGMENT_WIDE_SPACE]
GEOMETRIC = ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel", "TranslateX", "TranslateY")


@pytest.fixture(scope="module")
def ref():
    with np.load(os.path.join(FIXTURES, "augment_reference.npz")) as f:
        return dict(f)


def cases(prefix: str) -> list[str]:
    return [key for key in META["cases"] if key.startswith(prefix + "/")]


def rand_augment_op(images, name: str, magnitude: float, sign: float) -> np.ndarray:
    """tfdp's RandAugment with one layer, this op, applied, at this magnitude and sign: timm's AugmentOp given
    its draws (the op's choice, prob, magnitude noise and `_randomly_negate`)."""
    batch = len(images)
    plan = {"op": tf.zeros([batch, 1], tf.int32), "applied": tf.ones([batch, 1], tf.bool),
            "magnitude": tf.fill([batch, 1], float(magnitude)), "sign": tf.fill([batch, 1], float(sign))}
    out = aug.rand_augment(tf.constant(images, tf.float32), None, RandAugmentSpec(num_ops=1, prob=1.0), (name,),
                           FILL, plan=plan)
    return aug.to_uint8(out).numpy()


def trivial_augment_op(images, name: str, bin_: int, sign: float, interpolation: str) -> np.ndarray:
    """tfdp's TrivialAugmentWide given torchvision's draws: the op, the magnitude bin and the sign."""
    batch = len(images)
    plan = {"op": tf.fill([batch], TA_NAMES.index(name)), "bin": tf.fill([batch], bin_),
            "sign": tf.fill([batch], float(sign))}
    out = aug.trivial_augment_wide(tf.constant(images, tf.float32), None, plan=plan, interpolation=interpolation)
    return aug.to_uint8(out).numpy()


def level_difference(got: np.ndarray, want: np.ndarray) -> tuple[int, float]:
    diff = np.abs(got.astype(int) - want.astype(int))
    return int(diff.max()), float((diff > 0).mean())


# Bilinear warps: both sides take the same convex combination of the same 4 pixels (tfdp in float32, PIL in
# double) and truncate it to a level; they part only where that value is an integer that PIL's double arithmetic
# lands just below (e.g. 0.6 * a multiple of 5: PIL truncates k - 1e-15 to k - 1; tfdp's floor(v + 1e-3) keeps k).
# So at most 1 level, and on few pixels (measured: at most 3.3% here, at the largest translation).
WARP_LEVELS, WARP_SHARE = 1, 0.05


@pytest.mark.parametrize("key", cases("ra"))
def test_rand_augment_op_equals_timm_at_fixed_magnitude(ref, key):
    """Each of timm's RandAugment ops (and the inc1 variants) at magnitudes 0, 9 and 10 with mstd 0, each sign:
    pixel ops exactly, bilinear warps (fill img_mean) within a level on a few pixels."""
    _, name, magnitude, sign = key.split("/")
    images = ref["photos"][:2]
    got = rand_augment_op(images, name, float(magnitude), float(sign))
    worst, share = level_difference(got, ref[key])
    if name in GEOMETRIC:
        assert worst <= WARP_LEVELS and share < WARP_SHARE, (key, worst, share)
    else:
        # AutoContrast: PIL scales by 255 / (high - low) in float and truncates; a value within float error of an
        # integer can land a level apart (measured: 1 level on 0.08% of pixels).
        assert worst <= (1 if name == "AutoContrast" else 0), (key, worst, share)
        assert share < 0.002, (key, share)
    assert (got != images).any() or (ref[key] == images).all()  # it did what the reference did, not nothing


def test_posterize_to_zero_bits_is_black_where_pillow_13_refuses(ref):
    """timm's Posterize below m 2.5 and PosterizeIncreasing at m 10 keep 0 bits; Pillow 13's posterize raises
    for that (older Pillows made the image black); tfdp gives black."""
    assert set(META["raises"]) == {"ra/Posterize/0/1", "ra/PosterizeIncreasing/10/1"}
    assert (rand_augment_op(ref["photos"][:2], "Posterize", 0, 1) == 0).all()
    assert (rand_augment_op(ref["photos"][:2], "PosterizeIncreasing", 10, 1) == 0).all()


def test_bicubic_is_not_reproduced(ref):
    """timm's train.py picks bilinear or bicubic per op at random (--train-interpolation random); tfdp warps
    bilinearly, so against a bicubic draw its geometric ops differ by tens of levels (the sharper kernel)."""
    for key in cases("ra_bicubic"):
        _, name, magnitude, sign = key.split("/")
        worst, share = level_difference(rand_augment_op(ref["photos"][:2], name, float(magnitude), float(sign)),
                                        ref[key])
        assert 10 < worst < 100 and share > 0.3, (key, worst, share)


@pytest.mark.parametrize("key", cases("ta"))
def test_trivial_augment_op_equals_torchvision_given_its_bin_and_sign(ref, key):
    """torchvision's TrivialAugmentWide op by op at bins 0, 20 and 30 (Rotate at bin 20 is 90 degrees, which PIL
    does as a transpose), each sign: pixel ops within a level, bilinear warps as timm's, nearest exact but where
    the sample point falls exactly on a pixel edge (Rotate 135 degrees: the diagonals)."""
    _, name, bin_, sign, interpolation = key.split("/")
    images = ref["photos"][:2]
    worst, share = level_difference(trivial_augment_op(images, name, int(bin_), float(sign), interpolation),
                                    ref[key])
    if name in GEOMETRIC and interpolation == "nearest" and key != "ta/Rotate/30/1/nearest":
        assert worst == 0, key
    elif key == "ta/Rotate/30/1/nearest":
        # Rotating by 135 degrees about the centre puts the samples of the two diagonals exactly on pixel edges;
        # which side float error picks (PIL's arithmetic, tfdp's float32) is arbitrary (measured 1.27%).
        assert share < 0.03, share
    elif name in GEOMETRIC:
        assert worst <= WARP_LEVELS and share < WARP_SHARE, (key, worst, share)
    else:
        # torchvision's PIL ops are timm's (ImageEnhance, ImageOps); factors 1 + m with m from a float32 linspace
        # put a product within float error of an integer now and then (measured: 1 level on at most 1.7%).
        assert worst <= 1 and share < 0.03, (key, worst, share)


def test_trivial_augment_translate_moves_the_way_torchvision_does(ref):
    """The same sign draw moves the content the same way (torchvision's affine moves it by +m pixels): a
    translation of the wrong sign is off by the whole photo, not a level."""
    images = ref["photos"][:2]
    right = trivial_augment_op(images, "TranslateX", 30, 1.0, "bilinear")
    assert (right == ref["ta/TranslateX/30/1/bilinear"]).all()
    assert (right[:, :, 32:] == images[:, :, :16]).all() and (right[:, :, :32] == 0).all()


# ----------------------------------------------------------------------------- Mixup / CutMix

@pytest.mark.parametrize("case", list(META["mix_cases"]))
def test_mixup_and_cutmix_equal_timm_given_lambda_and_the_box_centre(ref, case):
    """timm's FastCollateMixup (elem and batch mode, label smoothing 0.1): given lambda, the CutMix switch and
    the centres rand_bbox drew, the mixed uint8 images are timm's exactly, and so are the targets in elem mode
    (timm stores each lambda in float32); in batch mode timm keeps its one lambda a Python float, so 1 - lambda
    is rounded from float64 there: within 1 ulp."""
    mode, lam, cut = META["mix_cases"][case]
    images = ref["photos"]
    batch = len(images)
    lam = np.broadcast_to(np.asarray(lam, np.float32), [batch])
    cut = np.broadcast_to(np.asarray(cut), [batch])
    centres = ref[f"mix/{case}/centres"]
    cy, cx = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
    if mode == "elem":
        drew = cut & (lam != 1)  # timm draws a centre for each CutMix image it mixes, in order
        cy[drew], cx[drew] = centres[:, 0], centres[:, 1]
    elif cut.all():
        cy[:], cx[:] = centres[0]
    targets = aug.smooth_one_hot(tf.constant([0, 1, 2, 3]), 4, 0.1)
    mixed, mixed_targets = aug.mix_given(tf.constant(images, tf.float32), targets, tf.constant(lam),
                                         tf.constant(cut), tf.constant(cy), tf.constant(cx))
    np.testing.assert_array_equal(aug.to_uint8(mixed).numpy(), ref[f"mix/{case}/images"])
    want = ref[f"mix/{case}/targets"]
    ulps = np.abs(mixed_targets.numpy().view(np.int32) - want.view(np.int32)).max()  # all positive floats
    assert ulps <= (0 if mode == "elem" else 1)
    own = (mixed_targets.numpy()[np.arange(batch), np.arange(batch)] - 0.025) / 0.9  # lambda the targets used
    mixed_up = ~cut & (lam < 1)
    np.testing.assert_allclose(own[mixed_up], lam[mixed_up], atol=1e-6)
    if mode == "elem":  # correct_lam: a CutMix image's weight is its clipped box's, not the lambda drawn
        assert (np.abs(own[cut & (lam < 1)] - lam[cut & (lam < 1)]) > 1e-3).any()


# ----------------------------------------------------------------------------- random erasing

@pytest.mark.parametrize("key", cases("erase"))
def test_random_erasing_equals_timm_given_its_attempts_box_and_noise(ref, key):
    """timm's RandomErasing (probability 1; const, rand, pixel): its attempts' area fractions and log-aspects give
    tfdp the same box size; with timm's top, left and noise, tfdp's uint8 image is timm's normalised output
    brought back to levels (mean + std * value, rounded and clipped: the batch stays uint8)."""
    mode, i = key.split("/")[1], int(key.split("/")[2])
    image = ref["photos"][i % 2]
    fraction, log_aspect = ref[f"{key}/area"], ref[f"{key}/log_aspect"]
    tries = len(fraction)
    padded = lambda v: tf.constant(np.pad(v, (0, 10 - tries), constant_values=v[-1])[None], tf.float32)  # noqa: E731
    box_h, box_w, fits = aug.erasing_box_size(padded(fraction), padded(log_aspect), 48, 48)
    noise = ref[f"{key}/noise"]
    top, left, h, w = ref[f"{key}/box"]
    assert (int(box_h[0]), int(box_w[0]), bool(fits[0])) == (h, w, True)
    full = np.zeros([1, 48, 48, 3], np.float32)
    full[0, top:top + h, left:left + w] = noise
    fill = aug.pixels_of_noise(tf.constant(full), IMAGENET_MEAN, IMAGENET_STD)
    got = aug.to_uint8(aug.erase_box(tf.constant(image[None], tf.float32), tf.constant([top]), tf.constant([left]),
                                     box_h, box_w, tf.constant([True]), fill)).numpy()[0]
    want = np.clip(np.round(ref[f"{key}/output"] * np.float32(IMAGENET_STD) + np.float32(IMAGENET_MEAN)), 0, 255)
    np.testing.assert_array_equal(got, want.astype(np.uint8))
    erased = np.zeros([48, 48], bool)
    erased[top:top + h, left:left + w] = True
    assert (got[~erased] == image[~erased]).all() and (got[erased] != image[erased]).any()
