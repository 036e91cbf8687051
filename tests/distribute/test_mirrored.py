"""Real 2-replica MirroredStrategy on 2 logical CPU devices (split in conftest)."""

import os

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


# Float32 bounds (tests/models/test_batch_norm.py): a sum of n float32 terms in any order is within (n - 1)·u·Σ|terms|
# of the exact sum (Higham 4.2, u = eps / 2); n·eps leaves headroom for the divisions and square roots.
EPS32 = float(np.finfo(np.float32).eps)
BN_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "batchnorm.npz")
# batch-norm layers on RESNET's longest path (the stem's, two per block): how many roundings a statistic inherits
BN_DEPTH = 9


def sync_bn_step(layer_class, **settings):
    """One training call of a batch-norm layer (torch's defaults, the fixture's scale and shift) on 2 replicas,
    replica r given the fixture's shard r, and the gradients of Σ y·upstream; (layer, outputs, input gradients,
    gamma and beta gradients summed over the replicas, as Keras' step all-reduces them)."""
    ref = dict(np.load(BN_FIXTURE))
    strategy = make_runtime(DistributeConfig(strategy="mirrored", cpu_replicas=2)).strategy
    with strategy.scope():
        layer = layer_class(momentum=0.9, epsilon=1e-5, synchronized=True, **settings)
        layer.build((None, 5, 5, 3))
        layer.gamma.assign(ref["gamma"])
        layer.beta.assign(ref["beta"])

    def shard(name):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(ref[name][ctx.replica_id_in_sync_group]))

    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * upstream)
        return (y, *tape.gradient(loss, [x, layer.gamma, layer.beta]))

    out = tf.function(lambda: strategy.run(step, args=(shard("shards"), shard("sync_upstream"))))()
    y, dx, dgamma, dbeta = ([t.numpy() for t in strategy.experimental_local_results(o)] for o in out)
    return ref, layer, np.stack(y), np.stack(dx), sum(dgamma), sum(dbeta)


def test_sync_bn_merges_the_replicas_statistics_as_torch_syncbatchnorm():
    """tfdp's sync batch norm (torch's rule) on 2 replicas with shards of unequal content (means 40 apart) against
    torch's SyncBatchNorm (tests/fixtures/make_batchnorm_fixture.py, float64): outputs, running statistics on both
    replicas and first-step gradients (through the all-reduces) within float32's bounds for n = 200 values per
    channel; Keras' own synchronized layer misses the running variance (biased, E[x²] - E[x]²)."""
    from tfdp.models.batch_norm import BatchNormalization
    ref, layer, y, dx, dgamma, dbeta = sync_bn_step(BatchNormalization, running_variance="torch")
    x = ref["shards"].astype(np.float64)
    n_eps = x[..., 0].size * EPS32
    sigma, top = np.sqrt(ref["sync_var"]), np.abs(x).max()
    mean_tol = 2 * n_eps * top                      # the replicas' means, their weighted sum, its division
    var_rtol = 2 * n_eps * (1 + top / sigma.min())  # M2's terms, and (mᵢ - m)² through the means' error
    for copy in replica_copies(layer.moving_mean):
        np.testing.assert_allclose(copy, ref["sync_running_mean"], rtol=0, atol=mean_tol)
    for copy in replica_copies(layer.moving_variance):
        np.testing.assert_allclose(copy, ref["sync_running_var"], rtol=var_rtol)
    x_hat = (x - ref["sync_mean"]) / sigma
    gain = np.abs(ref["gamma"]) / sigma
    np.testing.assert_allclose(y, ref["sync_y"], rtol=0,
                               atol=(gain * mean_tol).max() + var_rtol * np.abs(ref["sync_y"]).max())
    # dx = γ/σ·(g - mean(g) - x̂·mean(g·x̂)): two sums over n, and σ's relative error through the whole
    g = ref["sync_upstream"].astype(np.float64)
    dx_tol = (n_eps * gain.max() * np.abs(g).max() * (1 + np.abs(x_hat).max() ** 2)
              + var_rtol * np.abs(ref["sync_dx"]).max())
    np.testing.assert_allclose(dx, ref["sync_dx"], rtol=0, atol=dx_tol)
    np.testing.assert_allclose(dgamma, ref["sync_dgamma"], rtol=0,
                               atol=(n_eps + var_rtol) * np.abs(g * x_hat).sum(axis=(0, 1, 2, 3)).max())
    np.testing.assert_allclose(dbeta, ref["sync_dbeta"], rtol=0, atol=n_eps * np.abs(g).sum(axis=(0, 1, 2, 3)).max())

    import keras
    _, keras_layer, keras_y, *_ = sync_bn_step(keras.layers.BatchNormalization)
    np.testing.assert_allclose(keras_y, ref["sync_y"], rtol=0, atol=1e-3)   # the same normalisation, roughly
    shortfall = ref["sync_running_var"] - replica_copies(keras_layer.moving_variance)[0]
    np.testing.assert_allclose(shortfall, 0.1 * ref["sync_var"] / 199, rtol=0.05)   # biased: n/(n - 1) short
    assert np.all(shortfall > 10 * var_rtol * ref["sync_running_var"])


