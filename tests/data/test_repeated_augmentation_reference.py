"""Repeated augmentation against timm 1.0.31's RepeatAugSampler (DeiT's RASampler), given the epoch's permutation.

timm draws each epoch's order with torch.randperm seeded by the epoch; tfdp's order is its own (a stateless
permutation of (seed, epoch) through a shuffle buffer), so the permutation is taken from the fixture
(tests/fixtures/make_augment_fixture.py) and fed to tfdp's repeat-and-deal stages: from there, which indices
each replica sees is timm's, up to the epoch's end, which differs by design (see `test_the_epoch_lengths`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.data import batching, order

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "augment_reference.npz")
# (dataset size, replicas, copies, epoch) as the maker ran timm's sampler; per-replica batch for tfdp's deal.
CASES = {(48, 2, 3, 0): 4, (50, 4, 3, 1): 2, (40, 2, 2, 5): 4, (300, 4, 3, 2): 5}


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURE) as f:
        return {k: f[k] for k in f.files if k.startswith("ra_sampler/")}


def tfdp_replica_streams(permutation: np.ndarray, replicas: int, copies: int, per_replica: int) -> list[np.ndarray]:
    """What each of the replicas of one input pipeline takes in one data epoch whose order is `permutation`:
    tfdp's `order.repeated` (each index `copies` times in a row, cut to the epoch's size) and `batching.replica_batches`
    (each step's block dealt round-robin)."""
    n = len(permutation)
    cfg = DataConfig(repeated_augmentation=copies)
    ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=replicas)
    stream = tf.data.Dataset.from_tensor_slices(permutation.astype(np.int64)).apply(order.repeated(copies, n))
    examples = tf.data.Dataset.zip((tf.data.Dataset.range(n), stream, tf.data.Dataset.range(n)))
    batches = list(batching.replica_batches(examples, cfg, ctx, per_replica * replicas, 0).as_numpy_iterator())
    return [np.concatenate([b[0] for b in batches[r::replicas]]) for r in range(replicas)]


@pytest.mark.parametrize("case", list(CASES))
def test_each_replica_sees_timms_indices_given_the_permutation(ref, case):
    """Replica r takes positions r, r + n, r + 2n ... of the repeated order, as timm's rank r does; so the k
    copies of an image go to k different replicas when there are at least k (DeiT's point), else round."""
    n, replicas, copies, epoch = case
    key = "ra_sampler/{}_{}_{}_{}".format(*case)
    got = tfdp_replica_streams(ref[f"{key}/permutation"], replicas, copies, CASES[case])
    for r in range(replicas):
        want = ref[f"{key}/rank{r}"]
        common = min(len(want), len(got[r]))
        assert common >= len(want) - 1  # tfdp cuts the epoch to whole steps; timm pads it to whole ranks
        np.testing.assert_array_equal(got[r][:common], want[:common])
    if replicas >= copies:  # the copies of one image are on as many different replicas
        seen = np.concatenate(got)
        holders = np.concatenate([np.full(len(g), r) for r, g in enumerate(got)])
        for image in np.unique(seen):
            assert len(set(holders[seen == image])) == (seen == image).sum()


def test_the_epoch_lengths(ref):
    """By design the epochs end differently: timm's per-rank length is ceil(N / world) below 256 images and
    floor(N // 256 * 256 / world) from 256 on (its selected_round), so an epoch of 300 images shows 256; tfdp's
    epoch keeps the data epoch's N (cut to whole steps), continuing the same repeated order past timm's end."""
    assert [len(ref[f"ra_sampler/300_4_3_2/rank{r}"]) for r in range(4)] == [64] * 4
    assert [len(ref[f"ra_sampler/48_2_3_0/rank{r}"]) for r in range(2)] == [24] * 2
    assert [len(ref[f"ra_sampler/50_4_3_1/rank{r}"]) for r in range(4)] == [13] * 4  # 52 > 50: timm pads
    got = tfdp_replica_streams(ref["ra_sampler/300_4_3_2/permutation"], 4, 3, 5)
    assert sum(len(g) for g in got) == 300
    assert len(np.unique(np.concatenate(got))) == 100  # ceil(300 / 3) images, 3 copies each
