"""What a step checkpoint, the preemption check and a resume cost, as ratios to the training step.

For each model, in this one process and on the same data:
  - step:       median seconds per training step (synthetic data on the device, after warm-up);
  - check:      the preemption agreement after every step (one all-reduce of a flag);
  - checkpoint: a step checkpoint as the trainer writes it (each replica's statistics gathered, averaged
                for the weights file and put back; weights, optimizer state, input position and metric
                sums, written atomically);
  - resume:     reading that checkpoint back into a freshly built model; and, for the input, the first
                batch of a stream of 200,000 JPEG paths resumed half way through an epoch (records
                skipped, not read), per skipped record against the time to decode an image.
The "every N" column is the share of training time checkpoints take at `train.checkpoint_every_steps`.

  python benchmarks/checkpoint_cost.py [--models=demo,resnet50] [--every=1000] [--records=200000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETUPS = {  # name: (registry model, image size, classes, per-replica batch)
    "demo": ("resnet18_small", 16, 10, 32),
    "resnet50": ("resnet50", 224, 1000, 16),
}


def measure(name: str, args, runtime) -> dict:
    import keras

    from tfdp.train.callbacks import Checkpointer, CheckpointSettings
    from tfdp.rundir.checkpoints import CheckpointStore
    from tfdp.config import validate
    from tfdp.data.pipeline import synthetic_dataset
    from tfdp.distribute.preemption import PreemptionWatch
    from tfdp.distribute.replica_state import ReplicaSnapshot, state_averager
    from tfdp.train.task import Plan, compile_model

    model_name, size, classes, batch = SETUPS[name]
    global_batch = batch * runtime.num_replicas
    cfg = validate({"model": {"name": model_name, "num_classes": classes}, "data": {"image_size": size},
                    "train": {"batch_size_per_replica": batch}})
    plan = Plan(global_batch, 100, 0, 0, classes)
    keras.backend.clear_session()
    with runtime.strategy.scope():
        model = compile_model(cfg, plan)
    data = runtime.strategy.distribute_datasets_from_function(
        lambda ctx: synthetic_dataset(cfg.data, classes, global_batch, ctx))
    stamps: list[float] = []
    watch = PreemptionWatch(runtime.strategy, workers=2)  # the multi-worker cost: one process needs no all-reduce
    checks: list[float] = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # steps run asynchronously: wait for this one to finish
            start = time.perf_counter()
            watch.agreed()
            checks.append(time.perf_counter() - start)
            stamps.append((start, time.perf_counter()))

    model.fit(data, steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0, callbacks=[Stamp()], shuffle=False)
    # A step: from the end of one preemption check to the end of the next step.
    step = statistics.median(stamps[i][0] - stamps[i - 1][1] for i in range(args.warmup, len(stamps)))
    check = statistics.median(checks[args.warmup:])

    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(tmp)
        checkpointer = Checkpointer(store, CheckpointSettings("val_top1", steps_per_epoch=100, every_steps=1),
                                    average=state_averager(model), input_state=lambda steps: [[steps * batch, 0]],
                                    snapshot=ReplicaSnapshot(model))
        checkpointer.set_model(model)
        saves = []
        for i in range(args.repeats):
            start = time.perf_counter()
            checkpointer._save_step(i + 1, i + 1)
            saves.append(time.perf_counter() - start)
        save = statistics.median(saves)
        with runtime.strategy.scope():
            fresh = compile_model(cfg, plan)
        start = time.perf_counter()
        store.restore_latest(fresh)
        load = time.perf_counter() - start
        newest = store.checkpoints()[-1][2]
        size_mb = sum(os.path.getsize(os.path.join(newest, f)) for f in os.listdir(newest)) / 1e6
    return {"step": step, "check": check, "save": save, "load": load, "size_mb": size_mb}


def resume_input_cost(records: int) -> tuple[float, float, float]:
    """Seconds to the first batch of a training stream over `records` JPEG paths (the demo's files, repeated),
    fresh and resumed half way through its third epoch (records skipped, not read), and the time to
    decode one batch: what a resume costs against the images it does not decode."""
    import dataclasses

    from tfdp.data.layouts.digits import write_digits
    from tfdp.config import validate
    from tfdp.data import build_source
    from tfdp.data.pipeline import Bookkeeping, train_dataset
    with tempfile.TemporaryDirectory() as tmp:
        write_digits(tmp, progress=False)
        cfg = validate({"data": {"format": "image_folder", "dir": tmp, "image_size": 16}})
        split = build_source(cfg.data).split("train")
        reps = -(-records // len(split.files))
        split = dataclasses.replace(split, files=(split.files * reps)[:records], labels=(split.labels * reps)[:records])

        def first_batch(start) -> tuple[float, float]:
            begin = time.perf_counter()
            stream = iter(train_dataset(split, cfg.data, 64, 0, books=Bookkeeping(start=start)))
            next(stream)
            first = time.perf_counter() - begin
            begin = time.perf_counter()
            next(stream)
            return first, time.perf_counter() - begin
        first_batch((0, 0))  # warm-up: tracing, decoder
        fresh, batch = first_batch((0, 0))
        resumed, _ = first_batch((2 * records + records // 2, 0))
    return fresh, resumed, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,resnet50")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", type=int, default=1000, help="train.checkpoint_every_steps to cost")
    parser.add_argument("--records", type=int, default=200_000, help="paths in the resumed input stream")
    args = parser.parse_args()
    import tfdp  # noqa: F401
    from tfdp.distribute.strategy import local_replicas, make_runtime
    runtime = make_runtime(local_replicas(args.replicas))
    print(f"{runtime.num_replicas} replica(s) on {', '.join(runtime.devices)}; seconds are medians")
    print(f"{'model':<10}{'step s':>9}{'check/step':>12}{'ckpt s':>9}{'ckpt MB':>9}{'ckpt/step':>11}"
          f"{'every ' + str(args.every):>12}{'load s':>9}{'load/step':>11}")
    for name in args.models.split(","):
        r = measure(name, args, runtime)
        share = r["save"] / (args.every * r["step"] + r["save"])
        print(f"{name:<10}{r['step']:>9.3f}{r['check'] / r['step']:>11.2%} {r['save']:>8.2f}{r['size_mb']:>9.0f}"
              f"{r['save'] / r['step']:>10.2f}x{share:>12.3%}{r['load']:>9.2f}{r['load'] / r['step']:>10.2f}x",
              flush=True)
    records = args.records
    fresh, resumed, batch = resume_input_cost(records)
    skipped = records // 2
    per_record = max(resumed - fresh, 0.0) / skipped
    print(f"input resume over {records:,} JPEG paths: first batch fresh {fresh:.2f} s, resumed mid-epoch 3 "
          f"{resumed:.2f} s: {1e6 * per_record:.1f} us per skipped record, against {1e6 * batch / 64:.0f} us "
          f"to decode an image ({batch / 64 / max(per_record, 1e-9):.0f}x)")


if __name__ == "__main__":
    main()
