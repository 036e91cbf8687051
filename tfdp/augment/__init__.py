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
timm and torchvision apply to PIL images). Given the same draws, each stage computes
what timm's or torchvision's does (tests/augment/test_references.py; the differences,
op by op, are in docs/recipes.md).

The package, one module per topic (as timm's timm/data/):

  batch.py        build_batch_augment: the switches that are on, composed in timm's order
  policies.py     RandAugment (timm) and TrivialAugmentWide (torchvision), per image
  mixing.py       Mixup/CutMix and the soft targets
  erasing.py      random erasing
  color.py        colour jitter and the pixel ops of the policies (PIL's maths)
  geometry.py     the affine ops and the XLA-compatible warp
  draws.py        the stateless Philox draws, step_seed

RandAugment's string syntax and op lists are configuration (`tfdp.config.rand_augment`, no TensorFlow):
the config validates `augment.rand_augment` with the parser the training step uses. Names are importable
from `tfdp.augment` itself and load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any


# Each public name and the module that defines it.
EXPORTS = {
    "Augment": "batch",
    "build_batch_augment": "batch",
    "to_uint8": "batch",
    "RNG": "draws",
    "step_seed": "draws",
    "split_seed": "draws",
    "random_bits": "draws",
    "uniform": "draws",
    "uniforms": "draws",
    "box_muller": "draws",
    "normal": "draws",
    "random_sign": "draws",
    "random_index": "draws",
    "log_gamma_sample": "draws",
    "beta_sample": "draws",
    "needs_soft_labels": "mixing",
    "smooth_one_hot": "mixing",
    "mixup_cutmix": "mixing",
    "mix_params": "mixing",
    "blend": "mixing",
    "cutmix_box": "mixing",
    "mix_given": "mixing",
    "box_centres": "mixing",
    "cutmix_box_at": "mixing",
    "box_mask": "geometry",
    "random_erasing": "erasing",
    "erasing_fill": "erasing",
    "erasing_box_size": "erasing",
    "erase_box": "erasing",
    "pixels_of_noise": "erasing",
    "truncate_levels": "color",
    "color_jitter": "color",
    "per_image_order": "color",
    "select_per_image": "color",
    "grayscale": "color",
    "blend_with": "color",
    "adjust_brightness": "color",
    "adjust_contrast": "color",
    "adjust_saturation": "color",
    "adjust_hue": "color",
    "adjust_sharpness": "color",
    "auto_contrast": "color",
    "equalize": "color",
    "invert": "color",
    "posterize": "color",
    "solarize": "color",
    "solarize_add": "color",
    "identity": "color",
    "PIXEL_OPS": "color",
    "affine_rows": "geometry",
    "shear_x": "geometry",
    "shear_y": "geometry",
    "translate_x": "geometry",
    "translate_y": "geometry",
    "rotate": "geometry",
    "AFFINE_OPS": "geometry",
    "warp_affine": "geometry",
    "apply_ops_per_image": "policies",
    "timm_runs": "policies",
    "timm_arg": "policies",
    "rand_augment_plan": "policies",
    "rand_augment": "policies",
    "TRIVIAL_AUGMENT_BINS": "policies",
    "TRIVIAL_AUGMENT_WIDE_SPACE": "policies",
    "trivial_augment_plan": "policies",
    "trivial_augment_arg": "policies",
    "trivial_augment_wide": "policies",
    "RAND_AUGMENT_OPS": "tfdp.config.rand_augment",
    "RAND_AUGMENT_INCREASING_OPS": "tfdp.config.rand_augment",
    "RAND_AUGMENT_OP_NAMES": "tfdp.config.rand_augment",
    "RandAugmentSpec": "tfdp.config.rand_augment",
    "parse_rand_augment": "tfdp.config.rand_augment",
}
__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    """PEP 562: `tfdp.augment.X` imports the submodule that defines X when first asked for."""
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = EXPORTS[name]
    value = getattr(importlib.import_module(module if "." in module else f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))
