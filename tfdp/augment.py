"""Batch augmentations that run on the device, inside the training step.

The "modern ImageNet recipe" (timm, torchvision's references) adds RandAugment or
TrivialAugment, random erasing, colour jitter and Mixup/CutMix to the crop and
flip. Done per image on the host they cost CPU time the input pipeline does not
have; here they are batched TensorFlow ops on uint8 images `[B, H, W, 3]` that
compile with the replica's step (XLA included) and draw every random number
statelessly from a seed the caller derives from the step and the replica id, so
a run is reproducible, each replica draws differently, and a resumed run draws
what the uninterrupted one would have.

`build_batch_augment(cfg, num_classes)` returns `augment(images, labels, seed)
-> (images uint8, soft labels float32 [B, num_classes])`, or None when all is off.
Order (as timm's pipeline): colour jitter, RandAugment or TrivialAugment, random
erasing (timm runs these three per image in the dataset), then Mixup/CutMix
(timm runs it on the batch). Label smoothing is folded into the soft targets as
timm's `mixup_target` does, so the loss must not smooth them again.

Mixup/CutMix default to per-sample draws (timm's mode='elem'): each image its own
lambda, mixup-or-cutmix choice, box and apply-or-not, mixed with the image at the
mirrored position of the (per-replica) batch, as timm pairs them; mix_mode 'batch'
is timm's default (one draw for the batch). timm asserts an even batch; here an
odd batch's middle image is paired with itself (mixing it is a no-op).

Why not Keras 3.15's own layers (keras/src/layers/preprocessing/image_preprocessing,
read and probed; "XLA" = tf.function(jit_compile=True) on CPU):

Layer              Verdict  Reason
RandAugment        no       one op choice per batch (`layer_idxes` is [num_ops]), not per image;
                            its 11 ops lack timm's Invert and SolarizeAdd, shear and translate
                            act on both axes at once, magnitudes are a random fraction of
                            `factor` per sub-layer (no m/mstd mapping, no p=0.5 per op);
                            ImageProjectiveTransformV3 does not compile with XLA
AugMix             no       not asked for; same sub-layers and seed model as RandAugment
MixUp              no       lambda is Beta(alpha, alpha) per sample (right), but the partner is
                            a random shuffle that may be the image itself, no mix_prob or
                            switch_prob, no label smoothing, labels must arrive one-hot; its
                            Beta uses StatelessRandomGammaV3, which does not compile with XLA
CutMix             no       `factor` draws alpha itself from U(factor) once per batch; the box
                            never leaves the image (timm and the paper clip it) and its float
                            corners give a label weight that is not the pasted pixel fraction
                            (probed: 0.703 vs 0.718); box x and y are correlated (probed:
                            r = 0.54, 44% of boxes with x0 = y0 +- 1); the Gamma op breaks XLA
RandomErasing      no       `factor` is a range the probability is drawn from (factor=0.5
                            erased 25% of images, probed); box sides are square roots of two
                            independent U(scale) draws (no log-uniform aspect); noise is
                            N(0, 1) * 255 clipped, half of it black, not normal in
                            normalized units
RandomColorJitter  no       fixed order; brightness is an additive shift, not torchvision's
                            factor; saturation maps f to f/(1-f) on HSV of 0..255 values;
                            contrast blends with each channel's mean, not the grey mean
all of them        no       a seed must be an int or a SeedGenerator (a variable): a per-step
                            [2] seed tensor is refused (ValueError), so the draws depend on
                            how often the layer ran, not on the step and the replica

So every augmentation here is written with stateless Philox draws and plain
vectorized ops; the RandAugment/TrivialAugment image ops follow PIL's maths (what
timm and torchvision apply to PIL images) and are checked against PIL in the tests.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import tensorflow as tf

from tfdp.config import (RAND_AUGMENT_INCREASING_OPS, RAND_AUGMENT_OPS, AugmentConfig, RandAugmentSpec,
                         parse_rand_augment)

IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
# Stages draw from their own sub-seed, always split the same way, so switching one on leaves the others' draws alone.
_STAGES = ("color_jitter", "policy", "erasing", "mix")
# Philox, and floats made here from its raw bits (random_bits): with "auto_select", or through tf.random's own
# uniform/normal, XLA draws other numbers than the TF kernels, so a step would augment differently with
# train.jit_compile on and off. Philox's bits are the same with and without XLA, on CPU and GPU.
RNG = "philox"
_PHILOX = 1  # TensorFlow's RNG_ALG_PHILOX

Augment = Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tuple[tf.Tensor, tf.Tensor]]


# ----------------------------------------------------------------------------- public API

def build_batch_augment(cfg: AugmentConfig, num_classes: int, *, label_smoothing: float = 0.0,
                        mean=IMAGENET_MEAN, std=IMAGENET_STD) -> Augment | None:
    """The configured augmentations as one function, or None when every switch is off.

    `augment(images_uint8 [B,H,W,3], labels int [B] or [B,1], seed int [2]) ->
    (images_uint8, soft_labels float32 [B, num_classes])`. `mean`/`std` (0..255
    units, data.mean/data.std) set random erasing's noise and RandAugment's fill.
    """
    image_stages = _image_stages(cfg, mean, std)
    mixing = cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0
    if not image_stages and not mixing:
        return None

    def augment(images, labels, seed):
        seeds = split_seed(seed, len(_STAGES))
        x = tf.cast(images, tf.float32)
        for stage, fn in image_stages:
            x = fn(x, seeds[_STAGES.index(stage)])
        targets = smooth_one_hot(labels, num_classes, label_smoothing)
        if mixing:
            x, targets = mixup_cutmix(x, targets, seeds[_STAGES.index("mix")], cfg.mixup_alpha, cfg.cutmix_alpha,
                                      cfg.mix_prob, cfg.switch_prob, cfg.mix_mode)
        return to_uint8(x), targets

    return augment


def needs_soft_labels(cfg) -> bool:
    """True when Mixup/CutMix mix the targets, so integer labels cannot express them (AugmentConfig or Config).

    `augment` always returns float targets [B, num_classes]; without mixing they
    are (smoothed) one-hot, and their argmax is the integer label.
    """
    a = getattr(cfg, "augment", cfg)
    return (a.mixup_alpha > 0 or a.cutmix_alpha > 0) and a.mix_prob > 0


def step_seed(run_seed: int, step, replica_id) -> tf.Tensor:
    """A stateless seed [2] for one replica's step: distinct per step and per replica, the same on a rerun."""
    seed = tf.stack([tf.constant(run_seed, tf.int64), tf.constant(0x5EED, tf.int64)])
    seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(step, tf.int64), alg=RNG)
    return tf.random.experimental.stateless_fold_in(seed, tf.cast(replica_id, tf.int64), alg=RNG)


