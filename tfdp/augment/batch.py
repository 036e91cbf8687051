"""The configured augmentations composed into one function the training step runs on each replica's batch."""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tfdp.augment.color import color_jitter
from tfdp.augment.draws import split_seed
from tfdp.augment.erasing import random_erasing
from tfdp.augment.mixing import mixup_cutmix, smooth_one_hot
from tfdp.augment.policies import rand_augment, trivial_augment_wide
from tfdp.config.rand_augment import RAND_AUGMENT_INCREASING_OPS, RAND_AUGMENT_OPS, parse_rand_augment
from tfdp.config import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig

# Stages draw from their own sub-seed, always split the same way, so switching one on leaves the others' draws alone.
_STAGES = ("color_jitter", "policy", "erasing", "mix")

Augment = Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tuple[tf.Tensor, tf.Tensor]]


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

def to_uint8(x) -> tf.Tensor:
    return tf.cast(tf.clip_by_value(tf.round(x), 0.0, 255.0), tf.uint8)

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