@pytest.mark.full(reason="60 CPU-s: sync BN's merge of the replicas' statistics and its gradients are "
                         "test_sync_bn_merges_the_replicas_statistics_as_torch_syncbatchnorm")
def test_sync_bn_on_two_replicas_equals_one_device_at_the_same_global_batch(digits_dir, resnet_two_one):
    """The whole model's first step with sync_bn on 2 replicas, against one device on the same global batch: the
    same batch-norm statistics and the same gradients, to float32 rounding. One step: it is what sync BN promises
    (the global batch's statistics, gradients through them); over later steps rounding moves ReLU inputs across
    0 and the runs part as two float32 runs of one device may."""
    (_, _, start), _ = resnet_two_one
    _, synced, _ = train_fixed_batches(make_cfg(digits_dir, 2, model=RESNET, lr=0.05, sync_bn=True), 1,
                                       GLOBAL_BATCH, start)
    _, one, _ = train_fixed_batches(make_cfg(digits_dir, 1, model=RESNET, lr=0.05), 1, GLOBAL_BATCH, start)
    reference = moving_statistics(one)
    n_eps = GLOBAL_BATCH * RESNET_SIZE ** 2 * EPS32   # the most values one statistic sums (the stem's)

    def bound(path):
        """A statistic's float32 bound for its sum, times the depth it is computed at (its input carries every
        earlier layer's rounding), relative to its size (the moving variance starts at 1, the mean at 0)."""
        return BN_DEPTH * n_eps * (1 + np.abs(reference[path].numpy()).max())

    def worst(model):
        """The largest deviation from the one-device statistics, in units of each one's bound."""
        return max(float(np.abs(c - reference[path].numpy()).max()) / bound(path)
                   for path, v in moving_statistics(model).items() for c in replica_copies(v))
    assert worst(synced) <= 1
    # without sync_bn each replica's statistics are its half-batch's, far outside the bound
    _, halves, _ = train_fixed_batches(make_cfg(digits_dir, 2, model=RESNET, lr=0.05), 1, GLOBAL_BATCH, start)
    assert worst(halves) > 10
    # the first step moves each weight by lr · its gradient (momentum starts at 0): the same gradients, each
    # tensor norm-wise within the bound of the statistics it was computed through
    moved = 0.0
    for a, b, init in zip(synced.weights, one.weights, start):
        if not a.trainable:
            continue
        step_synced, step_one = a.numpy() - init, b.numpy() - init
        scale = np.linalg.norm(step_one)
        moved = max(moved, scale)
        assert np.linalg.norm(step_synced - step_one) <= BN_DEPTH * n_eps * scale, a.path
    assert moved > 1e-3   # the step really moved the weights


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
