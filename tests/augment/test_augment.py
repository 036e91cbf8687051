"""Device-side batch augmentations (tfdp/augment/), checked on real photographs.

The photos are scikit-image's astronaut, chelsea, coffee and rocket, cropped
square and resized to 64x64. Statistical checks use scipy's tests with fixed
seeds, so they are deterministic, and each is paired with a check that a wrong
implementation (a per-batch draw, an unclipped box, another distribution) fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf
from PIL import Image, ImageEnhance, ImageOps

from conftest import CPU_DEVICES
from tfdp import augment as aug
from tfdp.config.rand_augment import RAND_AUGMENT_OP_NAMES, RandAugmentSpec, parse_rand_augment
from tfdp.config import AugmentConfig, validate

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")
SEED = tf.constant([7, 11], tf.int64)


def photo(name: str, size: int) -> np.ndarray:
    import skimage.data
    image = getattr(skimage.data, name)()[..., :3]
    h, w = image.shape[:2]
    side = min(h, w)
    image = image[(h - side) // 2:(h - side) // 2 + side, (w - side) // 2:(w - side) // 2 + side]
    return np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR))


@pytest.fixture(scope="module")
def photos() -> np.ndarray:
    """[4, 64, 64, 3] uint8."""
    return np.stack([photo(name, 64) for name in PHOTOS])


def batch_of(photos: np.ndarray, n: int, size: int | None = None) -> np.ndarray:
    """n images cycling through the photos (image i is photo i % 4), optionally downsized."""
    if size:
        photos = np.stack([np.asarray(Image.fromarray(p).resize((size, size), Image.BILINEAR)) for p in photos])
    return photos[np.arange(n) % len(photos)]


def tagged(images: np.ndarray) -> np.ndarray:
    """Photo k's pixels with k in their two low bits: no pixel of one photo equals any pixel of another, so
    where an output pixel came from is known exactly (the photos look the same)."""
    tags = (np.arange(len(images)) % len(PHOTOS)).astype(np.uint8)[:, None, None, None]
    return (images & 0xFC) | tags


def build(num_classes: int = 4, label_smoothing: float = 0.0, **section):
    return aug.build_batch_augment(validate({"augment": section}).augment, num_classes,
                                   label_smoothing=label_smoothing)


def run(augment, images, labels, seed=SEED):
    out, targets = augment(tf.constant(images), tf.constant(labels), seed)
    return out.numpy(), targets.numpy()


# ----------------------------------------------------------------------------- switches and helpers

def test_nothing_is_built_when_every_switch_is_off():
    assert aug.build_batch_augment(AugmentConfig(), 10) is None
    assert not aug.needs_soft_labels(AugmentConfig())
    assert aug.needs_soft_labels(AugmentConfig(cutmix_alpha=1.0))
    assert aug.needs_soft_labels(validate({"augment": {"mixup_alpha": 0.2}}))  # a whole Config works too
    assert not aug.needs_soft_labels(AugmentConfig(mixup_alpha=0.2, mix_prob=0.0))
    assert not aug.needs_soft_labels(AugmentConfig(rand_augment="rand-m9"))  # one-hot targets, just soft-typed


def test_every_rand_augment_op_name_is_implemented():
    for name in RAND_AUGMENT_OP_NAMES:
        assert aug.timm_runs(name) in aug.PIXEL_OPS or aug.timm_runs(name) in aug.AFFINE_OPS, name
    for name, _, _ in aug.TRIVIAL_AUGMENT_WIDE_SPACE:
        assert name in aug.PIXEL_OPS or name in aug.AFFINE_OPS, name


def test_rand_augment_strings_read_as_timm():
    assert parse_rand_augment("rand-m9-mstd0.5-inc1") == RandAugmentSpec(
        num_ops=2, magnitude=9, magnitude_std=0.5, magnitude_max=10, increasing=True, prob=0.5)
    assert parse_rand_augment("rand-n3-m7-p1-mmax12") == RandAugmentSpec(
        num_ops=3, magnitude=7, magnitude_max=12, prob=1.0)
    assert parse_rand_augment("rand-mstd101").magnitude_std == float("inf")  # timm: uniform magnitude
    assert parse_rand_augment("rand").magnitude == 10  # timm's default when m is left out


def test_labels_of_either_shape_become_smoothed_one_hot_targets(photos):
    augment = build(num_classes=4, label_smoothing=0.2, erasing_prob=0.5)
    for labels in (np.array([0, 1, 2, 3]), np.array([[0], [1], [2], [3]])):
        _, targets = run(augment, photos, labels)
        np.testing.assert_allclose(targets, np.eye(4) * 0.8 + 0.05, atol=1e-6)  # timm: on 1-s+s/K, off s/K


def test_odd_batches_and_non_square_images(photos):
    images = np.stack([np.asarray(Image.fromarray(p).resize((40, 24))) for p in photos[:3]])  # 3 of 24x40
    augment = build(num_classes=3, rand_augment="rand-m9-mstd0.5-inc1", mixup_alpha=0.8, cutmix_alpha=1.0,
                    erasing_prob=0.5, color_jitter=0.4)
    out, targets = run(augment, images, np.arange(3), seed=tf.constant([1, 2], tf.int32))
    assert out.shape == (3, 24, 40, 3) and out.dtype == np.uint8 and targets.shape == (3, 3)
    assert targets[1, 1] == pytest.approx(1.0)  # the middle image is its own partner: its target stays whole
    np.testing.assert_allclose(targets.sum(axis=1), 1.0, atol=1e-6)


# ----------------------------------------------------------------------------- Mixup

def own_weight(targets, labels, smoothing=0.0):
    """lambda recovered from the label mass on the image's own class."""
    k = targets.shape[1]
    mass = targets[np.arange(len(labels)), labels]
    return (mass - smoothing / k) / (1.0 - smoothing)


