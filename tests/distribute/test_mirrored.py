"""Real 2-replica MirroredStrategy on 2 logical CPU devices (split in conftest)."""

import numpy as np
import pytest
import tensorflow as tf

from support.fixed_steps import train_fixed_batches
from tfdp.rundir.checkpoints import CheckpointStore
from tfdp.config import DistributeConfig, validate
from tfdp.distribute.replica_state import ReplicaSnapshot, replica_copies, state_averager
from tfdp.distribute.strategy import make_runtime
from tfdp.train.task import Plan, compile_model

STEPS = 6
GLOBAL_BATCH = 32
# A ResNet with batch norm, the demo's stem, stages and head, one block per stage: the batch-norm tests' model, at
# 8 px (the digits' own size, its smallest input: 8, 4, 2 and 1 px per stage, batch norm over the batch where 1 px
# is left). At 16 px XLA's CPU convolutions make its compiled runs about twice as dear, and prove nothing more.
RESNET = "resnet10_small"
RESNET_SIZE = 8


def make_cfg(digits_dir, replicas, model="simple_cnn", jit_compile=False, lr=0.4, sync_bn=False):
    return validate({
        # No random flip (it is the model's first layer): every configuration must see the same pixels.
        "data": {"format": "image_folder", "dir": digits_dir, "image_size": RESNET_SIZE if model == RESNET else 16,
                 "eval_crop_fraction": 1.0, "hflip": False},
        "model": {"name": model, "sync_bn": sync_bn},
        "optimizer": {"lr": lr, "momentum": 0.9},
        "train": {"batch_size_per_replica": GLOBAL_BATCH // replicas, "epochs": 1, "seed": 3,
                  "jit_compile": jit_compile},
        "distribute": {"strategy": "mirrored", "cpu_replicas": replicas},
    })


def train_steps(digits_dir, replicas, start=None, **kwargs):
    """STEPS steps on a fixed sequence of global batches (`train_fixed_batches`); (runtime, model, initial)."""
    return train_fixed_batches(make_cfg(digits_dir, replicas, **kwargs), STEPS, GLOBAL_BATCH, start)


@pytest.fixture(scope="module")
def two_and_one(digits_dir):
    two = train_steps(digits_dir, 2)
    return two, train_steps(digits_dir, 1, start=two[2])


def test_every_mirrored_variable_is_identical_on_both_replicas(two_and_one):
    (runtime, model, _), _ = two_and_one
    devices = set()
    for var in model.weights + model.optimizer.variables:
        copies = var.value.values
        assert len(copies) == 2
        devices.update(c.device for c in copies)
        np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy(), err_msg=var.path)
    assert len(devices) == 2  # the copies really live on two devices


def test_two_replicas_equal_one_replica_on_the_same_global_batch(two_and_one):
    (_, two, initial), (_, one, _) = two_and_one
    assert int(two.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == STEPS
    moved = 0.0
    for a, b, init in zip(two.weights, one.weights, initial):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=a.path)
        moved = max(moved, float(np.abs(a.numpy() - init).max()))
    assert moved > 1e-3  # the weights really trained, so equality is not vacuous


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_whole_step_xla_trains_like_the_plain_keras_step_with_batch_norm(digits_dir, resnet_two_one, replicas):
    """ResNet with batch norm: tfdp's compiled step (forward, backward and the momentum update in XLA; on 2
    replicas with the gradient all-reduce between) gives the weights, batch-norm statistics and optimizer
    state of Keras' own op-by-op step (the module's plain runs, `resnet_two_one`)."""
    # A moderate learning rate: at 0.4 a deep net amplifies XLA's different rounding within 6 steps.
    _, plain, initial = resnet_two_one[0 if replicas == 2 else 1]
    _, xla, _ = train_steps(digits_dir, replicas, start=initial, model=RESNET, jit_compile=True, lr=0.05)
    forward_backward, whole_step, update = xla.tfdp_step_functions
    ran = [f.experimental_get_tracing_count() > 0 for f in (forward_backward, whole_step, update)]
    assert ran == ([False, True, False] if replicas == 1 else [True, False, True])  # one program, or two
    moved = {}
    for a, b, init in zip(plain.weights, xla.weights, initial):
        # Replica by replica: Keras 3 keeps batch-norm statistics per replica (aggregation NONE),
        # so they may differ between replicas, but must match the plain step's on the same replica.
        for copy_a, copy_b in zip(replica_copies(a), replica_copies(b)):
            np.testing.assert_allclose(copy_b, copy_a, rtol=1e-2, atol=5e-3, err_msg=a.path)
        if b.trainable:
            for copy in replica_copies(b):
                np.testing.assert_array_equal(copy, b.numpy(), err_msg=b.path)  # replicas stay identical
        moved[a.path] = float(np.abs(b.numpy() - init).max())
    assert any("moving_mean" in p and m > 1e-3 for p, m in moved.items())  # batch-norm statistics were updated
    assert max(m for p, m in moved.items() if "kernel" in p) > 1e-3       # and the weights trained
    assert int(xla.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == STEPS
    for a, b in zip(plain.optimizer.variables, xla.optimizer.variables):  # momentum included
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-2, atol=5e-3, err_msg=a.path)


