"""The transformers train as exactly as the ResNets: the same training on 1 replica and on 2.

The small ViT, `vit_mini_patch4_small` (4 blocks of width 64, 4 px patches) at 16 px, with AdamW and weight decay
off the norms, biases, position embedding and class token (`optimizer.decay_norm_and_bias: false`), as its
recipes. Its LayerNorms, unlike batch norm, do not depend on how the batch is cut, nor do ConvNeXt's: timm's
`convnext_atto` is stepped on 2 replicas by tests/models/test_models.py. A run killed with `kill -9` resumes bit
for bit with drop path, the layer of every family's residual branches: tests/train/test_resume.py.
"""

import numpy as np
import pytest

from support.fixed_steps import train_fixed_batches
from tfdp.config import validate

STEPS = 6
GLOBAL_BATCH = 32
# (registry name, image size): the smallest real ViT
MODELS = [("vit_mini_patch4_small", 16)]


def make_cfg(digits_dir, replicas, model, size):
    return validate({
        # No random flip (the model's first layer) and no drop path: every layout must see the same pixels
        # and keep every branch.
        "data": {"format": "image_folder", "dir": digits_dir, "image_size": size, "eval_crop_fraction": 1.0,
                 "hflip": False},
        "model": {"name": model},
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.05, "decay_norm_and_bias": False},
        "train": {"batch_size_per_replica": GLOBAL_BATCH // replicas, "epochs": 1, "seed": 3, "jit_compile": False},
        "distribute": {"strategy": "mirrored", "cpu_replicas": replicas},
    })


@pytest.mark.parametrize("model,size", MODELS)
def test_two_replicas_train_as_one_on_the_same_global_batch(digits_dir, model, size):
    """6 AdamW steps on a fixed sequence of 32-image batches, on 2 replicas of 16 and on 1 of 32, from the same
    weights: the same weights and optimizer moments to float rounding (LayerNorm, unlike batch norm, does not
    depend on how the batch is cut), identical on both replicas."""
    _, two, initial = train_fixed_batches(make_cfg(digits_dir, 2, model, size), STEPS, GLOBAL_BATCH)
    _, one, _ = train_fixed_batches(make_cfg(digits_dir, 1, model, size), STEPS, GLOBAL_BATCH, start=initial)
    assert int(two.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == STEPS
    moved = 0.0
    for a, b, init in zip(two.weights, one.weights, initial):
        copies = a.value.values
        np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy(), err_msg=a.path)
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=a.path)
        moved = max(moved, float(np.abs(a.numpy() - init).max()))
    assert moved > 1e-3  # the weights really trained, so equality is not vacuous
    for a, b in zip(two.optimizer.variables, one.optimizer.variables):  # AdamW's moments and step count
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6, err_msg=a.path)