def split_seed(seed, n: int) -> list[tf.Tensor]:
    """`n` independent stateless seeds from one."""
    return tf.unstack(tf.bitcast(random_bits(seed, [n, 2]), tf.int32), num=n)


def smooth_one_hot(labels, num_classes: int, smoothing: float) -> tf.Tensor:
    """timm's targets: on = 1 - s + s/K, off = s/K."""
    labels = tf.cast(tf.reshape(labels, [-1]), tf.int32)
    off = smoothing / num_classes
    return tf.one_hot(labels, num_classes, on_value=1.0 - smoothing + off, off_value=off, dtype=tf.float32)


def to_uint8(x) -> tf.Tensor:
    return tf.cast(tf.clip_by_value(tf.round(x), 0.0, 255.0), tf.uint8)


def truncate_levels(x) -> tf.Tensor:
    """Back to 0..255 integer levels by truncation, as PIL's 8-bit ops and torchvision's uint8 casts do
    (the 1e-3 absorbs float error, so 99.99998 stays 100); matches PIL exactly in the tests."""
    return tf.clip_by_value(tf.floor(x + 1e-3), 0.0, 255.0)


def _image_stages(cfg: AugmentConfig, mean, std) -> list[tuple[str, Callable]]:
    """The per-image stages that are on, each `fn(images_float, seed) -> images_float`, in timm's order."""
    stages = []
    if cfg.color_jitter > 0 or cfg.color_jitter_hue > 0:
        b = c = s = cfg.color_jitter
        stages.append(("color_jitter", lambda x, seed: color_jitter(
            x, seed, b, c, s, cfg.color_jitter_hue, cfg.color_jitter_random_order)))
    if cfg.rand_augment:
        spec = parse_rand_augment(cfg.rand_augment)
        ops = tuple(cfg.rand_augment_ops) or (RAND_AUGMENT_INCREASING_OPS if spec.increasing else RAND_AUGMENT_OPS)
        fill = tuple(float(round(m)) for m in mean)  # timm: img_mean as the fill colour
        stages.append(("policy", lambda x, seed: rand_augment(x, seed, spec, ops, fill)))
    elif cfg.trivial_augment:
        stages.append(("policy", trivial_augment_wide))
    if cfg.erasing_prob > 0:
        stages.append(("erasing", lambda x, seed: random_erasing(
            x, seed, cfg.erasing_prob, cfg.erasing_area, cfg.erasing_min_aspect, cfg.erasing_mode, mean, std)))
    return stages


# ----------------------------------------------------------------------------- random draws

def random_bits(seed, shape) -> tf.Tensor:
    """Philox's raw uint32 bits for a [2] int seed.

    The seed's 128 bits go through one Philox call to become the key and counter
    (what tf.random's Python-side scrambling does, in ~50 ops; TF's
    StatelessRandomGetKeyCounter instead picks per device, so XLA would draw
    differently). A handful of ops a draw keeps the traced graph and its XLA compile small.
    """
    words = tf.bitcast(tf.cast(seed, tf.int64), tf.uint64)
    key, counter = words[:1], tf.stack([words[1], tf.constant(0, tf.uint64)])
    mixed = tf.raw_ops.StatelessRandomUniformFullIntV2(shape=[3], key=key, counter=counter, alg=_PHILOX,
                                                       dtype=tf.uint64)
    return tf.raw_ops.StatelessRandomUniformFullIntV2(shape=shape, key=mixed[:1], counter=mixed[1:], alg=_PHILOX,
                                                      dtype=tf.uint32)


