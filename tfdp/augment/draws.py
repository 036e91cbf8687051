"""Stateless random draws that give the same numbers with and without XLA, on CPU and GPU.

Every augmentation draws through these, from a seed derived from the step and the replica id
(`step_seed`), so a run is reproducible and a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import math

import tensorflow as tf

# Philox, and floats made here from its raw bits (random_bits): with "auto_select", or through tf.random's own
# uniform/normal, XLA draws other numbers than the TF kernels, so a step would augment differently with
# train.jit_compile on and off. Philox's bits are the same with and without XLA, on CPU and GPU.
RNG = "philox"
_PHILOX = 1  # TensorFlow's RNG_ALG_PHILOX


def step_seed(run_seed: int, step, replica_id) -> tf.Tensor:
    """A stateless seed [2] for one replica's step: distinct per step and per replica, the same on a rerun."""
    seed = tf.stack([tf.constant(run_seed, tf.int64), tf.constant(0x5EED, tf.int64)])
    seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(step, tf.int64), alg=RNG)
    return tf.random.experimental.stateless_fold_in(seed, tf.cast(replica_id, tf.int64), alg=RNG)


def split_seed(seed, n: int) -> list[tf.Tensor]:
    """`n` independent stateless seeds from one."""
    return tf.unstack(tf.bitcast(random_bits(seed, [n, 2]), tf.int32), num=n)

def random_bits(seed, shape) -> tf.Tensor:
    """Philox's raw uint32 bits for a [2] int seed.

    The seed's 128 bits go through one Philox call to become the key and counter
    (what tf.random's Python-side scrambling does, in ~50 ops; TF's
    StatelessRandomGetKeyCounter instead picks per device, so XLA would draw
    differently). A handful of ops a draw keeps the traced graph and its XLA compile small.
    """
    words = tf.bitcast(tf.cast(seed, tf.int64), tf.uint64)
    key, counter = words[:1], tf.stack([words[1], tf.constant(0, tf.uint64)])
    mixed = tf.raw_ops.StatelessRandomUniformFullIntV2(shape=[3], key=key, counter=counter, alg=_PHILOX,
                                                       dtype=tf.uint64)
    return tf.raw_ops.StatelessRandomUniformFullIntV2(shape=shape, key=mixed[:1], counter=mixed[1:], alg=_PHILOX,
                                                      dtype=tf.uint32)


def uniform(seed, shape, low=0.0, high=1.0) -> tf.Tensor:
    """Uniform floats in [low, high) from the top 24 random bits (identical with and without XLA)."""
    unit = tf.cast(tf.bitwise.right_shift(random_bits(seed, shape), 8), tf.float32) * (2.0 ** -24)
    return low + (high - low) * unit


def uniforms(seed, shape, k: int) -> list[tf.Tensor]:
    """k independent uniform [0, 1) tensors of `shape` from one draw."""
    return tf.unstack(uniform(seed, tf.concat([[k], tf.cast(shape, tf.int32)], 0)), num=k)


def box_muller(u1, u2) -> tf.Tensor:
    """A standard normal from two uniforms (XLA and TF agree to an ulp; TF's own normal differs under XLA)."""
    return tf.sqrt(-2.0 * tf.math.log(1.0 - u1)) * tf.cos((2.0 * math.pi) * u2)


def normal(seed, shape) -> tf.Tensor:
    return box_muller(*uniforms(seed, shape, 2))


def random_sign(seed, shape) -> tf.Tensor:
    """+1 or -1 with equal chance (timm's _randomly_negate, torchvision's signed magnitudes)."""
    return tf.where(uniform(seed, shape) > 0.5, -1.0, 1.0)


def random_index(seed, shape, n) -> tf.Tensor:
    """Uniform integers in [0, n) (numpy's randint(0, n)); `n` an int or an int32 tensor of `shape`."""
    n = tf.cast(n, tf.int32)
    return tf.minimum(tf.cast(tf.floor(uniform(seed, shape) * tf.cast(n, tf.float32)), tf.int32), n - 1)


_GAMMA_TRIES = 12


def log_gamma_sample(seed, shape, alpha: float) -> tf.Tensor:
    """log of Gamma(alpha, 1) samples, by Marsaglia-Tsang with a fixed number of tries.

    TensorFlow's stateless gamma (StatelessRandomGammaV3) has no XLA kernel; this
    uses only uniform and normal draws. Each try is accepted with probability
    > 0.95, so 12 tries all fail about once in 1e15 (then the mode is returned).
    alpha < 1 uses the boost Gamma(a) = Gamma(a + 1) * U^(1/a), kept in log space
    so that small alphas (Mixup's 0.2) do not underflow to 0.
    """
    boosted = alpha < 1.0
    a = alpha + 1.0 if boosted else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    u1, u2, u, boost = uniforms(seed, list(shape) + [_GAMMA_TRIES], 4)
    z = box_muller(u1, u2)
    v = (1.0 + c * z) ** 3
    safe_v = tf.maximum(v, 1e-30)
    accepted = (v > 0) & (tf.math.log(u) < 0.5 * z * z + d - d * safe_v + d * tf.math.log(safe_v))
    first = tf.argmax(tf.cast(accepted, tf.int32), axis=-1, output_type=tf.int32)
    chosen_v = tf.gather(safe_v, first, batch_dims=len(shape))
    chosen_v = tf.where(tf.reduce_any(accepted, -1), chosen_v, 1.0)
    log_g = tf.math.log(d) + tf.math.log(chosen_v)
    if boosted:
        log_g += tf.math.log(tf.maximum(boost[..., 0], 1e-37)) / alpha
    return log_g


def beta_sample(seed, shape, alpha: float) -> tf.Tensor:
    """Beta(alpha, alpha) = X / (X + Y) for X, Y ~ Gamma(alpha), as sigmoid(log X - log Y); XLA-compatible."""
    log_xy = log_gamma_sample(seed, list(shape) + [2], alpha)
    return tf.sigmoid(log_xy[..., 0] - log_xy[..., 1])
