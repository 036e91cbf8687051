"""Shared by the multi-worker tests (tests/distribute/test_multi_worker.py, tests/optim/test_accumulation.py):
the small recipe a real cluster on 127.0.0.1 trains, the flags that make every replica layout compute the same
mean gradient, and a checkpoint's weights read back by layer."""

import h5py

# The digits demo with the small model (two convolutions, no batch norm) at 8 px, the digits' own size.
FAST = ["--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=8"]


def deterministic(data_dir):
    """No augmentation randomness, no warmup: every replica layout computes the same mean gradient."""
    return [f"--data_dir={data_dir}", "--data_format=image_folder", "--set=data.min_crop_area=1.0",
            "--set=data.hflip=false", "--set=data.eval_crop_fraction=1.0", "--set=schedule.name=constant",
            "--set=schedule.warmup_epochs=0", "--set=train.label_smoothing=0.0", "--set=optimizer.lr=0.4",
            "--set=optimizer.weight_decay=0.0", "--epochs=4"]


def layer_weights(path):
    """Every dataset under a Keras weights file's `layers` group, by its path."""
    out = {}
    with h5py.File(path) as f:
        f["layers"].visititems(
            lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out