def test_checkpoint_round_trip_restores_weights_and_optimizer_state(two_and_one, tmp_path, digits_dir):
    (runtime, model, _), _ = two_and_one
    store = CheckpointStore(str(tmp_path))
    store.save(model, {"epoch": 1, "best": None})
    cfg = make_cfg(digits_dir, 2)
    with runtime.strategy.scope():
        fresh = compile_model(cfg, Plan(GLOBAL_BATCH, STEPS, 1437, 0, 10))
    restored = store.restore_latest(fresh)
    assert (restored["epoch"], restored["best"], restored["replica_state"]) == (1, None, None)
    assert int(fresh.optimizer.iterations.numpy()) == STEPS
    for a, b in zip(model.weights + model.optimizer.variables, fresh.weights + fresh.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
        for copy in b.value.values:  # restored on every replica, not just the first
            np.testing.assert_array_equal(copy.numpy(), a.numpy())


def test_runtime_reports_the_strategy_facts():
    runtime = make_runtime(DistributeConfig(strategy="one_device"))
    assert (runtime.num_replicas, runtime.num_workers, runtime.is_chief) == (1, 1, True)


def moving_statistics(model):
    return {v.path: v for v in model.non_trainable_variables if "moving" in v.path}


@pytest.fixture(scope="module")
def resnet_two_one(digits_dir):
    """A ResNet with batch norm (RESNET) after 6 steps on 2 replicas and on 1, plain batch norm, Keras' own step;
    both from the same weights. Tests that change them put them back."""
    two = train_steps(digits_dir, 2, model=RESNET, lr=0.05)
    return two, train_steps(digits_dir, 1, start=two[2], model=RESNET, lr=0.05)


def test_averaging_sets_every_replica_to_the_mean_of_the_replicas_statistics(resnet_two_one):
    (_, model, _), _ = resnet_two_one
    stats = moving_statistics(model)
    before = {path: replica_copies(v) for path, v in stats.items()}
    # Keras 3 keeps one copy per replica (aggregation NONE), each from its own half of the batch.
    assert any(not np.allclose(a, b) for a, b in before.values())
    snapshot = ReplicaSnapshot(model)
    own = snapshot.take()
    state_averager(model)()
    snapshot.put_back(own)  # what a step checkpoint does: the run goes on with each replica's own values
    for path, v in stats.items():
        for a, b in zip(replica_copies(v), before[path]):
            np.testing.assert_array_equal(a, b, err_msg=path)
    state_averager(model)()
    for path, v in stats.items():
        after = replica_copies(v)
        np.testing.assert_array_equal(after[0], after[1], err_msg=path)
        np.testing.assert_allclose(after[0], (before[path][0] + before[path][1]) / 2, rtol=1e-6, atol=1e-7,
                                   err_msg=path)
        np.testing.assert_array_equal(v.numpy(), after[0])  # what saving and evaluation read
    snapshot.put_back(own)  # the module's model as it trained, for the tests after this one


def test_sync_bn_on_two_replicas_equals_one_device_at_the_same_global_batch(digits_dir, resnet_two_one):
    (_, plain, start), (_, one, _) = resnet_two_one
    _, synced, _ = train_steps(digits_dir, 2, start=start, model=RESNET, lr=0.05, sync_bn=True)
    reference = moving_statistics(one)

    def worst(model):
        return max(float(np.abs(c - reference[path].numpy()).max())
                   for path, v in moving_statistics(model).items() for c in replica_copies(v))
    # Float rounding only: sync_bn computes the variance as E[x^2] - E[x]^2 over the all-reduced sums.
    assert worst(synced) < 5e-3
    assert worst(plain) > 50 * worst(synced)  # without sync_bn each replica's statistics differ from it
    for a, b in zip(synced.trainable_weights, one.trainable_weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-3, atol=1e-4, err_msg=a.path)



def test_each_replica_flips_its_own_images():
    """The same images on both replicas: Keras seeds the flip alike everywhere, so both replicas flipped the same
    ones; after `decorrelate_random_streams` each replica draws its own flips (and a second call after a
    restore, when all replicas again hold replica 0's state, gives the same streams)."""
    import keras
    from tfdp.distribute.replica_state import decorrelate_random_streams
    strategy = make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy
    with strategy.scope():
        model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.RandomFlip("horizontal", seed=7)])
    x = tf.reshape(tf.range(64 * 16, dtype=tf.float32), [64, 4, 4, 1])

    def flips():
        out = strategy.run(tf.function(lambda: model(x, training=True)))
        return [np.any(o.numpy() != x.numpy(), axis=(1, 2, 3)) for o in strategy.experimental_local_results(out)]

    before = flips()
    assert np.array_equal(before[0], before[1])           # the correlation being fixed
    state = next(v for v in model.non_trainable_variables if v.path.endswith("seed_generator_state"))
    saved = replica_copies(state)[0]
    assert decorrelate_random_streams(model) == 1
    after = flips()
    assert not np.array_equal(after[0], after[1]) and 10 < after[1].sum() < 54
    state.assign(saved)                                   # a restore: replica 0's state everywhere
    decorrelate_random_streams(model)
    assert [a.tolist() for a in flips()] == [a.tolist() for a in after]