def uniform(seed, shape, low=0.0, high=1.0) -> tf.Tensor:
    """Uniform floats in [low, high) from the top 24 random bits (identical with and without XLA)."""
    unit = tf.cast(tf.bitwise.right_shift(random_bits(seed, shape), 8), tf.float32) * (2.0 ** -24)
    return low + (high - low) * unit


def uniforms(seed, shape, k: int) -> list[tf.Tensor]:
    """k independent uniform [0, 1) tensors of `shape` from one draw."""
    return tf.unstack(uniform(seed, tf.concat([[k], tf.cast(shape, tf.int32)], 0)), num=k)


def box_muller(u1, u2) -> tf.Tensor:
    """A standard normal from two uniforms (XLA and TF agree to an ulp; TF's own normal differs under XLA)."""
    return tf.sqrt(-2.0 * tf.math.log(1.0 - u1)) * tf.cos((2.0 * math.pi) * u2)


def normal(seed, shape) -> tf.Tensor:
    return box_muller(*uniforms(seed, shape, 2))


def random_sign(seed, shape) -> tf.Tensor:
    """+1 or -1 with equal chance (timm's _randomly_negate, torchvision's signed magnitudes)."""
    return tf.where(uniform(seed, shape) > 0.5, -1.0, 1.0)


def random_index(seed, shape, n) -> tf.Tensor:
    """Uniform integers in [0, n) (numpy's randint(0, n)); `n` an int or an int32 tensor of `shape`."""
    n = tf.cast(n, tf.int32)
    return tf.minimum(tf.cast(tf.floor(uniform(seed, shape) * tf.cast(n, tf.float32)), tf.int32), n - 1)


_GAMMA_TRIES = 12


def log_gamma_sample(seed, shape, alpha: float) -> tf.Tensor:
    """log of Gamma(alpha, 1) samples, by Marsaglia-Tsang with a fixed number of tries.

    TensorFlow's stateless gamma (StatelessRandomGammaV3) has no XLA kernel; this
    uses only uniform and normal draws. Each try is accepted with probability
    > 0.95, so 12 tries all fail about once in 1e15 (then the mode is returned).
    alpha < 1 uses the boost Gamma(a) = Gamma(a + 1) * U^(1/a), kept in log space
    so that small alphas (Mixup's 0.2) do not underflow to 0.
    """
    boosted = alpha < 1.0
    a = alpha + 1.0 if boosted else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    u1, u2, u, boost = uniforms(seed, list(shape) + [_GAMMA_TRIES], 4)
    z = box_muller(u1, u2)
    v = (1.0 + c * z) ** 3
    safe_v = tf.maximum(v, 1e-30)
    accepted = (v > 0) & (tf.math.log(u) < 0.5 * z * z + d - d * safe_v + d * tf.math.log(safe_v))
    first = tf.argmax(tf.cast(accepted, tf.int32), axis=-1, output_type=tf.int32)
    chosen_v = tf.gather(safe_v, first, batch_dims=len(shape))
    chosen_v = tf.where(tf.reduce_any(accepted, -1), chosen_v, 1.0)
    log_g = tf.math.log(d) + tf.math.log(chosen_v)
    if boosted:
        log_g += tf.math.log(tf.maximum(boost[..., 0], 1e-37)) / alpha
    return log_g


def beta_sample(seed, shape, alpha: float) -> tf.Tensor:
    """Beta(alpha, alpha) = X / (X + Y) for X, Y ~ Gamma(alpha), as sigmoid(log X - log Y); XLA-compatible."""
    log_xy = log_gamma_sample(seed, list(shape) + [2], alpha)
    return tf.sigmoid(log_xy[..., 0] - log_xy[..., 1])


# ----------------------------------------------------------------------------- Mixup / CutMix (timm mixup.py)

def mixup_cutmix(images, targets, seed, mixup_alpha: float, cutmix_alpha: float, mix_prob: float,
                 switch_prob: float, mode: str = "elem") -> tuple[tf.Tensor, tf.Tensor]:
    """timm's Mixup: each image mixed with the reversed batch; targets weighted by the real mixed fractions."""
    batch = tf.shape(images)[0]
    draws = batch if mode == "elem" else 1
    params_seed, box_seed = split_seed(seed, 2)
    lam, use_cutmix = mix_params(params_seed, draws, mixup_alpha, cutmix_alpha, mix_prob, switch_prob)
    lam, use_cutmix = tf.broadcast_to(lam, [batch]), tf.broadcast_to(use_cutmix, [batch])
    partner = tf.reverse(images, axis=[0])
    box, cut_lam = cutmix_box(box_seed, tf.shape(images), lam, per_image=mode == "elem")
    mixed = tf.where(use_cutmix[:, None, None, None], tf.where(box, partner, images), blend(images, partner, lam))
    lam = tf.where(use_cutmix, cut_lam, lam)
    return mixed, lam[:, None] * targets + (1.0 - lam[:, None]) * tf.reverse(targets, axis=[0])


