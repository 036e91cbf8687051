import collections
import os
import threading

import numpy as np
import pytest
import tensorflow as tf

from tfdp.data.layouts import digits as digits_lib
from tfdp.config import DataConfig
from tfdp.data import build_source
from tfdp.data.corrupt import decode_error
from tfdp.data.pipeline import Bookkeeping, StreamPosition, eval_dataset, train_dataset
from tfdp.data.preprocess import train_transform
from tfdp.errors import UserError


def test_digits_tree_is_complete_stratified_and_real_jpeg(digits_dir):
    source = build_source(DataConfig(format="image_folder", dir=digits_dir))
    train, val = source.split("train"), source.split("val")
    assert source.class_names == tuple(str(d) for d in range(10))
    assert (train.num_examples, val.num_examples) == (1437, 360)
    assert not set(train.files) & set(val.files)
    # Stratified: every class keeps its share of the validation split.
    per_class = collections.Counter(val.labels)
    assert min(per_class.values()) >= 34 and max(per_class.values()) <= 38
    data = tf.io.read_file(val.files[0])
    assert bool(tf.io.is_jpeg(data))
    assert tuple(tf.io.decode_jpeg(data).shape) == (32, 32, 3)


def test_labels_come_from_the_class_folder(digits_dir):
    from sklearn.datasets import load_digits
    target = load_digits().target
    source = build_source(DataConfig(format="image_folder", dir=digits_dir))
    for path, label in zip(source.split("val").files, source.split("val").labels):
        index = int(os.path.basename(path)[len("digits_"):-len(".JPEG")])
        assert target[index] == label


def test_split_is_fixed():
    labels = np.arange(100) % 10
    a, b = digits_lib.split_indices(labels), digits_lib.split_indices(labels)
    assert np.array_equal(a["val"], b["val"])


def test_digits_format_creates_the_tree_on_first_use(tmp_path):
    target = tmp_path / "fresh" / "digits"
    source = build_source(DataConfig(format="digits", dir=str(target)))
    assert source.split("train").num_examples == 1437
    assert not any(p.name.startswith("digits.tmp") for p in target.parent.iterdir())


def test_train_pipeline_ships_uint8_batches_of_the_per_replica_size(digits_dir):
    cfg = DataConfig(format="image_folder", dir=digits_dir, image_size=24, min_crop_area=0.5)
    split = build_source(cfg).split("train")
    ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)
    images, labels = next(iter(train_dataset(split, cfg, global_batch=64, seed=0, input_context=ctx)))
    assert images.dtype == tf.uint8 and tuple(images.shape) == (32, 24, 24, 3)
    assert labels.dtype == tf.int32 and set(labels.numpy()) <= set(range(10))
    assert int(tf.reduce_max(images)) > 100  # real pixels, not zeros


def test_eval_pipeline_reads_every_example_exactly_once(digits_dir):
    cfg = DataConfig(format="image_folder", dir=digits_dir)
    split = build_source(cfg).split("val")
    batches = list(eval_dataset(split, cfg, global_batch=64))
    assert all(int(w.shape[0]) == 64 for _, _, w in batches)  # always full: 360 real + 24 weight-0 pads
    labels = np.concatenate([lab.numpy() for _, lab, _ in batches])
    weights = np.concatenate([w.numpy() for _, _, w in batches])
    assert len(labels) == 384 and weights.sum() == 360 and set(weights) == {0.0, 1.0}
    assert collections.Counter(labels[weights == 1]) == collections.Counter(split.labels)
    assert not weights[:360].min() == 0  # the pads come last


def worker_shares(split, cfg, workers: int, global_batch: int) -> tuple[list[int], list[int]]:
    """(real images, steps) of each worker's evaluation pipeline."""
    seen, steps = [], []
    for worker in range(workers):
        ctx = tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=worker,
                                         num_replicas_in_sync=workers)
        batches = list(eval_dataset(split, cfg, global_batch, ctx))
        seen.append(int(sum(w.numpy().sum() for _, _, w in batches)))
        steps.append(len(batches))
    return seen, steps


