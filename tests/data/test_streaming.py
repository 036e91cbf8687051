"""The bounded cache (`data.cache_limit`, tfdp/data/streaming.py) against a real GCS emulator on loopback.

Each dataset is about four times the limit. Every example's label is its own
number, so a stream's labels say which examples came in which order, and
which file each came from.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading

import numpy as np
import pytest
import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.data import dali, storage, streaming
from tfdp.data.pipeline import Bookkeeping, eval_dataset, train_dataset
from tfdp.data.layouts import Split
from tfdp.data.layouts.tfrecord import IMAGENET_RECORDS, IMAGE_KEY, LABEL_KEY, LABEL_OFFSET
from tfdp.errors import UserError

IMAGES = 160            # image files, one example each
SHARDS, PER_SHARD = 80, 4
BATCH = 8
EPOCHS = 3


def _jpegs(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [tf.io.encode_jpeg(rng.integers(0, 256, [16, 16, 3], np.uint8), quality=95).numpy() for _ in range(n)]


def _record(image: bytes, label: int) -> bytes:
    return tf.train.Example(features=tf.train.Features(feature={
        IMAGE_KEY: tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
        LABEL_KEY: tf.train.Feature(int64_list=tf.train.Int64List(value=[label + LABEL_OFFSET])),
    })).SerializeToString()


@pytest.fixture(scope="module")
def datasets(gcs_bucket):
    """{kind: (Split, bytes)}: image files, TFRecord shards and WebDataset shards of the same images in the
    emulator's bucket."""
    import fsspec
    images = _jpegs(IMAGES, 0)
    shards = []
    for s in range(SHARDS):
        labels = range(s * PER_SHARD, (s + 1) * PER_SHARD)
        shard, other = b"", 0
        # The emulator's multipart parser drops an object's last byte when it is a line break: another image
        # for the last record changes its CRC, the shard's last bytes.
        while not shard or shard.endswith((b"\n", b"\r")):
            shard = b"".join(_framed(_record(images[(label + other * (label == labels[-1])) % IMAGES], label))
                             for label in labels)
            other += 1
        shards.append(shard)
    tars = [_tar([(images[label % IMAGES], label) for label in range(s * PER_SHARD, (s + 1) * PER_SHARD)])
            for s in range(SHARDS)]
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    image_urls = tuple(f"{gcs_bucket}/streamed/images/{i:04d}.jpg" for i in range(IMAGES))
    shard_urls = tuple(f"{gcs_bucket}/streamed/shards/train-{s:05d}" for s in range(SHARDS))
    tar_urls = tuple(f"{gcs_bucket}/streamed/wds/train-{s:05d}.tar" for s in range(SHARDS))
    for url, data in zip(image_urls + shard_urls + tar_urls, images + shards + tars):
        fs.pipe_file(url.removeprefix("gs://"), data)   # one at a time: the emulator is slow with many at once
        assert fs.size(url.removeprefix("gs://")) == len(data)
    return {
        "images": (Split("train", image_urls, labels=tuple(range(IMAGES))), sum(map(len, images))),
        "records": (Split("train", shard_urls, counts=(PER_SHARD,) * SHARDS, records=IMAGENET_RECORDS),
                    sum(map(len, shards))),
        "tar": (Split("train", tar_urls, counts=(PER_SHARD,) * SHARDS, tar=True), sum(map(len, tars))),
    }


def _tar(samples: list[tuple[bytes, int]]) -> bytes:
    """A WebDataset shard of (image, label) samples, as webdataset's TarWriter writes it."""
    import tempfile

    import webdataset
    with tempfile.NamedTemporaryFile(suffix=".tar") as f:
        with webdataset.TarWriter(f.name) as writer:
            for number, (image, label) in enumerate(samples):
                writer.write({"__key__": f"{number:04d}", "jpg": image, "cls": str(label).encode()})
        return open(f.name, "rb").read()


def _framed(record: bytes) -> bytes:
    """One TFRecord frame, as tf.io.TFRecordWriter writes it."""
    import tempfile
    with tempfile.NamedTemporaryFile() as f:
        with tf.io.TFRecordWriter(f.name) as w:
            w.write(record)
        return open(f.name, "rb").read()


@pytest.fixture(autouse=True)
def closed_streams():
    """Each test's streams stop with it (their fetchers would go on, against a server that has stopped)."""
    yield
    streaming.close_all()