def mix_params(seed, n, mixup_alpha: float, cutmix_alpha: float, mix_prob: float, switch_prob: float):
    """timm's _params_per_elem: lambda [n] (1 where not mixed) and whether CutMix is used [n]."""
    switch_seed, mixup_seed, cutmix_seed, apply_seed = split_seed(seed, 4)
    if mixup_alpha > 0 and cutmix_alpha > 0:
        use_cutmix = uniform(switch_seed, [n]) < switch_prob
        lam = tf.where(use_cutmix, beta_sample(cutmix_seed, [n], cutmix_alpha),
                       beta_sample(mixup_seed, [n], mixup_alpha))
    elif mixup_alpha > 0:
        use_cutmix = tf.zeros([n], tf.bool)
        lam = beta_sample(mixup_seed, [n], mixup_alpha)
    else:
        use_cutmix = tf.ones([n], tf.bool)
        lam = beta_sample(cutmix_seed, [n], cutmix_alpha)
    apply = uniform(apply_seed, [n]) < mix_prob
    return tf.where(apply, lam, 1.0), use_cutmix


def blend(images, partner, lam) -> tf.Tensor:
    """Mixup's pixels, rounded to uint8 levels as timm's FastCollateMixup does."""
    lam = lam[:, None, None, None]
    return tf.round(images * lam + partner * (1.0 - lam))