def test_workers_read_disjoint_files(digits_dir):
    cfg = DataConfig(format="image_folder", dir=digits_dir)
    split = build_source(cfg).split("val")
    seen, steps = worker_shares(split, cfg, workers=2, global_batch=32)
    assert seen == [180, 180]  # disjoint halves, every image once
    assert steps[0] == steps[1]  # same number of steps, or a collective would wait forever


def test_uneven_worker_shares_still_take_equal_steps(digits_dir):
    cfg = DataConfig(format="image_folder", dir=digits_dir)
    split = build_source(cfg).split("val")
    split = type(split)(split.name, split.files[:37], split.labels[:37])
    counts, steps = worker_shares(split, cfg, workers=3, global_batch=12)
    assert counts == [13, 12, 12] and len(set(steps)) == 1


def test_png_images_are_read_too(tmp_path, digits_dir):
    from PIL import Image
    for split in ("train", "val"):
        for cls in ("a", "b"):
            d = tmp_path / split / cls
            d.mkdir(parents=True)
            Image.new("RGB", (40, 30), (200, 10, 10)).save(d / "x.png")
    cfg = DataConfig(format="image_folder", dir=str(tmp_path), image_size=16)
    images, _, _ = next(iter(eval_dataset(build_source(cfg).split("val"), cfg, 2)))
    assert tuple(images.shape) == (2, 16, 16, 3) and int(images[0, 8, 8, 0]) == 200


def test_naming_a_corrupt_image_leaves_what_other_threads_run_alone(tmp_path, digits_dir):
    """The pipeline names a corrupt image by decoding it again (`decode_error`, from its `tf.py_function`) while
    other streams are built: DALI's per-replica streams on their devices, the evaluation's. Decoded eagerly, the
    failing op aborted the rendezvous TensorFlow's eager ops share, and a stream built at that moment on the
    second CPU failed with the image's error (7 tries in 10). Named over and over beside 20 such builds: none
    fails, and every naming gives the image's own reason."""
    from conftest import CPU_DEVICES
    cfg = DataConfig(format="image_folder", dir=digits_dir, image_size=16)
    broken = tmp_path / "broken.jpg"
    with open(build_source(cfg).split("train").files[0], "rb") as photo:
        broken.write_bytes(photo.read()[:200])   # as an interrupted copy leaves it
    transform = train_transform(cfg, 3)
    reasons, stop = [], threading.Event()

    def name_it_again_and_again():
        while not stop.is_set():
            reasons.append(decode_error(str(broken), transform))
    namer = threading.Thread(target=name_it_again_and_again, daemon=True)
    namer.start()
    try:
        for _ in range(20):
            stream = tf.data.Dataset.range(3).apply(tf.data.experimental.prefetch_to_device(CPU_DEVICES[1], 1))
            with tf.device(CPU_DEVICES[1]):
                assert int(next(iter(stream))) == 0
    finally:
        stop.set()
        namer.join()
    assert len(reasons) >= 20 and set(reasons) == {"Invalid JPEG data, size 200"}


@pytest.mark.parametrize("make, message", [
    (lambda root: None, "data directory not found"),
    (lambda root: root.mkdir(), "has no 'train' split folder"),
    (lambda root: (root / "train").mkdir(parents=True), "no class folders"),
    (lambda root: (root / "train" / "cat").mkdir(parents=True), "no images"),
])
def test_missing_or_empty_data_is_a_clear_error(tmp_path, make, message):
    root = tmp_path / "data"
    make(root)
    with pytest.raises(UserError, match=message):
        build_source(DataConfig(format="image_folder", dir=str(root)))


def test_unknown_format_lists_the_valid_ones():
    with pytest.raises(UserError, match=r"unknown data.format 'lmdb' \(valid: csv, digits, idx, image_folder, imagenet, "):
        build_source(DataConfig(format="lmdb"))


