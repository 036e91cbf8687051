"""`data.cache`: whether a worker's share of the data fits in its memory, asked before training starts.

`data.cache: true` keeps the encoded images a worker reads (`tfdp.data.readers.cached`) in memory from the
first epoch on. tf.data grows that cache as the first epoch reads, so a share larger than the memory the
process may still take fails late and silently: the kernel's OOM killer stops the worker at the end of its
first epoch (at a container's or a Slurm job's limit just the same), after an epoch of work. The bytes are
known before: the files' sizes (an image tree's from an even sample of them), each worker holding its
1/workers of every split it caches, against `tfdp.startup.memory.available_memory`.
"""

from __future__ import annotations

import os

from tfdp.data import readers, storage
from tfdp.data.layouts import Split
from tfdp.errors import UserError
from tfdp.startup.memory import available_memory

SAMPLED_FILES = 1000     # an image tree's size is estimated from this many of its files, evenly spaced
PER_EXAMPLE = 448        # bytes tf.data's cache keeps per element beside the encoded ones (measured 300-440, TF 2.21)
GiB = 1 << 30


def cached_bytes(split: Split) -> int:
    """The bytes `data.cache` keeps of the whole split: its files' sizes plus tf.data's per-element cost; 0
    for a split it does not cache (synthetic data). Files are sampled, so a million-image tree costs a
    thousand stats (or none: a bucket's sizes come from its listing)."""
    if not readers.READERS[split.kind].cacheable or not split.files:
        return 0
    sample = split.files[::max(1, len(split.files) // SAMPLED_FILES)]
    if storage.is_remote_url(sample[0]):
        sizes = list(storage.object_sizes(tuple(sample)).values())
    else:
        sizes = [os.path.getsize(path) for path in sample]
    return sum(sizes) * len(split.files) // len(sample) + PER_EXAMPLE * split.num_examples


def check_fits(splits: list[Split], workers: int, on_host: int = 1) -> None:
    """A one-line refusal, before the first step, when a worker's share of `splits` cannot stay in memory.

    Each worker caches its 1/`workers` of each split (records and files are dealt out evenly), in its own
    process; the `on_host` workers sharing this machine (`tfdp launch`, Slurm tasks on one node) fill its memory
    together, and start together: each sees the memory none has taken yet, so each checks their sum."""
    need = sum(cached_bytes(split) for split in splits) // workers
    free = available_memory()
    if free is None or need * on_host <= free:
        return
    names = " and ".join(dict.fromkeys(f"'{split.name}'" for split in splits))
    share = f"this worker's 1/{workers} of " if workers > 1 else ""
    together = f", x{on_host} for the workers on this host" if on_host > 1 else ""
    raise UserError(f"data.cache: keeping {share}{names} in memory takes about {need / GiB:.1f} GiB (the encoded "
                    f"images){together}, but {free / GiB:.1f} GiB is available to this process (the host's memory, "
                    f"or its container's limit): set data.cache: false (the files are then read again each epoch)")