@pytest.mark.parametrize("alpha", [0.2, 1.0])
def test_mixup_lambda_is_beta_alpha_alpha_per_image(photos, alpha):
    images = batch_of(photos, 2000, size=16)
    labels = np.arange(2000) % 2  # image i and its partner 1999 - i always differ in class
    out, targets = run(build(num_classes=2, mixup_alpha=alpha), images, labels)
    lam = own_weight(targets, labels)
    assert scipy.stats.kstest(lam, scipy.stats.beta(alpha, alpha).cdf).pvalue > 0.01
    wrong = 1.0 if alpha != 1.0 else 0.2
    assert scipy.stats.kstest(lam, scipy.stats.beta(wrong, wrong).cdf).pvalue < 1e-6  # the test can tell
    inner = lam[(lam > 1e-3) & (lam < 1 - 1e-3)]  # Beta(0.2, 0.2) puts many at 0 or 1 in float32
    assert len(inner) > 500 and len(np.unique(inner)) > 0.99 * len(inner)  # one draw per image, not per batch
    partner = images[::-1].astype(np.float64)
    expected = lam[:, None, None, None] * images + (1 - lam[:, None, None, None]) * partner
    assert np.abs(out - expected).max() <= 0.5 + 1e-3  # the pixels mixed with the same lambda, rounded


def test_mix_prob_leaves_the_rest_untouched(photos):
    images = batch_of(photos, 1000, size=16)
    labels = np.arange(1000) % 2
    out, targets = run(build(num_classes=2, mixup_alpha=1.0, mix_prob=0.3), images, labels)
    untouched = own_weight(targets, labels) == 1.0
    assert abs(untouched.mean() - 0.7) < 4 * np.sqrt(0.21 / 1000)
    assert (out[untouched] == images[untouched]).all()


def test_batch_mode_draws_one_lambda_for_the_batch(photos):
    labels = np.arange(64) % 2
    _, targets = run(build(num_classes=2, mixup_alpha=1.0, mix_mode="batch"), batch_of(photos, 64, 16), labels)
    assert len(np.unique(np.round(own_weight(targets, labels), 6))) == 1


# ----------------------------------------------------------------------------- CutMix

