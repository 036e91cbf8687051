"""Which image size each epoch trains at, and which size evaluation uses: plain numbers from `DataConfig`.

Progressive resizing (FFCV's ResNet recipes) trains the early epochs on small
images, which are cheap, and raises the size to `data.image_size` over
`data.progressive_start_epoch`..`data.progressive_end_epoch`; evaluation may
run at a size of its own (`data.eval_image_size`: FixRes, Touvron et al.
2019: a network trained on random-resized crops sees objects larger than in
a central crop of the same size, so it tests best above its training size).
No TensorFlow here: the config's validation uses it too.
"""

from __future__ import annotations


def train_image_size(data, epoch: int) -> int:
    """The side of the training crops in `epoch` (0-based), by FFCV's `get_resolution`.

    Up to the start epoch the minimum, from the end epoch `data.image_size`,
    in between the linear interpolation rounded to a multiple of
    `data.progressive_step` (FFCV: 32), as numpy rounds it (half to even).
    With `data.progressive_min_size` 0 every epoch trains at `data.image_size`.
    """
    low, high = data.progressive_min_size, data.image_size
    start, end = data.progressive_start_epoch, data.progressive_end_epoch
    if not low:
        return high
    if epoch <= start:
        return low
    if epoch >= end:
        return high
    slope = (high - low) / (end - start)  # np.interp's arithmetic, so a tie rounds as FFCV's does
    interpolated = slope * (epoch - start) + low
    return round(interpolated / data.progressive_step) * data.progressive_step  # half to even, as np.round


def eval_image_size(data) -> int:
    """The side of the evaluation crops: `data.eval_image_size`, or (0) the training size `data.image_size`."""
    return data.eval_image_size or data.image_size


def ramp_sizes(data) -> list[int]:
    """The training size of every epoch up to the end of the ramp (all later ones train at `data.image_size`)."""
    last = data.progressive_end_epoch if data.progressive_min_size else 0
    return [train_image_size(data, epoch) for epoch in range(last + 1)]


def image_sizes(data) -> set[int]:
    """Every size the model may see: each epoch's training size and the evaluation size."""
    return {*ramp_sizes(data), data.image_size, eval_image_size(data)}


def variable_size(data) -> bool:
    """Whether the model must take more than one image size (progressive resizing or FixRes)."""
    return len(image_sizes(data)) > 1


def size_runs(data, first: int, last: int) -> list[tuple[int, int, int]]:
    """(first epoch, end epoch, size) for each run of consecutive epochs in [first, last) at one size."""
    runs: list[tuple[int, int, int]] = []
    for epoch in range(first, last):
        size = train_image_size(data, epoch)
        if runs and runs[-1][2] == size:
            runs[-1] = (runs[-1][0], epoch + 1, size)
        else:
            runs.append((epoch, epoch + 1, size))
    return runs