def _file_of(kind: str, label: int) -> int:
    return label if kind == "images" else label // PER_SHARD   # records and tar: PER_SHARD a shard


def _config(cache_dir, limit) -> DataConfig:
    return DataConfig(format="tfrecord", cache_dir=str(cache_dir), cache_limit=limit, image_size=8,
                      shuffle_buffer=4, deterministic=True)


class DiskPeak:
    """The most bytes ever seen under a folder, sampled from outside the cache by a thread."""

    def __init__(self, folder):
        self.folder, self.peak, self._done = str(folder), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._done.is_set():
            total = 0
            for where, _, names in os.walk(self.folder):
                for name in names:
                    try:
                        total += os.path.getsize(os.path.join(where, name))
                    except FileNotFoundError:
                        pass
            self.peak = max(self.peak, total)
            self._done.wait(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


def _labels(split: Split, cfg: DataConfig, batches: int, start: int = 0) -> list[int]:
    ds = train_dataset(split, cfg, BATCH, seed=7, books=Bookkeeping(start=(start, 0)))
    return [int(v) for _, labels in ds.take(batches).as_numpy_iterator() for v in labels]


def _stream(cfg: DataConfig) -> streaming.Stream:
    return next(s for (where, _), s in streaming.OPEN_STREAMS.items() if where == cfg.cache_dir)


@pytest.mark.parametrize("kind", ["images", "records", "tar"])
def test_a_stream_four_times_the_limit_stays_within_it_and_reads_what_a_full_copy_reads(datasets, kind, tmp_path):
    split, total = datasets[kind]
    limit = total // 4
    epoch = split.num_examples
    full = _labels(split, _config(tmp_path / "full", "1GB"), EPOCHS * epoch // BATCH)
    assert len(os.listdir(tmp_path / "full" / "gs")) == 1   # copied whole, as without a limit
    cfg = _config(tmp_path / "bounded", limit)
    with DiskPeak(tmp_path / "bounded") as disk:
        streamed = _labels(split, cfg, EPOCHS * epoch // BATCH)
    stream = _stream(cfg)
    assert streamed == full
    assert sorted(streamed[:epoch]) == list(range(epoch))
    assert 0 < disk.peak <= limit and stream.high_water <= limit
    assert len(stream.fetched) >= EPOCHS * len(split.files) - len(split.files) // 2   # files fetched again


@pytest.mark.skipif(bool(dali.available()), reason="NVIDIA DALI's TensorFlow plugin does not import here")
def test_dali_decodes_a_stream_four_times_the_limit_in_a_full_copys_order(datasets, tmp_path):
    """data.decoder: dali on shards in a bucket four times data.cache_limit: DALI (its CPU operators, one replica)
    decodes what the bounded stream hands it, so its batches hold a whole copy's examples in the tf path's
    order, and the cache stays within its limit."""
    split, total = datasets["records"]
    limit, batches = total // 4, EPOCHS * split.num_examples // BATCH
    full = _labels(split, dataclasses.replace(_config(tmp_path / "full", "1GB"), deterministic=False), batches)
    cfg = dataclasses.replace(_config(tmp_path / "bounded", limit), deterministic=False, decoder="dali")
    stream = lambda: train_dataset(split, cfg, BATCH, seed=7, books=Bookkeeping())  # noqa: E731
    decoded = dali.replica_pipeline(dali.padded(stream()), cfg, BATCH, "/device:CPU:0", seed=0)
    with DiskPeak(tmp_path / "bounded") as disk:
        steps = list(decoded.take(batches).as_numpy_iterator())
    labels = [int(v) for _, batch in steps for v in batch]
    assert {images.shape for images, _ in steps} == {(BATCH, 8, 8, 3)}
    assert labels == full and sorted(labels[:split.num_examples]) == list(range(split.num_examples))
    assert 0 < disk.peak <= limit and _stream(cfg).high_water <= limit


@pytest.mark.parametrize("kind", ["images", "records"])
def test_evaluation_streams_a_split_four_times_the_limit_pass_after_pass(datasets, kind, tmp_path):
    """Validation reads every example once per pass, in the split's order, as from a whole copy; each pass
    ends cleanly and the next fetches again, within the limit."""
    split, total = datasets[kind]

    def labels(ds):
        return [int(v) for _, label, weight in ds.as_numpy_iterator() for v, w in zip(label, weight) if w]
    whole = labels(eval_dataset(split, _config(tmp_path / "whole", "1GB"), BATCH))
    cfg = _config(tmp_path / "bounded", total // 4)
    ds = eval_dataset(split, cfg, BATCH)
    with DiskPeak(tmp_path / "bounded") as disk:
        passes = [labels(ds), labels(ds)]
    stream = _stream(cfg)
    assert passes == [whole, whole] and sorted(whole) == list(range(split.num_examples))
    assert 0 < disk.peak <= total // 4 and stream.high_water <= total // 4
    assert set(stream.fetched) == set(split.files) and len(stream.fetched) >= 2 * len(split.files)   # each pass
    assert not stream.holding()


def test_a_training_run_splits_the_limit_between_its_two_streams(datasets, tmp_path):
    """Training keeps its window full while validation runs, so they share data.cache_limit; a split too
    large for its share says whose share it is."""
    train, val = streaming.run_parts(True, True)
    assert train.fraction + val.fraction == 1 and val.fraction == streaming.VALIDATION_PART
    assert streaming.run_parts(True, False) == (streaming.WHOLE, streaming.WHOLE)
    split, total = datasets["images"]
    largest = max(len(open(p, "rb").read()) for p in streaming.storage.localize(split.files[:1], str(tmp_path / "c")))
    limit = int(largest / streaming.VALIDATION_PART) - 4   # its validation share is just short of one file
    with pytest.raises(UserError) as error:
        eval_dataset(split, _config(tmp_path, limit), BATCH, cache_part=val)
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("the validation stream's 25% of data.cache_limit ("), str(error.value)


def test_a_resumed_stream_continues_the_uninterrupted_one_and_fetches_only_what_it_still_needs(datasets, tmp_path):
    split, total = datasets["records"]
    epoch = split.num_examples
    whole = _labels(split, _config(tmp_path / "whole", total // 4), 2 * epoch // BATCH)
    start = epoch + epoch // 2
    cfg = _config(tmp_path / "resumed", total // 4)
    resumed = _labels(split, cfg, 4, start=start)
    assert resumed == whole[start:start + 4 * BATCH]
    read_before = {_file_of("records", v) for v in whole[epoch:start]}
    read_after = {_file_of("records", v) for v in whole[start:]}
    fetched = {int(url.rsplit("-", 1)[1]) for url in _stream(cfg).fetched}
    assert fetched and fetched <= read_after and not fetched & (read_before - read_after)


def test_a_file_larger_than_the_limit_is_one_line(datasets, tmp_path):
    split, total = datasets["images"]
    with pytest.raises(UserError) as error:
        _labels(split, _config(tmp_path, 100), 1)
    message = str(error.value)
    assert "\n" not in message and "data.cache_limit (100 bytes)" in message and "largest file" in message


def _small_tree(gcs_bucket: str, prefix: str, broken: int | None = None) -> tuple[Split, int]:
    """40 images under `prefix` in the bucket; image `broken` is not an image at all."""
    import fsspec
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    images = _jpegs(40, 1)
    if broken is not None:
        images[broken] = b"this is not an image."
    urls = tuple(f"{gcs_bucket}/{prefix}/{i:04d}.jpg" for i in range(len(images)))
    for url, data in zip(urls, images):
        fs.pipe_file(url.removeprefix("gs://"), data)
    return Split("train", urls, labels=tuple(range(len(urls)))), sum(map(len, images))


def test_a_corrupt_image_is_named_though_the_cache_let_it_go(gcs_bucket, tmp_path):
    from tfdp.data.corrupt import LOG
    split, total = _small_tree(gcs_bucket, "named", broken=5)
    cfg = dataclasses.replace(_config(tmp_path, total // 4), max_bad_fraction=0.1)
    labels = _labels(split, cfg, 2 * 40 // BATCH)
    assert 5 not in labels and len(labels) == 2 * 40
    reason = LOG.entries[split.files[5]]
    assert "decodes when read again" not in reason and reason


def test_an_object_deleted_mid_run_ends_the_stream_in_one_line_naming_it(gcs_bucket, tmp_path):
    import fsspec

    from tfdp.data.pipeline import data_errors
    split, total = _small_tree(gcs_bucket, "vanishing")
    cfg = dataclasses.replace(_config(tmp_path, total // 4), remote_timeout=0.5)
    ds = train_dataset(split, cfg, BATCH, seed=7)
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    fs.rm([u.removeprefix("gs://") for u in split.files])
    with pytest.raises(UserError) as error, data_errors():
        for _ in ds.take(3 * 40 // BATCH):
            pass
    message = str(error.value)
    assert "\n" not in message and f"{gcs_bucket}/vanishing/" in message
    assert message.endswith(" is no longer in the bucket (deleted after the data was listed)"), message


def test_an_object_that_changed_size_since_the_listing_is_named(gcs_bucket, tmp_path):
    """Its bytes would not be the ones listed (a TFRecord's offsets, the cache's accounting): one line."""
    import fsspec

    from tfdp.data.pipeline import data_errors
    split, total = _small_tree(gcs_bucket, "changing")
    cfg = _config(tmp_path, total // 4)
    ds = train_dataset(split, cfg, BATCH, seed=7)
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    for url in split.files:
        fs.pipe_file(url.removeprefix("gs://"), fs.cat_file(url.removeprefix("gs://")) + b"appended")
    with pytest.raises(UserError) as error, data_errors():
        for _ in ds.take(3 * 40 // BATCH):
            pass
    assert re.fullmatch(rf"{gcs_bucket}/changing/\d{{4}}\.jpg changed after the data was listed: (\d+) bytes now, "
                        rf"(\d+) listed", str(error.value)), str(error.value)


def test_a_stream_built_again_takes_over_at_its_first_read(datasets, tmp_path):
    """A new image size rebuilds the stream: the old one may drain its prefetched batches; the new one
    starts fetching, and the old one lets its files go, when the new one is first read."""
    split, total = datasets["images"]
    cfg = _config(tmp_path, total // 4)
    first = train_dataset(split, cfg, BATCH, seed=7)
    old = iter(first)
    next(old)
    old_stream = _stream(cfg)
    second = train_dataset(split, dataclasses.replace(cfg, image_size=12), BATCH, seed=7,
                           books=Bookkeeping(start=(BATCH, 0)))
    new_stream = _stream(cfg)
    assert new_stream is not old_stream and not new_stream.fetched and old_stream.holding()
    with DiskPeak(tmp_path) as disk:
        images, labels = next(iter(second))
    assert images.shape[1] == 12 and not old_stream.holding() and disk.peak <= total // 4


def test_the_limit_is_a_size_in_bytes_or_auto():
    from tfdp.config import byte_size, load_config
    assert [byte_size(v) for v in ("20GB", "500 mb", "64GiB", "1.5KB", 4096, "auto")] == [
        20 * 10**9, 500 * 10**6, 64 * 2**30, 1500, 4096, None]
    for wrong in ("20XB", "lots", "", 0, -1):
        with pytest.raises(UserError, match=r"^config field 'data.cache_limit': expected a size such as 20GB"):
            load_config(None, {"data.cache_limit": wrong})
    assert storage.limit_bytes(DataConfig(cache_dir="/nonexistent/below/here")) > 0   # auto: free space


def test_a_dataset_iterated_again_starts_its_stream_again(datasets, tmp_path):
    """Keras may start an iterator, leave it and start another: the newest reads from the start, within
    the limit."""
    split, total = datasets["images"]
    cfg = _config(tmp_path, total // 4)
    ds = train_dataset(split, cfg, BATCH, seed=7)
    first = [int(v) for v in next(iter(ds))[1]]
    with DiskPeak(tmp_path) as disk:
        again = [int(v) for _, labels in ds.take(IMAGES // BATCH).as_numpy_iterator() for v in labels]
    assert again[:BATCH] == first and sorted(again) == list(range(IMAGES)) and disk.peak <= total // 4


def _bucket_tree(gcs_bucket: str) -> dict[str, int]:
    """An image_folder tree of 3 classes in the bucket (train: 36 images, val: 12); {split: its bytes}."""
    import fsspec
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    sizes = {"train": 0, "val": 0}
    for split, count in (("train", 36), ("val", 12)):
        for i, data in enumerate(_jpegs(count, 2)):
            fs.pipe_file(f"{gcs_bucket.removeprefix('gs://')}/tree/{split}/{'abc'[i % 3]}/{i}.jpg", data)
            sizes[split] += len(data)
    return sizes


def _train_args(gcs_bucket, tmp_path, name, cache_limit, *extra, epochs=2) -> list[str]:
    return ["--config=configs/digits.yaml", "--model=simple_cnn", "--data_format=image_folder",
            f"--data_dir={gcs_bucket}/tree", f"--model_dir={tmp_path / name}",
            f"--set=data.cache_dir={tmp_path / ('cache-' + name)}", f"--set=data.cache_limit={cache_limit}",
            "--set=model.num_classes=3", f"--epochs={epochs}", "--batch_size_per_replica=4",
            "--set=data.image_size=16", "--set=schedule.warmup_epochs=0", "--set=log.tensorboard=false", *extra]


def _train(gcs_bucket, tmp_path, name, cache_limit, *extra, epochs=2):
    """`tfdp train` as a process: deterministic (TensorFlow's op determinism, once on, stays on in the process
    that turned it on, so not in the test process)."""
    from conftest import run_tfdp
    return run_tfdp("train", *_train_args(gcs_bucket, tmp_path, name, cache_limit, "--set=train.deterministic=true",
                                          *extra, epochs=epochs), timeout=300)


@pytest.mark.full(reason="45 CPU-s: a stream within the limit reading what a full copy reads is "
                         "test_a_stream_four_times_the_limit_stays_within_it_and_reads_what_a_full_copy_reads")
def test_tfdp_train_streams_a_tree_larger_than_the_limit_to_the_weights_of_a_whole_copy(gcs_bucket, tmp_path):
    """The command line, through Keras and the distribution strategy (which start iterators of their own):
    2 deterministic epochs (the second streams the tree again) on a tree four times the limit keep at most the
    limit on disk at any moment, and end with the very weights of the same run with the tree copied whole."""
    from conftest import read_jsonl
    sizes = _bucket_tree(gcs_bucket)
    limit = sizes["train"] // 3   # training's share (3/4) is a quarter of its split, validation's a third of its

    def train(name, cache_limit):
        return _train(gcs_bucket, tmp_path, name, cache_limit)
    with DiskPeak(tmp_path / "cache-bounded") as disk:   # both splits stream, side by side
        bounded = train("bounded", limit)
    assert bounded.returncode == 0, bounded.stderr[-3000:]
    assert len(read_jsonl(tmp_path / "bounded" / "metrics.jsonl")) == 2
    assert 0 < disk.peak <= limit
    left = [str(f) for f in (tmp_path / "cache-bounded").rglob("*") if f.is_file()]
    assert not left, left   # nothing left behind
    whole = train("whole", "1GB")
    assert whole.returncode == 0, whole.stderr[-3000:]
    kept = tmp_path / "cache-whole" / "gs" / gcs_bucket.removeprefix("gs://") / "tree" / "train"
    assert sum(f.stat().st_size for f in kept.rglob("*") if f.is_file()) == sizes["train"]   # copied whole
    fingerprint = re.compile(r"weights fingerprint (\w+)")
    assert fingerprint.findall(bounded.stdout) == fingerprint.findall(whole.stdout) != []
    validation = [[row[k] for k in ("val_loss", "val_top1")] for row in read_jsonl(tmp_path / "bounded" / "metrics.jsonl")]
    assert validation == [[row[k] for k in ("val_loss", "val_top1")]
                          for row in read_jsonl(tmp_path / "whole" / "metrics.jsonl")]


@pytest.mark.full(reason="45 CPU-s: two streams sharing the limit are "
                         "test_a_training_run_splits_the_limit_between_its_two_streams")
def test_validation_on_the_training_split_keeps_its_copies_apart_from_the_training_stream(gcs_bucket, tmp_path,
                                                                                         capfd):
    """The training stream deletes each file it has read; validation on the same split must not lose its
    copies to it: every validation image is evaluated, none is counted corrupt."""
    from conftest import read_jsonl
    from support.inprocess import train_in_process
    sizes = _bucket_tree(gcs_bucket)
    capfd.readouterr()
    train_in_process(*_train_args(gcs_bucket, tmp_path, "same", sizes["train"] // 3, "--set=data.val_split=train",
                                  epochs=1))   # in this process: the exit status is not the point
    [row] = read_jsonl(tmp_path / "same" / "metrics.jsonl")
    assert "corrupt" not in capfd.readouterr().err and row["corrupt_images"] == 0 and "val_top1" in row