def test_cutmix_label_weight_is_exactly_the_pasted_pixel_fraction(photos):
    images = tagged(batch_of(photos, 256))
    labels = np.arange(256) % 4  # photo index; partner 255 - i is always another photo
    out, targets = run(build(num_classes=4, cutmix_alpha=1.0), images, labels)
    partner = images[::-1]
    from_partner = (out == partner).all(-1)
    from_self = (out == images).all(-1)
    assert (from_partner ^ from_self).all()  # every pixel is one image's or the other's
    weight = targets[np.arange(256), labels[::-1]]
    np.testing.assert_allclose(from_partner.mean(axis=(1, 2)), weight, atol=1e-6)
    for mask in from_partner:  # the pasted pixels form one axis-aligned box
        rows, cols = np.nonzero(mask)
        if len(rows):
            assert mask[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()
    assert len(np.unique(weight)) > 100  # each image its own box


def timm_cutmix_weights(rng: np.random.Generator, n: int, size: int, alpha: float) -> np.ndarray:
    """timm's rand_bbox + correct_lam, in numpy: the partner's weight 1 - lambda after clipping."""
    lam = rng.beta(alpha, alpha, n)
    cut = (size * np.sqrt(1 - lam)).astype(int)
    cy, cx = rng.integers(0, size, n), rng.integers(0, size, n)
    height = np.clip(cy + (cut + 1) // 2, 0, size) - np.clip(cy - cut // 2, 0, size)
    width = np.clip(cx + (cut + 1) // 2, 0, size) - np.clip(cx - cut // 2, 0, size)
    return height * width / size ** 2


def test_cutmix_box_areas_follow_timm(photos):
    labels = np.arange(2000) % 2
    _, targets = run(build(num_classes=2, cutmix_alpha=1.0), batch_of(photos, 2000, size=32), labels)
    weight = targets[np.arange(2000), labels[::-1]]
    reference = timm_cutmix_weights(np.random.default_rng(0), 20000, 32, 1.0)
    assert scipy.stats.ks_2samp(weight, reference).pvalue > 0.01
    unclipped = 1 - np.random.default_rng(1).beta(1.0, 1.0, 20000)  # a box always inside the image (Keras)
    assert scipy.stats.ks_2samp(weight, unclipped).pvalue < 1e-6


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_mixed_targets_sum_to_one_and_favour_the_larger_share(photos, smoothing):
    labels = np.arange(512) % 4
    augment = build(num_classes=4, label_smoothing=smoothing, mixup_alpha=0.8, cutmix_alpha=1.0)
    _, targets = run(augment, tagged(batch_of(photos, 512, size=32)), labels)
    np.testing.assert_allclose(targets.sum(axis=1), 1.0, atol=1e-5)
    lam = own_weight(targets, labels, smoothing)
    top1 = targets.argmax(axis=1)
    assert (top1[lam > 0.5 + 1e-4] == labels[lam > 0.5 + 1e-4]).all()
    assert (top1[lam < 0.5 - 1e-4] == labels[::-1][lam < 0.5 - 1e-4]).all()
    assert 0.2 < (lam < 0.5).mean() < 0.8  # both happen


# ----------------------------------------------------------------------------- RandAugment / TrivialAugment

PIL_FILL = (124, 116, 104)
PIL_OPS = [
    ("AutoContrast", 0, ImageOps.autocontrast),
    ("Equalize", 0, ImageOps.equalize),
    ("Invert", 0, ImageOps.invert),
    ("Posterize", 3, lambda im: ImageOps.posterize(im, 3)),
    ("Solarize", 128, lambda im: ImageOps.solarize(im, 128)),
    ("Color", 1.7, lambda im: ImageEnhance.Color(im).enhance(1.7)),
    ("Contrast", 0.3, lambda im: ImageEnhance.Contrast(im).enhance(0.3)),
    ("Brightness", 1.7, lambda im: ImageEnhance.Brightness(im).enhance(1.7)),
    ("Sharpness", 1.9, lambda im: ImageEnhance.Sharpness(im).enhance(1.9)),
    ("Rotate", 25.0, lambda im: im.rotate(25.0, resample=Image.BILINEAR, fillcolor=PIL_FILL)),
    ("ShearX", 0.25, lambda im: im.transform(im.size, Image.AFFINE, (1, 0.25, 0, 0, 1, 0), Image.BILINEAR,
                                             fillcolor=PIL_FILL)),
    ("TranslateY", -9.3, lambda im: im.transform(im.size, Image.AFFINE, (1, 0, 0, 0, 1, -9.3), Image.BILINEAR,
                                                 fillcolor=PIL_FILL)),
]


def test_image_ops_match_pil(photos):
    """timm applies these ops with PIL; the batched versions give PIL's pixels (rarely 1 level off)."""
    x = tf.constant(photos, tf.float32)
    for name, arg, reference in PIL_OPS:
        args = tf.fill([len(photos)], float(arg))
        if name in aug.PIXEL_OPS:
            out = aug.PIXEL_OPS[name](x, args)
        else:
            out = aug.warp_affine(x, aug.AFFINE_OPS[name](args, 64, 64), [float(f) for f in PIL_FILL])
        got = aug.truncate_levels(out).numpy().astype(int)
        want = np.stack([np.asarray(reference(Image.fromarray(p))) for p in photos]).astype(int)
        diff = np.abs(got - want)
        assert diff.max() <= 1 and (diff > 0).mean() < 0.02, name
        assert (got != photos).mean() > 0.3, name  # the op did change the photo


@pytest.mark.parametrize("num_ops", [1, 2, 3])
def test_rand_augment_applies_n_ops_to_every_image(photos, num_ops):
    """With Invert as the only op and p=1, n ops invert an image n times: odd n inverted, even n unchanged."""
    out, _ = run(build(rand_augment=f"rand-n{num_ops}-p1", rand_augment_ops=["Invert"]), photos,
                 np.arange(4))
    assert (out == (255 - photos if num_ops % 2 else photos)).all()


def test_rand_augment_choices_are_per_image(photos):
    images = np.repeat(photos[:1], 32, axis=0)  # one photo 32 times
    spec = parse_rand_augment("rand-m9-mstd0.5-inc1")
    plan = {k: v.numpy() for k, v in aug.rand_augment_plan(SEED, 32, spec, 15).items()}
    assert plan["op"].shape == (32, 2)
    assert len({tuple(row) for row in plan["op"]}) > 20  # each image its own pair of ops
    assert 0.3 < plan["applied"].mean() < 0.7  # timm's p=0.5 per op
    assert 7.5 < plan["magnitude"].mean() < 10.5 and plan["magnitude"].std() > 0.2  # N(9, 0.5) clipped at 10
    augment = build(rand_augment="rand-m9-mstd0.5-inc1")
    labels = np.zeros(32, int)
    out, _ = run(augment, images, labels)
    distinct = {o.tobytes() for o in out}
    assert len(distinct) > 16
    assert (run(augment, images, labels)[0] == out).all()  # same seed, same output
    assert (run(augment, images, labels, seed=tf.constant([7, 12], tf.int64))[0] != out).any()


def test_rand_augment_p_half_applies_an_op_to_about_half(photos):
    out, _ = run(build(rand_augment="rand-n1-p0.5", rand_augment_ops=["Invert"]), batch_of(photos, 400, 16),
                 np.zeros(400, int))
    inverted = (out == 255 - batch_of(photos, 400, 16)).all(axis=(1, 2, 3))
    assert abs(inverted.mean() - 0.5) < 4 * np.sqrt(0.25 / 400)


def test_trivial_augment_one_uniform_op_and_bin_per_image(photos):
    plan = {k: v.numpy() for k, v in aug.trivial_augment_plan(SEED, 6200).items()}
    assert scipy.stats.chisquare(np.bincount(plan["op"], minlength=14)).pvalue > 0.001
    assert scipy.stats.chisquare(np.bincount(plan["bin"], minlength=31)).pvalue > 0.001
    images = batch_of(photos, 200)
    small = {k: tf.constant(v[:200]) for k, v in plan.items()}
    out = aug.to_uint8(aug.trivial_augment_wide(tf.constant(images, tf.float32), SEED, plan=small)).numpy()
    names = [name for name, _, _ in aug.TRIVIAL_AUGMENT_WIDE_SPACE]
    op = plan["op"][:200]
    unchanged = (out == images).all(axis=(1, 2, 3))
    assert unchanged[op == names.index("Identity")].all()
    changes = ("ShearX", "Rotate", "Equalize")  # (Posterize keeps 8 bits in bins 0-2, AutoContrast may no-op)
    assert not unchanged[np.isin(op, [names.index(n) for n in changes]) & (plan["bin"][:200] > 0)].any()
    solarize = (op == names.index("Solarize")) & (plan["bin"][:200] == 30)  # threshold 0: every level inverted
    assert (out[solarize] == 255 - images[solarize]).all()


# ----------------------------------------------------------------------------- random erasing

def boxes(changed: np.ndarray) -> list[tuple[int, int] | None]:
    """(height, width) of the changed region of each image, checking it is a filled rectangle."""
    found = []
    for mask in changed:
        rows, cols = np.nonzero(mask)
        if not len(rows):
            found.append(None)
            continue
        assert mask[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()
        found.append((rows.max() - rows.min() + 1, cols.max() - cols.min() + 1))
    return found


def test_random_erasing_erases_the_configured_share_with_areas_in_range(photos):
    images = batch_of(photos, 800)
    out, _ = run(build(erasing_prob=0.25), images, np.zeros(800, int))
    found = boxes((out != images).any(-1))
    erased = [b for b in found if b]
    assert abs(len(erased) / 800 - 0.25) < 4 * np.sqrt(0.25 * 0.75 / 800)
    areas = np.array([h * w for h, w in erased]) / 64 ** 2
    assert areas.min() > 0.015 and areas.max() < 0.36  # 0.02..1/3 of the image, sides rounded as timm
    assert 0.1 < np.median(areas) < 0.22
    aspect = np.array([h / w for h, w in erased])
    assert aspect.min() > 0.25 and aspect.max() < 4.0 and (aspect > 1.5).any() and (aspect < 0.67).any()
    noise = out[(out != images).any(-1)].astype(float)  # 'pixel': mean + std * N(0, 1) per pixel
    assert abs(noise.mean() - 115) < 5 and 40 < noise.std() < 65


def test_random_erasing_const_fills_the_mean_colour(photos):
    images = batch_of(photos, 64)
    out, _ = run(build(erasing_prob=1.0, erasing_mode="const"), images, np.zeros(64, int))
    changed = (out != images).any(-1)
    assert changed.any(axis=(1, 2)).mean() > 0.9  # prob 1 (an image is skipped only if no box fits)
    assert (out[changed] == [124, 116, 104]).all()


# ----------------------------------------------------------------------------- colour jitter

def test_color_jitter_brightness_factor_is_drawn_per_image(photos):
    images = np.repeat(photos[2:3], 64, axis=0)  # coffee: few clipped pixels
    out = aug.color_jitter(tf.constant(images, tf.float32), SEED, 0.4, 0.0, 0.0, 0.0).numpy()
    ratio = out.mean(axis=(1, 2, 3)) / images.mean()
    assert ratio.min() > 0.58 and ratio.max() < 1.42  # torchvision: factor in [0.6, 1.4]
    assert ratio.std() > 0.15  # uniform on [0.6, 1.4] has std 0.23; one draw per batch would give 0


def test_color_jitter_changes_each_image_differently(photos):
    images = np.repeat(photos[:1], 16, axis=0)
    augment = build(color_jitter=0.4, color_jitter_hue=0.1)
    out, _ = run(augment, images, np.zeros(16, int))
    assert len({o.tobytes() for o in out}) == 16
    hue = aug.color_jitter(tf.constant(images, tf.float32), SEED, 0.0, 0.0, 0.0, 0.1).numpy()
    assert len({o.tobytes() for o in hue}) == 16 and (hue != images).mean() > 0.15


# ----------------------------------------------------------------------------- XLA and replicas

# RandAugment with one layer here: a second layer is the same graph again and doubles the compile (~5 s on CPU).
SWITCHES = {
    "rand_augment": {"rand_augment": "rand-m9-mstd0.5-inc1-n1"},
    "trivial_augment": {"trivial_augment": True},
    "mixup_cutmix": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mix_prob": 0.8},
    "erasing": {"erasing_prob": 0.5, "erasing_mode": "rand"},
    "color_jitter": {"color_jitter": 0.4, "color_jitter_hue": 0.1},
}


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_each_switch_compiles_with_xla_and_draws_as_without(photos, switch):
    augment = build(num_classes=10, label_smoothing=0.1, **SWITCHES[switch])
    images, labels = tf.constant(batch_of(photos, 8, size=32)), tf.constant(np.arange(8) % 10)
    out, targets = tf.function(augment, jit_compile=True)(images, labels, SEED)
    assert out.dtype == tf.uint8 and out.shape == (8, 32, 32, 3)
    assert targets.dtype == tf.float32 and targets.shape == (8, 10)
    eager_out, eager_targets = augment(images, labels, SEED)
    assert (out.numpy() != eager_out.numpy()).mean() < 0.005  # same draws (float ulps may move a level)
    np.testing.assert_allclose(targets, eager_targets, atol=1e-5)
    assert (out.numpy() != images.numpy()).mean() > 0.05


@pytest.mark.parametrize("policy", [{"rand_augment": "rand-m9-mstd0.5-inc1-n1"}, {"trivial_augment": True}])
def test_everything_on_runs_on_two_mirrored_replicas(photos, policy):
    strategy = tf.distribute.MirroredStrategy(CPU_DEVICES)
    augment = build(num_classes=4, label_smoothing=0.1, mixup_alpha=0.8, cutmix_alpha=1.0, erasing_prob=0.25,
                    color_jitter=0.4, **policy)
    images, labels = tf.constant(batch_of(photos, 8, size=32)), tf.constant(np.arange(8) % 4)

    @tf.function
    def step(step_number):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return augment(images, labels, aug.step_seed(0, step_number, replica))
        return strategy.run(replica_fn)

    out, targets = step(tf.constant(5, tf.int64))
    outs, target_sets = strategy.experimental_local_results(out), strategy.experimental_local_results(targets)
    assert len(outs) == 2
    for o, t in zip(outs, target_sets):
        assert o.dtype == tf.uint8 and o.shape == (8, 32, 32, 3) and t.shape == (8, 4)
        np.testing.assert_allclose(t.numpy().sum(axis=1), 1.0, atol=1e-5)
    assert (outs[0].numpy() != outs[1].numpy()).any()  # each replica its own draws from the same images
    again = strategy.experimental_local_results(step(tf.constant(5, tf.int64))[0])
    assert all((a.numpy() == o.numpy()).all() for a, o in zip(again, outs))  # a rerun of step 5 draws the same
    later = strategy.experimental_local_results(step(tf.constant(6, tf.int64))[0])
    assert (later[0].numpy() != outs[0].numpy()).any()


def test_mixing_compiles_with_xla_inside_each_replica(photos):
    """As the trainer compiles each replica's step (tfdp/keras_patches/train_step.py): XLA inside strategy.run."""
    strategy = tf.distribute.MirroredStrategy(CPU_DEVICES)
    augment = tf.function(build(num_classes=4, mixup_alpha=0.8, cutmix_alpha=1.0), jit_compile=True)
    images, labels = tf.constant(batch_of(photos, 8, size=32)), tf.constant(np.arange(8) % 4)

    @tf.function
    def step():
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return augment(images, labels, aug.step_seed(0, 1, replica))
        return strategy.run(replica_fn)

    out, targets = step()
    for o, t in zip(strategy.experimental_local_results(out), strategy.experimental_local_results(targets)):
        assert o.dtype == tf.uint8 and o.shape == (8, 32, 32, 3) and t.shape == (8, 4)


@pytest.mark.full(reason="45 CPU-s: test_everything_on_runs_on_two_mirrored_replicas and "
                         "test_each_switch_compiles_with_xla_and_draws_as_without")
@pytest.mark.slow
def test_every_switch_trains_through_the_real_step_on_two_replicas(digits_dir):
    """The switches on, 2 mirrored replicas, the whole-step XLA step: the augmentation runs inside `fit` on each
    replica (a compiled program of its own), the loss takes its soft targets, and training moves the weights
    without a NaN. (Each switch un-compiled and compiled is checked above; this is the wiring.)"""
    jit = True
    from tfdp.data import build_source
    from tfdp.data.pipeline import Bookkeeping, train_dataset
    from tfdp.distribute.strategy import make_runtime
    from tfdp.train.task import Plan, compile_model
    cfg = validate({"data": {"format": "image_folder", "dir": digits_dir, "image_size": 16},
                    "model": {"name": "simple_cnn"},
                    # RandAugment's XLA program takes a minute to compile on 2 cores; it is compiled above.
                    "augment": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "erasing_prob": 0.25, "color_jitter": 0.4},
                    "train": {"batch_size_per_replica": 8, "label_smoothing": 0.1, "jit_compile": jit},
                    "distribute": {"strategy": "mirrored", "cpu_replicas": 2}})
    runtime = make_runtime(cfg.distribute)
    split = build_source(cfg.data).split("train")
    with runtime.strategy.scope():
        model = compile_model(cfg, Plan(16, 3, split.num_examples, 0, 10))
    before = [w.numpy().copy() for w in model.trainable_weights]
    ds = runtime.strategy.distribute_datasets_from_function(
        lambda ctx: train_dataset(split, cfg.data, 16, 0, ctx, books=Bookkeeping(num_classes=10)))
    history = model.fit(ds, steps_per_epoch=3, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert max(float(np.abs(w.numpy() - b).max()) for w, b in zip(model.trainable_weights, before)) > 1e-4
    if jit:
        assert model.tfdp_step_functions[2].experimental_get_tracing_count() > 0
