"""Training on a fixed sequence of global batches, in this process: what exactness tests compare."""

import tensorflow as tf

from tfdp.data import build_source
from tfdp.data.pipeline import eval_dataset
from tfdp.distribute.strategy import make_runtime
from tfdp.train.task import Plan, compile_model


def train_fixed_batches(cfg, steps: int, global_batch: int, start=None):
    """`steps` optimizer steps of `cfg`'s model on the same global batches whatever the layout, from the
    weights `start` if given; returns (runtime, model, initial weights).

    Deterministic input (no shuffle, no random crop, `eval_dataset`): replica r gets the r-th slice of each
    global batch, which an accumulating step (`train.grad_accum_steps`) cuts into micro-batches. Runs
    compared with each other start from the same weights by copying them: the seed alone does not
    guarantee it in a test process, where a thread left by an earlier test (an fsspec event loop, say)
    may draw from Python's global random generator between the seed and the initializers."""
    runtime = make_runtime(cfg.distribute)
    assert runtime.num_replicas == cfg.distribute.cpu_replicas
    split = build_source(cfg.data).split("train")
    plan = Plan(global_batch, steps, split.num_examples, 0, 10, accum_steps=cfg.train.grad_accum_steps)
    tf.keras.utils.set_random_seed(cfg.train.seed)
    with runtime.strategy.scope():
        model = compile_model(cfg, plan)
    if start is not None:
        model.set_weights(start)
    initial = [w.numpy() for w in model.weights]
    ds = runtime.strategy.distribute_datasets_from_function(
        lambda ctx: eval_dataset(split, cfg.data, global_batch, ctx).repeat())
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)
    return runtime, model, initial