def cutmix_box(seed, image_shape, lam, per_image: bool = True) -> tuple[tf.Tensor, tf.Tensor]:
    """timm's rand_bbox + correct_lam: a box of side sqrt(1 - lam) around a uniform centre, clipped to the image.

    Returns the box as a mask [B, H, W, 1] and lambda recomputed from the clipped
    box's real pixel count, which is what the targets must use.
    """
    batch, height, width = image_shape[0], image_shape[1], image_shape[2]
    h, w = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
    ratio = tf.sqrt(1.0 - lam)
    cut_h, cut_w = tf.cast(tf.floor(h * ratio), tf.int32), tf.cast(tf.floor(w * ratio), tf.int32)
    draws = batch if per_image else 1
    y_seed, x_seed = split_seed(seed, 2)
    cy = tf.broadcast_to(random_index(y_seed, [draws], height), [batch])
    cx = tf.broadcast_to(random_index(x_seed, [draws], width), [batch])
    top, bottom = tf.clip_by_value(cy - cut_h // 2, 0, height), tf.clip_by_value(cy + cut_h // 2, 0, height)
    left, right = tf.clip_by_value(cx - cut_w // 2, 0, width), tf.clip_by_value(cx + cut_w // 2, 0, width)
    mask = box_mask(height, width, top, bottom, left, right)
    area = tf.cast((bottom - top) * (right - left), tf.float32)
    return mask, 1.0 - area / (h * w)


def box_mask(height, width, top, bottom, left, right) -> tf.Tensor:
    """[B, H, W, 1] booleans, true inside rows [top, bottom) and columns [left, right) of each image."""
    rows = tf.range(height)[None, :, None, None]
    cols = tf.range(width)[None, None, :, None]
    t, b, l, r = (v[:, None, None, None] for v in (top, bottom, left, right))
    return (rows >= t) & (rows < b) & (cols >= l) & (cols < r)


# ----------------------------------------------------------------------------- random erasing (timm)

_ERASING_ATTEMPTS = 10  # timm tries 10 boxes and erases nothing if none fits


def random_erasing(images, seed, prob: float, area=(0.02, 1 / 3), min_aspect: float = 0.3, mode: str = "pixel",
                   mean=IMAGENET_MEAN, std=IMAGENET_STD) -> tf.Tensor:
    """timm's RandomErasing (count=1), per image, on 0..255 pixels.

    timm erases after normalization with N(0, 1) noise; in pixel units that is
    mean + std * N(0, 1) per channel, clipped to 0..255 because the batch stays uint8.
    """
    shape = tf.shape(images)
    batch, height, width = shape[0], shape[1], shape[2]
    apply_seed, area_seed, aspect_seed, top_seed, left_seed, fill_seed = split_seed(seed, 6)
    h, w = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
    target = uniform(area_seed, [batch, _ERASING_ATTEMPTS], area[0], area[1]) * h * w
    aspect = tf.exp(uniform(aspect_seed, [batch, _ERASING_ATTEMPTS], math.log(min_aspect), -math.log(min_aspect)))
    box_h = tf.cast(tf.round(tf.sqrt(target * aspect)), tf.int32)
    box_w = tf.cast(tf.round(tf.sqrt(target / aspect)), tf.int32)
    fits = (box_w < width) & (box_h < height)
    first = tf.argmax(tf.cast(fits, tf.int32), axis=1, output_type=tf.int32)
    box_h, box_w = tf.gather(box_h, first, batch_dims=1), tf.gather(box_w, first, batch_dims=1)
    erase = tf.reduce_any(fits, axis=1) & (uniform(apply_seed, [batch]) < prob)
    top = random_index(top_seed, [batch], height - box_h + 1)
    left = random_index(left_seed, [batch], width - box_w + 1)
    mask = box_mask(height, width, top, top + box_h, left, left + box_w) & erase[:, None, None, None]
    return tf.where(mask, erasing_fill(fill_seed, shape, mode, mean, std), images)


def erasing_fill(seed, shape, mode: str, mean, std) -> tf.Tensor:
    """timm's 'pixel' (per-pixel normal), 'rand' (one normal colour per image) or 'const' (0 = the mean) fill."""
    mean, std = tf.constant(mean, tf.float32), tf.constant(std, tf.float32)
    if mode == "pixel":
        noise = normal(seed, shape)
    elif mode == "rand":
        noise = normal(seed, tf.stack([shape[0], 1, 1, shape[3]]))
    else:
        noise = tf.zeros([1, 1, 1, 3])
    return tf.clip_by_value(tf.round(mean + std * noise), 0.0, 255.0)


# ----------------------------------------------------------------------------- colour jitter (torchvision)

def color_jitter(images, seed, brightness: float, contrast: float, saturation: float, hue: float,
                 random_order: bool = True) -> tf.Tensor:
    """torchvision's ColorJitter with per-image factors and (optionally) a per-image order of the four ops."""
    seeds = split_seed(seed, 5)
    batch = tf.shape(images)[0]
    ranges = ((adjust_brightness, brightness, max(0.0, 1.0 - brightness), 1.0 + brightness),
              (adjust_contrast, contrast, max(0.0, 1.0 - contrast), 1.0 + contrast),
              (adjust_saturation, saturation, max(0.0, 1.0 - saturation), 1.0 + saturation),
              (adjust_hue, hue, -hue, hue))
    ops = [(fn, uniform(seeds[i], [batch], low, high)) for i, (fn, amount, low, high) in enumerate(ranges)
           if amount > 0]
    order = per_image_order(seeds[4], batch, len(ops), random_order)
    x = images
    for position in range(len(ops)):
        x = select_per_image(order[:, position], [lambda x=x, fn=fn, f=f: truncate_levels(fn(x, f)) for fn, f in ops],
                             x)
    return x


def per_image_order(seed, batch, n: int, random_order: bool) -> tf.Tensor:
    """[B, n]: the order in which each image gets the n ops (a random permutation each, or 0..n-1)."""
    if not random_order:
        return tf.broadcast_to(tf.range(n)[None], tf.stack([batch, n]))
    return tf.cast(tf.argsort(uniform(seed, tf.stack([batch, n])), axis=1), tf.int32)


def select_per_image(choice, candidates: list[Callable[[], tf.Tensor]], default) -> tf.Tensor:
    """Image i of candidates[choice[i]]() (default where choice matches none): a per-image switch, vectorized."""
    out = default
    for k, make in enumerate(candidates):
        out = tf.where(tf.equal(choice, k)[:, None, None, None], make(), out)
    return out


def grayscale(x) -> tf.Tensor:
    """ITU-R 601-2 luma, as PIL's convert('L') and torchvision's rgb_to_grayscale: [B, H, W, 1]."""
    return tf.reduce_sum(x * tf.constant([0.299, 0.587, 0.114]), axis=-1, keepdims=True)


def _per_image(v) -> tf.Tensor:
    return tf.reshape(v, [-1, 1, 1, 1])


def blend_with(degenerate, x, factor) -> tf.Tensor:
    """PIL's ImageEnhance / torchvision's _blend: degenerate + factor * (x - degenerate), clipped to 0..255."""
    return tf.clip_by_value(degenerate + _per_image(factor) * (x - degenerate), 0.0, 255.0)


def adjust_brightness(x, factor) -> tf.Tensor:
    return blend_with(tf.zeros_like(x), x, factor)


def adjust_contrast(x, factor) -> tf.Tensor:
    """Blend with the image's mean grey level (PIL rounds it to an integer)."""
    mean = tf.floor(tf.reduce_mean(tf.round(grayscale(x)), axis=[1, 2, 3], keepdims=True) + 0.5)
    return blend_with(mean, x, factor)


def adjust_saturation(x, factor) -> tf.Tensor:
    return blend_with(tf.round(grayscale(x)), x, factor)


def adjust_hue(x, delta) -> tf.Tensor:
    """Rotate the hue by `delta` turns (torchvision adjust_hue), per image."""
    hsv = tf.image.rgb_to_hsv(x / 255.0)
    hue = tf.math.floormod(hsv[..., :1] + _per_image(delta), 1.0)
    return tf.image.hsv_to_rgb(tf.concat([hue, hsv[..., 1:]], -1)) * 255.0


# ----------------------------------------------------------------------------- image ops (PIL's maths)

def adjust_sharpness(x, factor) -> tf.Tensor:
    """PIL's ImageFilter.SMOOTH (3x3, centre 5, total 13) as the degenerate image; the 1-pixel border is kept."""
    kernel = np.tile(np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32)[:, :, None, None] / 13.0, [1, 1, 3, 1])
    smooth = tf.round(tf.nn.depthwise_conv2d(x, kernel, [1, 1, 1, 1], "VALID"))
    degenerate = x + tf.pad(smooth - x[:, 1:-1, 1:-1, :], [[0, 0], [1, 1], [1, 1], [0, 0]])
    return blend_with(degenerate, x, factor)


def auto_contrast(x, _arg=None) -> tf.Tensor:
    """Stretch each channel to 0..255 (PIL's ImageOps.autocontrast, cutoff 0)."""
    low = tf.reduce_min(x, axis=[1, 2], keepdims=True)
    high = tf.reduce_max(x, axis=[1, 2], keepdims=True)
    scale = 255.0 / tf.maximum(high - low, 1.0)
    return tf.where(high > low, tf.clip_by_value(tf.floor((x - low) * scale + 1e-3), 0.0, 255.0), x)


def equalize(x, _arg=None) -> tf.Tensor:
    """PIL's ImageOps.equalize per channel: lut[i] = (step // 2 + pixels below i) // step.

    step = (pixels - count of the brightest present level) // 255 (torchvision's
    tensor equalize too); a channel with step 0 (one level, or nearly) is left alone.
    """
    shape = tf.shape(x)
    batch, pixels = shape[0], shape[1] * shape[2]
    levels = tf.transpose(tf.reshape(tf.cast(x, tf.int32), [batch, pixels, 3]), [0, 2, 1])  # [B, 3, HW]
    channel = tf.range(batch * 3)[:, None]
    ids = tf.reshape(channel * 256 + tf.reshape(levels, [batch * 3, pixels]), [-1])
    hist = tf.reshape(tf.math.unsorted_segment_sum(tf.ones_like(ids), ids, batch * 3 * 256), [batch, 3, 256])
    brightest = tf.gather(hist, tf.reduce_max(levels, axis=2), batch_dims=2)
    step = (pixels - brightest) // 255
    cum = tf.cumsum(hist, axis=2, exclusive=True)
    lut = tf.minimum((step[..., None] // 2 + cum) // tf.maximum(step[..., None], 1), 255)
    mapped = tf.gather(lut, levels, batch_dims=2)
    out = tf.where(step[..., None] > 0, mapped, levels)
    return tf.cast(tf.reshape(tf.transpose(out, [0, 2, 1]), shape), tf.float32)


def invert(x, _arg=None) -> tf.Tensor:
    return 255.0 - x


def posterize(x, bits) -> tf.Tensor:
    """Keep the `bits` most significant bits (8 or more: unchanged, as timm)."""
    step = _per_image(tf.pow(2.0, 8.0 - tf.minimum(tf.cast(bits, tf.float32), 8.0)))
    return tf.floor(x / step) * step


def solarize(x, threshold) -> tf.Tensor:
    """Invert the levels at or above `threshold`."""
    return tf.where(x >= _per_image(threshold), 255.0 - x, x)


def solarize_add(x, add) -> tf.Tensor:
    """timm's solarize_add: levels below 128 get `add`, capped at 255."""
    return tf.where(x < 128.0, tf.minimum(x + _per_image(add), 255.0), x)


def identity(x, _arg=None) -> tf.Tensor:
    return x


# Pixel ops: fn(images float [B,H,W,3], arg [B]) -> images. The arg is the op's own parameter (factor, bits...).
PIXEL_OPS: dict[str, Callable] = {
    "Identity": identity, "AutoContrast": auto_contrast, "Equalize": equalize, "Invert": invert,
    "Posterize": posterize, "Solarize": solarize, "SolarizeAdd": solarize_add, "Color": adjust_saturation,
    "Contrast": adjust_contrast, "Brightness": adjust_brightness, "Sharpness": adjust_sharpness,
}


def _affine_rows(*rows) -> tf.Tensor:
    """[B, 6] PIL affine coefficients (a, b, c, d, e, f) from per-image columns or scalars."""
    batch = next(r for r in rows if not isinstance(r, (int, float)))
    return tf.stack([tf.broadcast_to(tf.cast(r, tf.float32), tf.shape(batch)) for r in rows], axis=1)


def shear_x(arg, height, width) -> tf.Tensor:
    return _affine_rows(1.0, arg, 0.0, 0.0, 1.0, 0.0)


def shear_y(arg, height, width) -> tf.Tensor:
    return _affine_rows(1.0, 0.0, 0.0, arg, 1.0, 0.0)


def translate_x(pixels, height, width) -> tf.Tensor:
    return _affine_rows(1.0, 0.0, pixels, 0.0, 1.0, 0.0)


def translate_y(pixels, height, width) -> tf.Tensor:
    return _affine_rows(1.0, 0.0, 0.0, 0.0, 1.0, pixels)


def rotate(degrees, height, width) -> tf.Tensor:
    """PIL's Image.rotate: counter-clockwise about the centre."""
    angle = -degrees * (math.pi / 180.0)
    cos, sin = tf.cos(angle), tf.sin(angle)
    cx, cy = tf.cast(width, tf.float32) / 2.0, tf.cast(height, tf.float32) / 2.0
    return _affine_rows(cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy)


# Geometric ops: fn(arg [B], H, W) -> [B, 6] PIL affine coefficients; all of one layer share one warp.
AFFINE_OPS: dict[str, Callable] = {
    "ShearX": shear_x, "ShearY": shear_y, "TranslateX": translate_x, "TranslateY": translate_y, "Rotate": rotate,
}


def warp_affine(images, coeffs, fill, interpolation: str = "bilinear") -> tf.Tensor:
    """PIL's Image.transform(AFFINE): output pixel centre (x, y) samples the input at (ax+by+c, dx+ey+f).

    Samples whose position falls outside the input take `fill`, as PIL does;
    written with gathers so that it compiles with XLA (ImageProjectiveTransformV3 does not).
    """
    shape = tf.shape(images)
    batch, height, width = shape[0], shape[1], shape[2]
    h, w = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
    ys, xs = tf.meshgrid(tf.range(h) + 0.5, tf.range(w) + 0.5, indexing="ij")
    a, b, c, d, e, f = (coeffs[:, i, None, None] for i in range(6))
    u, v = a * xs + b * ys + c, d * xs + e * ys + f  # [B, H, W], input coordinates (pixel centres at +0.5)
    inside = ((u >= 0) & (u < w) & (v >= 0) & (v < h))[..., None]
    flat = tf.reshape(images, [-1, 3])
    base = (tf.range(batch) * height * width)[:, None, None, None]
    if interpolation == "nearest":
        x0, y0, dx, dy = tf.floor(u), tf.floor(v), [0], [0]
    else:
        x0, y0, dx, dy = tf.floor(u - 0.5), tf.floor(v - 0.5), [0, 1, 0, 1], [0, 0, 1, 1]
    ix = tf.clip_by_value(tf.cast(x0, tf.int32)[..., None] + dx, 0, width - 1)
    iy = tf.clip_by_value(tf.cast(y0, tf.int32)[..., None] + dy, 0, height - 1)
    corners = tf.gather(flat, base + iy * width + ix)  # [B, H, W, corners, 3]
    if interpolation == "nearest":
        sampled = corners[..., 0, :]
    else:
        wx, wy = u - 0.5 - x0, v - 0.5 - y0
        weights = tf.stack([(1 - wx) * (1 - wy), wx * (1 - wy), (1 - wx) * wy, wx * wy], axis=-1)
        sampled = tf.reduce_sum(corners * weights[..., None], axis=3)
    return tf.where(inside, sampled, tf.constant(fill, tf.float32))


def apply_ops_per_image(images, op_names: tuple[str, ...], choice, args, fill, interpolation: str) -> tf.Tensor:
    """Image i gets op_names[choice[i]] with args[i] (choice -1: unchanged); one warp serves all geometric ops."""
    shape = tf.shape(images)
    identity_coeffs = _affine_rows(1.0, 0.0, 0.0, 0.0, 1.0, 0.0 * args)
    coeffs, geometric = identity_coeffs, tf.zeros_like(choice, tf.bool)
    for k, name in enumerate(op_names):
        if name in AFFINE_OPS:
            chosen = tf.equal(choice, k)
            coeffs = tf.where(chosen[:, None], AFFINE_OPS[name](args, shape[1], shape[2]), coeffs)
            geometric |= chosen
    out = images
    if any(name in AFFINE_OPS for name in op_names):
        out = tf.where(geometric[:, None, None, None],
                       truncate_levels(warp_affine(images, coeffs, fill, interpolation)), images)
    pixel_ops = [(k, PIXEL_OPS[name]) for k, name in enumerate(op_names) if name in PIXEL_OPS]
    for k, fn in pixel_ops:
        out = tf.where(tf.equal(choice, k)[:, None, None, None], truncate_levels(fn(images, args)), out)
    return out


# ----------------------------------------------------------------------------- RandAugment (timm)

def timm_runs(name: str) -> str:
    """The image op behind a timm RandAugment name (variants differ only in their magnitude mapping)."""
    return name.removesuffix("Increasing").removesuffix("Rel")


def timm_arg(name: str, magnitude, sign, height, width) -> tf.Tensor:
    """timm's LEVEL_TO_ARG: the op's argument [B] for a magnitude on the 0..10 scale."""
    level = magnitude / 10.0
    if name == "Rotate":
        return level * 30.0 * sign  # degrees
    if name in ("ShearX", "ShearY"):
        return level * 0.3 * sign
    if name in ("TranslateXRel", "TranslateYRel"):
        size = tf.cast(width if name == "TranslateXRel" else height, tf.float32)
        return level * 0.45 * sign * size  # pixels
    if name == "Posterize":
        return tf.floor(level * 4.0)  # bits kept
    if name == "PosterizeIncreasing":
        return 4.0 - tf.floor(level * 4.0)
    if name == "Solarize":
        return tf.floor(level * 256.0)  # threshold
    if name == "SolarizeIncreasing":
        return 256.0 - tf.floor(level * 256.0)
    if name == "SolarizeAdd":
        return tf.floor(level * 110.0)
    if name.endswith("Increasing"):  # Color, Contrast, Brightness, Sharpness: factor, 1 = unchanged
        return tf.maximum(0.1, 1.0 + sign * level * 0.9)
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return level * 1.8 + 0.1
    return tf.zeros_like(magnitude)  # AutoContrast, Equalize, Invert take none


def rand_augment_plan(seed, batch, spec: RandAugmentSpec, num_ops_available: int) -> dict[str, tf.Tensor]:
    """Every random choice of timm's RandAugment, per image and layer ([B, N] each).

    op: index into the op list (uniform, with replacement across layers);
    applied: each chosen op runs with probability p (timm's AugmentOp prob 0.5);
    magnitude: m, with N(m, mstd) noise (uniform [0, m] for mstd inf), clipped to [0, mmax];
    sign: the random negation of signed ops.
    """
    op_seed, apply_seed, noise_seed, sign_seed = split_seed(seed, 4)
    shape = tf.stack([batch, spec.num_ops])
    magnitude = tf.fill(shape, float(spec.magnitude))
    if math.isinf(spec.magnitude_std):
        magnitude = uniform(noise_seed, shape, 0.0, float(spec.magnitude))
    elif spec.magnitude_std > 0:
        magnitude += spec.magnitude_std * normal(noise_seed, shape)
    return {
        "op": random_index(op_seed, shape, num_ops_available),
        "applied": uniform(apply_seed, shape) < spec.prob,
        "magnitude": tf.clip_by_value(magnitude, 0.0, float(spec.magnitude_max)),
        "sign": random_sign(sign_seed, shape),
    }


def rand_augment(images, seed, spec: RandAugmentSpec, op_names=RAND_AUGMENT_OPS, fill=(124.0, 116.0, 104.0),
                 plan: dict | None = None) -> tf.Tensor:
    """timm's RandAugment: N layers, in each every image its own op, magnitude, sign and apply-or-not."""
    shape = tf.shape(images)
    plan = plan or rand_augment_plan(seed, shape[0], spec, len(op_names))
    runnable = sorted({timm_runs(name) for name in op_names})
    for layer in range(spec.num_ops):
        op, applied = plan["op"][:, layer], plan["applied"][:, layer]
        magnitude, sign = plan["magnitude"][:, layer], plan["sign"][:, layer]
        choice = tf.fill([shape[0]], -1)
        args = tf.zeros([shape[0]])
        for k, name in enumerate(op_names):
            chosen = tf.equal(op, k) & applied
            choice = tf.where(chosen, runnable.index(timm_runs(name)), choice)
            args = tf.where(chosen, timm_arg(name, magnitude, sign, shape[1], shape[2]), args)
        images = apply_ops_per_image(images, tuple(runnable), choice, args, fill, "bilinear")
    return images


# ----------------------------------------------------------------------------- TrivialAugmentWide (torchvision)

TRIVIAL_AUGMENT_BINS = 31
# torchvision's _augmentation_space for TrivialAugmentWide: (op, magnitudes over the bins, signed).
_WIDE = np.linspace
TRIVIAL_AUGMENT_WIDE_SPACE = (
    ("Identity", np.zeros(1), False),
    ("ShearX", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("ShearY", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("TranslateX", _WIDE(0.0, 32.0, TRIVIAL_AUGMENT_BINS), True),
    ("TranslateY", _WIDE(0.0, 32.0, TRIVIAL_AUGMENT_BINS), True),
    ("Rotate", _WIDE(0.0, 135.0, TRIVIAL_AUGMENT_BINS), True),
    ("Brightness", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("Color", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("Contrast", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("Sharpness", _WIDE(0.0, 0.99, TRIVIAL_AUGMENT_BINS), True),
    ("Posterize", 8 - np.round(np.arange(TRIVIAL_AUGMENT_BINS) / ((TRIVIAL_AUGMENT_BINS - 1) / 6)), False),
    ("Solarize", _WIDE(255.0, 0.0, TRIVIAL_AUGMENT_BINS), False),
    ("AutoContrast", np.zeros(1), False),
    ("Equalize", np.zeros(1), False),
)


def trivial_augment_plan(seed, batch) -> dict[str, tf.Tensor]:
    """torchvision's draws, per image: op uniform over the 14, magnitude bin uniform over that op's bins, sign."""
    op_seed, bin_seed, sign_seed = split_seed(seed, 3)
    return {"op": random_index(op_seed, [batch], len(TRIVIAL_AUGMENT_WIDE_SPACE)),
            "bin": random_index(bin_seed, [batch], TRIVIAL_AUGMENT_BINS),
            "sign": random_sign(sign_seed, [batch])}


def trivial_augment_arg(name: str, magnitudes: np.ndarray, signed: bool, plan) -> tf.Tensor:
    """The op's argument from its bin: torchvision's _apply_op (enhance ops: 1 + m; translate: int pixels)."""
    m = tf.gather(tf.constant(magnitudes, tf.float32), tf.minimum(plan["bin"], len(magnitudes) - 1))
    if signed:
        m *= plan["sign"]
    if name in ("Brightness", "Color", "Contrast", "Sharpness"):
        return 1.0 + m
    if name in ("TranslateX", "TranslateY"):
        return tf.sign(m) * tf.floor(tf.abs(m))
    return m


def trivial_augment_wide(images, seed, plan: dict | None = None) -> tf.Tensor:
    """torchvision's TrivialAugmentWide, one op per image (nearest interpolation, black fill, as its defaults)."""
    plan = plan or trivial_augment_plan(seed, tf.shape(images)[0])
    names = tuple(name for name, _, _ in TRIVIAL_AUGMENT_WIDE_SPACE)
    args = tf.zeros(tf.shape(plan["op"]), tf.float32)
    for k, (name, magnitudes, signed) in enumerate(TRIVIAL_AUGMENT_WIDE_SPACE):
        args = tf.where(tf.equal(plan["op"], k), trivial_augment_arg(name, magnitudes, signed, plan), args)
    return apply_ops_per_image(images, names, plan["op"], args, (0.0, 0.0, 0.0), "nearest")
