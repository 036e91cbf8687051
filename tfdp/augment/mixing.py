"""timm's Mixup and CutMix (timm/data/mixup.py) on a batch, and the soft targets they mix."""

from __future__ import annotations

import tensorflow as tf

from tfdp.augment.draws import beta_sample, random_index, split_seed, uniform
from tfdp.augment.geometry import box_mask


def needs_soft_labels(cfg) -> bool:
    """True when Mixup/CutMix mix the targets, so integer labels cannot express them (AugmentConfig or Config).

    `augment` always returns float targets [B, num_classes]; without mixing they
    are (smoothed) one-hot, and their argmax is the integer label.
    """
    a = getattr(cfg, "augment", cfg)
    return (a.mixup_alpha > 0 or a.cutmix_alpha > 0) and a.mix_prob > 0

def smooth_one_hot(labels, num_classes: int, smoothing: float) -> tf.Tensor:
    """timm's targets: on = 1 - s + s/K, off = s/K."""
    labels = tf.cast(tf.reshape(labels, [-1]), tf.int32)
    off = smoothing / num_classes
    return tf.one_hot(labels, num_classes, on_value=1.0 - smoothing + off, off_value=off, dtype=tf.float32)

def mixup_cutmix(images, targets, seed, mixup_alpha: float, cutmix_alpha: float, mix_prob: float,
                 switch_prob: float, mode: str = "elem") -> tuple[tf.Tensor, tf.Tensor]:
    """timm's Mixup: each image mixed with the reversed batch; targets weighted by the real mixed fractions."""
    batch = tf.shape(images)[0]
    draws = batch if mode == "elem" else 1
    params_seed, box_seed = split_seed(seed, 2)
    lam, use_cutmix = mix_params(params_seed, draws, mixup_alpha, cutmix_alpha, mix_prob, switch_prob)
    lam, use_cutmix = tf.broadcast_to(lam, [batch]), tf.broadcast_to(use_cutmix, [batch])
    centre_y, centre_x = box_centres(box_seed, tf.shape(images), per_image=mode == "elem")
    return mix_given(images, targets, lam, use_cutmix, centre_y, centre_x)


def mix_given(images, targets, lam, use_cutmix, centre_y, centre_x) -> tuple[tf.Tensor, tf.Tensor]:
    """timm's FastCollateMixup for given draws: lambda [B], CutMix or not [B] and the box centres [B].

    Image i is mixed with image B-1-i: blended, or the partner's box pasted in;
    the targets are weighted by lambda, for CutMix the clipped box's own.
    """
    partner = tf.reverse(images, axis=[0])
    box, cut_lam = cutmix_box_at(tf.shape(images), lam, centre_y, centre_x)
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
    return cutmix_box_at(image_shape, lam, *box_centres(seed, image_shape, per_image))


def box_centres(seed, image_shape, per_image: bool = True) -> tuple[tf.Tensor, tf.Tensor]:
    """rand_bbox's centres [B] (row, column), uniform over the image; one for the batch unless per_image."""
    batch, height, width = image_shape[0], image_shape[1], image_shape[2]
    draws = batch if per_image else 1
    y_seed, x_seed = split_seed(seed, 2)
    return (tf.broadcast_to(random_index(y_seed, [draws], height), [batch]),
            tf.broadcast_to(random_index(x_seed, [draws], width), [batch]))


def cutmix_box_at(image_shape, lam, cy, cx) -> tuple[tf.Tensor, tf.Tensor]:
    """timm's rand_bbox and correct_lam around given centres: the box mask [B, H, W, 1] and its lambda [B]."""
    height, width = image_shape[1], image_shape[2]
    h, w = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
    ratio = tf.sqrt(1.0 - lam)
    cut_h, cut_w = tf.cast(tf.floor(h * ratio), tf.int32), tf.cast(tf.floor(w * ratio), tf.int32)
    # timm 1.0.31 spans the whole cut: cut // 2 before the centre, (cut + 1) // 2 from it on.
    top = tf.clip_by_value(cy - cut_h // 2, 0, height)
    bottom = tf.clip_by_value(cy + (cut_h + 1) // 2, 0, height)
    left = tf.clip_by_value(cx - cut_w // 2, 0, width)
    right = tf.clip_by_value(cx + (cut_w + 1) // 2, 0, width)
    mask = box_mask(height, width, top, bottom, left, right)
    # The pixels left over an exact integer, one rounding: timm's float64 1 - area / (H * W) stored in float32.
    return mask, tf.cast(height * width - (bottom - top) * (right - left), tf.float32) / (h * w)