def own_label_split(digits_dir, n: int = 24):
    """`n` real digit JPEGs, each its own class: a label names the image whatever its crop."""
    split = build_source(DataConfig(format="image_folder", dir=digits_dir)).split("train")
    return type(split)(split.name, split.files[:n], tuple(range(n)))


def replica_batches(split, cfg, steps: int, seed: int = 3, start=(0, 0), position=None):
    """[(replica 0's labels, replica 1's), ...] per step, as a real 2-replica MirroredStrategy deals them."""
    from conftest import CPU_DEVICES
    strategy = tf.distribute.MirroredStrategy(CPU_DEVICES)
    ds = strategy.distribute_datasets_from_function(
        lambda ctx: train_dataset(split, cfg, 8, seed, ctx, books=Bookkeeping(start=start, position=position)))
    stream = iter(ds)
    out = []
    for _ in range(steps):
        _, labels = next(stream)
        out.append(tuple(r.numpy() for r in strategy.experimental_local_results(labels)))
    return out


@pytest.mark.parametrize("k", [2, 3])
def test_repeated_augmentation_shows_a_new_1_in_k_of_the_images_k_times_each_epoch(digits_dir, k):
    """DeiT's RASampler: an epoch keeps its length (24 images), ceil(24 / k) of them k times each, a different
    subset the next epoch, and every copy has a crop of its own."""
    split = own_label_split(digits_dir)
    cfg = DataConfig(format="image_folder", dir=digits_dir, image_size=16, deterministic=True, repeated_augmentation=k)
    stream = iter(train_dataset(split, cfg, 8, seed=3))
    epochs = [[next(stream) for _ in range(3)] for _ in range(2)]  # 24 images: 3 batches of 8
    kept = []
    for batches in epochs:
        labels = np.concatenate([b[1].numpy() for b in batches])
        count = collections.Counter(labels.tolist())
        assert len(labels) == 24 and len(count) == -(-24 // k) and set(count.values()) == {k}
        kept.append(set(count))
        images = np.concatenate([b[0].numpy() for b in batches])
        for label in count:
            copies = images[labels == label]
            assert all(not np.array_equal(copies[0], other) for other in copies[1:])  # cropped apart
    assert kept[0] != kept[1]


def test_repeated_augmentation_deals_the_copies_to_different_replicas(digits_dir):
    """With 2 copies on 2 replicas every step holds both copies of each of its images, one per replica;
    without repeated augmentation each image appears once."""
    split = own_label_split(digits_dir)
    cfg = DataConfig(format="image_folder", dir=digits_dir, image_size=16, repeated_augmentation=2)
    for first, second in replica_batches(split, cfg, steps=6):
        assert len(first) == len(second) == 4
        assert sorted(first) == sorted(second)  # replica 1 has the other copy of each of replica 0's images
    plain = replica_batches(split, DataConfig(format="image_folder", dir=digits_dir, image_size=16), steps=3)
    assert sorted(np.concatenate([np.concatenate(step) for step in plain]).tolist()) == list(range(24))


def test_a_resumed_repeated_augmentation_stream_continues_the_uninterrupted_one(digits_dir):
    """The block dealt to the replicas accounts for its records on its last batch, so the position after
    a step is exact and a stream resumed there continues with the same batches."""
    split = own_label_split(digits_dir)
    cfg = DataConfig(format="image_folder", dir=digits_dir, image_size=16, deterministic=True, repeated_augmentation=3)
    position = StreamPosition()
    uninterrupted = replica_batches(split, cfg, steps=7, position=position)
    after = position.after(2 * 4)  # 4 steps of 2 batches
    assert after == (32, 0)
    resumed = replica_batches(split, cfg, steps=3, start=after)
    for want, got in zip(uninterrupted[4:], resumed):
        assert all(np.array_equal(w, g) for w, g in zip(want, got))


def test_repeated_augmentation_through_the_data_service_is_one_line():
    from tfdp.config import validate
    with pytest.raises(UserError, match="data.repeated_augmentation needs the local input pipeline"):
        validate({"data": {"repeated_augmentation": 3, "service_address": "grpc://localhost:5000"}})
