"""The ImageNet data layer on real JPEG files in every layout, local and in a (real, emulated) bucket."""

from __future__ import annotations

import io
import os
import posixpath
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, last_line, read_jsonl, run_tfdp
from support.inprocess import train_in_process
from pipelines.convert_imagenet import Item, Prepared, convert, image_example
from support.photos import SYNSETS, write_imagenet_tree
from tfdp.config import DataConfig
from tfdp.data import build_source
from tfdp.data.pipeline import Bookkeeping, CorruptCounter, StreamPosition, data_errors, eval_dataset, pipeline_share, train_dataset
from tfdp.data.preprocess import random_crop
from tfdp.data.storage import localize
from tfdp.errors import UserError

CLASSES = 3


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("trees")
    truth = write_imagenet_tree(str(root / "ilsvrc"), CLASSES, 4, 2, "ilsvrc")
    assert write_imagenet_tree(str(root / "kaggle"), CLASSES, 4, 2, "kaggle") == truth
    return {"ilsvrc": str(root / "ilsvrc"), "kaggle": str(root / "kaggle"), "truth": truth}


@pytest.fixture(scope="module")
def shards(trees, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shards") / "imagenet")
    convert(trees["ilsvrc"], out, train_shards=3, val_shards=2, workers=1, progress=False)
    return out


def truth_labels(truth: dict, split: str) -> dict[str, int]:
    synsets = [s for s, _ in SYNSETS[:CLASSES]]
    return {name: synsets.index(synset) for name, synset in truth[split].items()}


def listed_pairs(source, split: str) -> dict[str, int]:
    data = source.split(split)
    return {posixpath.basename(f): label for f, label in zip(data.files, data.labels)}


def record_pairs(source, split: str, name_key: str = "image/filename", cache_dir: str = "") -> dict[str, int]:
    """(file name → label) as the pipeline would label each record."""
    data = source.split(split)
    fmt = data.records
    pairs = {}
    for record in tf.data.TFRecordDataset(localize(data.files, cache_dir) if cache_dir else list(data.files)):
        example = tf.train.Example.FromString(record.numpy()).features.feature
        pairs[example[name_key].bytes_list.value[0].decode()] = example[fmt.label_key].int64_list.value[0] + fmt.label_offset
    return pairs


def pipeline_labels(source, split: str, image_size: int = 32, cache_dir: str = "~/.cache/tfdp/remote") -> list[int]:
    cfg = DataConfig(image_size=image_size, cache_dir=cache_dir)
    labels = []
    for _, label, weight in eval_dataset(source.split(split), cfg, 4, num_classes=source.num_classes or 1000):
        labels += [int(x) for x, w in zip(label.numpy(), weight.numpy()) if w > 0]
    return sorted(labels)


def test_raw_layouts_label_every_image_like_the_ground_truth(trees):
    for layout in ("ilsvrc", "kaggle"):
        source = build_source(DataConfig(format="imagenet", dir=trees[layout]))
        assert source.class_names == tuple(s for s, _ in SYNSETS[:CLASSES])
        assert source.class_text[0] == "tench, Tinca tinca"
        for split in ("train", "val"):
            assert listed_pairs(source, split) == truth_labels(trees["truth"], split), (layout, split)


def test_converted_shards_are_the_standard_format_with_the_same_labels(trees, shards):
    names = sorted(os.listdir(shards))
    assert [n for n in names if not n.startswith(".") and "-of-" in n] == [
        "train-00000-of-00003", "train-00001-of-00003", "train-00002-of-00003",
        "validation-00000-of-00002", "validation-00001-of-00002"]
    source = build_source(DataConfig(format="tfrecord", dir=shards))
    assert source.class_names == tuple(s for s, _ in SYNSETS[:CLASSES])
    for split in ("train", "val"):
        assert record_pairs(source, split) == truth_labels(trees["truth"], split)
        assert pipeline_labels(source, split) == sorted(truth_labels(trees["truth"], split).values())
    first = next(iter(tf.data.TFRecordDataset(source.split("train").files[0])))
    feature = tf.train.Example.FromString(first.numpy()).features.feature
    for key in ("image/encoded", "image/class/label", "image/class/synset", "image/class/text", "image/height",
                "image/width", "image/filename", "image/format", "image/object/bbox/xmin"):
        assert key in feature, key
    synset = feature["image/class/synset"].bytes_list.value[0].decode()
    assert feature["image/class/label"].int64_list.value[0] == [s for s, _ in SYNSETS].index(synset) + 1  # 1-based


def tensorflows_example(item: Item, image: Prepared) -> bytes:
    """What TensorFlow's own tf.train.Example serializes for a record of `item` whose boxes are already normalised
    (source size 1 x 1): every feature of the standard shards, the four box lists present when empty."""
    def feature(kind, values):
        lists = {"int64_list": tf.train.Int64List, "float_list": tf.train.FloatList, "bytes_list": tf.train.BytesList}
        return tf.train.Feature(**{kind: lists[kind](value=list(values))})
    boxes = np.array(item.boxes, np.float32).reshape(-1, 4)
    label = item.label + 1
    return tf.train.Example(features=tf.train.Features(feature={
        "image/height": feature("int64_list", [image.height]), "image/width": feature("int64_list", [image.width]),
        "image/colorspace": feature("bytes_list", [b"RGB"]), "image/channels": feature("int64_list", [3]),
        "image/class/label": feature("int64_list", [label]),
        "image/class/synset": feature("bytes_list", [item.synset.encode()]),
        "image/class/text": feature("bytes_list", [item.text.encode()]),
        **{f"image/object/bbox/{k}": feature("float_list", boxes[:, i]) for i, k in enumerate(("xmin", "ymin", "xmax",
                                                                                                "ymax"))},
        "image/object/bbox/label": feature("int64_list", [label] * len(boxes)),
        "image/format": feature("bytes_list", [b"JPEG"]), "image/filename": feature("bytes_list", [item.path.encode()]),
        "image/encoded": feature("bytes_list", [image.encoded])})).SerializeToString(deterministic=True)


def test_the_converter_writes_tensorflows_own_bytes_without_importing_it(trees, tmp_path):
    """A converter process imports no TensorFlow (3.8 s and 660 MB a worker): its Example is protobuf's own
    message and its framing a CRC-32C library's. Each record is the bytes TensorFlow's Example gives the same
    values, with boxes and without, and each shard the file TensorFlow's own writer writes from those records."""
    out = tmp_path / "shards"
    script = ("import sys; from pipelines.convert_imagenet import convert\n"
              "for tree in ('kaggle', 'ilsvrc'):  # boxes from Kaggle's CSV files; none in the ILSVRC tree\n"
              f"    convert({trees}[tree], {str(out)!r} + '/' + tree, train_shards=2, val_shards=1, workers=1, progress=False)\n"
              "print('tensorflow' in sys.modules)")
    converted = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert converted.returncode == 0 and converted.stdout.split()[-1] == "False", converted.stderr[-2000:]
    boxed = []
    for shard in sorted(p for p in out.glob("*/*-of-*") if not p.name.startswith(".")):   # not the summaries
        records = [r.numpy() for r in tf.data.TFRecordDataset(str(shard))]
        for record in records:
            f = tf.train.Example.FromString(record).features.feature
            text = {k: f[f"image/{k}"].bytes_list.value[0] for k in ("class/synset", "class/text", "filename",
                                                                      "encoded")}
            boxes = tuple(zip(*(f[f"image/object/bbox/{k}"].float_list.value for k in ("xmin", "ymin", "xmax", "ymax"))))
            item = Item(text["filename"].decode(), f["image/class/label"].int64_list.value[0] - 1,
                        text["class/synset"].decode(), text["class/text"].decode(), boxes)
            image = Prepared(text["encoded"], f["image/height"].int64_list.value[0],
                             f["image/width"].int64_list.value[0], (1, 1))
            assert record == tensorflows_example(item, image), shard.name
            boxed.append(bool(boxes))
        with tf.io.TFRecordWriter(str(tmp_path / "by-tensorflow")) as writer:
            for record in records:
                writer.write(record)
        assert (tmp_path / "by-tensorflow").read_bytes() == shard.read_bytes(), shard.name
    assert len(boxed) == 2 * 3 * (4 + 2) and any(boxed) and not all(boxed)


def test_kaggle_boxes_reach_the_records_normalised(trees, tmp_path):
    out = str(tmp_path / "kaggle-shards")
    convert(trees["kaggle"], out, train_shards=1, val_shards=1, workers=1, progress=False)
    source = build_source(DataConfig(format="tfrecord", dir=out))
    for record in tf.data.TFRecordDataset(source.split("val").files):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        xmin = feature["image/object/bbox/xmin"].float_list.value
        xmax = feature["image/object/bbox/xmax"].float_list.value
        assert len(xmin) >= 1 and all(0 <= a < b <= 1 for a, b in zip(xmin, xmax))


def test_ilsvrc_bbox_xmls_reach_the_records_of_their_own_class(trees, tmp_path):
    """The unpacked ILSVRC2012 bbox archives: train/<wnid>/<id>.xml and a flat val/; Pascal-VOC XML, pixels."""
    bbox_dir = tmp_path / "bbox"
    from PIL import Image

    def landscape(image_id, folder):  # the boxes below are for 500x375 images (photos also writes 375x500 ones)
        with Image.open(os.path.join(trees["ilsvrc"], folder, image_id)) as image:
            return image.size == (500, 375)
    val_id, val_synset = next((i, s) for i, s in sorted(trees["truth"]["val"].items()) if landscape(i, "val"))
    train_id, train_synset = next((i, s) for i, s in sorted(trees["truth"]["train"].items())
                                  if landscape(i, os.path.join("train", s)))
    other = next(s for s, _ in SYNSETS if s != train_synset)
    xml = "<annotation><filename>{id}</filename><size><width>500</width><height>375</height></size>{objects}</annotation>"
    obj = "<object><name>{name}</name><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
    for folder, image, objects in (
            (bbox_dir / "train" / train_synset, train_id, obj.format(name=train_synset, x0=50, y0=75, x1=250, y1=300)
             + obj.format(name=other, x0=0, y0=0, x1=10, y1=10)),  # another class: left out, as TF's script does
            (bbox_dir / "val", val_id, obj.format(name=val_synset, x0=100, y0=0, x1=500, y1=375))):
        folder.mkdir(parents=True, exist_ok=True)
        stem = os.path.splitext(image)[0]
        (folder / f"{stem}.xml").write_text(xml.format(id=stem, objects=objects))
    out = str(tmp_path / "shards")
    convert(trees["ilsvrc"], out, train_shards=1, val_shards=1, workers=1, progress=False, bbox_dir=str(bbox_dir))
    source = build_source(DataConfig(format="tfrecord", dir=out))
    boxes = {}
    for split in ("train", "val"):
        for record in tf.data.TFRecordDataset(source.split(split).files):
            f = tf.train.Example.FromString(record.numpy()).features.feature
            boxes[f["image/filename"].bytes_list.value[0].decode()] = [
                tuple(round(v, 4) for v in f[f"image/object/bbox/{k}"].float_list.value)
                for k in ("xmin", "ymin", "xmax", "ymax")]
    assert boxes.pop(train_id) == [(0.1,), (0.2,), (0.5,), (0.8,)]
    assert boxes.pop(val_id) == [(0.2,), (0.0,), (1.0,), (1.0,)]
    assert all(b == [(), (), (), ()] for b in boxes.values())  # no XML, no box
    (bbox_dir / "val" / "broken.xml").write_text("<annotation><object><name>x</name></object>")
    with pytest.raises(UserError, match="broken.xml: not an ILSVRC bounding-box XML"):
        convert(trees["ilsvrc"], str(tmp_path / "again"), train_shards=1, val_shards=1, workers=1, progress=False,
                bbox_dir=str(bbox_dir))


def test_shards_in_a_bucket_are_fetched_per_worker_and_read_the_same(trees, shards, gcs_bucket, tmp_path):
    import fsspec

    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    fs.put(shards, gcs_bucket.removeprefix("gs://") + "/imagenet", recursive=True)
    cache = tmp_path / "cache"
    cfg = DataConfig(format="tfrecord", dir=f"{gcs_bucket}/imagenet", cache_dir=str(cache), image_size=32)
    source = build_source(cfg)
    train = source.split("train")
    assert all(f.startswith(f"{gcs_bucket}/imagenet/train-") for f in train.files) and len(train.files) == 3
    assert not cache.exists()  # the counts come from counts.json: nothing copied to list the data
    # Worker 1 of 2 gets shard 1 of 3 (file-level sharding) and copies only that one.
    worker1 = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2)
    next(iter(train_dataset(train, cfg, 4, seed=0, input_context=worker1)))
    cached = cache / "gs" / gcs_bucket.removeprefix("gs://") / "imagenet"
    assert sorted(os.listdir(cached)) == [posixpath.basename(train.files[1])]
    for split in ("train", "val"):
        assert record_pairs(source, split, cache_dir=str(cache)) == truth_labels(trees["truth"], split)
    mtimes = {name: os.path.getmtime(cached / name) for name in os.listdir(cached)}
    next(iter(train_dataset(train, cfg, 4, seed=0, input_context=worker1)))  # warm: nothing is fetched again
    assert {name: os.path.getmtime(cached / name) for name in os.listdir(cached)} == mtimes


def test_raw_tree_in_a_bucket_is_listed_and_decoded(trees, gcs_bucket, tmp_path):
    import fsspec

    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    fs.put(trees["kaggle"], gcs_bucket.removeprefix("gs://") + "/kaggle", recursive=True)
    source = build_source(DataConfig(format="imagenet", dir=f"{gcs_bucket}/kaggle"))
    assert source.split("val").files[0].startswith(f"{gcs_bucket}/kaggle/ILSVRC/Data/CLS-LOC/val/")
    for split in ("train", "val"):
        assert listed_pairs(source, split) == truth_labels(trees["truth"], split)
    cfg = DataConfig(image_size=32, cache_dir=str(tmp_path / "cache"))
    labels = [int(x) for _, label, weight in eval_dataset(source.split("val"), cfg, 4, num_classes=CLASSES)
              for x, w in zip(label.numpy(), weight.numpy()) if w > 0]
    assert sorted(labels) == sorted(truth_labels(trees["truth"], "val").values())


def _tfds_photo_builder(tree: str, truth: dict):
    import tensorflow_datasets as tfds

    class PhotoTree(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """A tiny image-classification dataset prepared locally, as a user's own TFDS dataset would be."""
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, supervised_keys=("image", "label"), features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(encoding_format="jpeg"),
                "label": tfds.features.ClassLabel(names=[s for s, _ in SYNSETS[:CLASSES]]),
                "file_name": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples("train"), "validation": self._generate_examples("val")}

        def _generate_examples(self, split):
            for name, synset in truth[split].items():
                folder = os.path.join(tree, "train", synset) if split == "train" else os.path.join(tree, "val")
                yield name, {"image": os.path.join(folder, name), "label": synset, "file_name": name}

    return PhotoTree


def test_prepared_tfds_dataset_gives_the_same_labels(trees, tmp_path):
    data_dir = str(tmp_path / "tfds")
    _tfds_photo_builder(trees["ilsvrc"], trees["truth"])(data_dir=data_dir).download_and_prepare()
    source = build_source(DataConfig(format="tfds", dir=data_dir, tfds_name="photo_tree"))
    assert source.class_names == tuple(s for s, _ in SYNSETS[:CLASSES])
    for split in ("train", "val"):
        assert record_pairs(source, split, "file_name") == truth_labels(trees["truth"], split)
        assert pipeline_labels(source, split) == sorted(truth_labels(trees["truth"], split).values())


def test_tfds_dataset_in_a_bucket_copies_metadata_first_and_shards_per_pipeline(trees, gcs_bucket, tmp_path):
    import fsspec

    data_dir = str(tmp_path / "tfds")
    _tfds_photo_builder(trees["ilsvrc"], trees["truth"])(data_dir=data_dir).download_and_prepare()
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    fs.put(data_dir, gcs_bucket.removeprefix("gs://") + "/tfds", recursive=True)
    cache = tmp_path / "cache"
    source = build_source(DataConfig(format="tfds", dir=f"{gcs_bucket}/tfds", tfds_name="photo_tree", cache_dir=str(cache)))
    assert all(f.startswith(f"{gcs_bucket}/tfds/photo_tree/1.0.0/") for f in source.split("train").files)
    cached = [f for _, _, names in os.walk(cache) for f in names]
    assert "dataset_info.json" in cached and not [f for f in cached if ".tfrecord-" in f]
    for split in ("train", "val"):
        assert record_pairs(source, split, "file_name", cache_dir=str(cache)) == truth_labels(trees["truth"], split)
        assert pipeline_labels(source, split, cache_dir=str(cache)) == sorted(truth_labels(trees["truth"], split).values())


@pytest.mark.slow
def test_tfds_imagenet2012_is_prepared_from_its_manual_dir(trees, tmp_path):
    """The two ILSVRC2012 tars (tiny here) are all TFDS needs: nothing is downloaded."""
    manual = tmp_path / "manual"
    manual.mkdir()
    with tarfile.open(manual / "ILSVRC2012_img_train.tar", "w") as outer:
        for synset in sorted(set(trees["truth"]["train"].values())):
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for name in sorted(n for n, s in trees["truth"]["train"].items() if s == synset):
                    tar.add(os.path.join(trees["ilsvrc"], "train", synset, name), arcname=name)
            info = tarfile.TarInfo(f"{synset}.tar")
            info.size = inner.tell()
            inner.seek(0)
            outer.addfile(info, inner)
    with tarfile.open(manual / "ILSVRC2012_img_val.tar", "w") as tar:
        for name in sorted(trees["truth"]["val"]):
            tar.add(os.path.join(trees["ilsvrc"], "val", name), arcname=name)
    source = build_source(DataConfig(format="tfds", dir=str(tmp_path / "tfds"), tfds_name="imagenet2012",
                                     tfds_manual_dir=str(manual)))
    assert source.num_classes == 1000 and source.class_names == tuple(sorted(source.class_names))
    assert record_pairs(source, "train", "file_name") == truth_labels(trees["truth"], "train")
    import tensorflow_datasets as tfds
    official = tfds.builder("imagenet2012").info.features["label"].names  # TFDS' own validation labels
    val = record_pairs(source, "val", "file_name")
    assert len(val) == len(trees["truth"]["val"]) and all(0 <= label < 1000 for label in val.values())
    assert [source.class_names[val[n]] for n in sorted(val)] == [official[val[n]] for n in sorted(val)]


def test_training_crop_decodes_only_the_window_and_matches_a_full_decode(trees, tmp_path):
    cfg = DataConfig(format="imagenet", dir=trees["ilsvrc"], image_size=64)
    path = build_source(cfg).split("train").files[0]
    jpeg = tf.io.read_file(path)
    png = tf.io.encode_png(tf.io.decode_jpeg(jpeg, dct_method="INTEGER_ACCURATE"))
    for seed in ([1, 2], [3, 4], [5, 6]):
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.io.extract_jpeg_shape(jpeg), tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]), seed=seed,
            min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10)
        full = tf.io.decode_jpeg(jpeg, channels=3, dct_method="INTEGER_ACCURATE")
        window = tf.cast(tf.slice(full, begin, size), tf.float32)
        expected = tf.cast(tf.image.resize(window, [64, 64]) + 0.5, tf.uint8).numpy()
        assert 0 < size[0] * size[1] < 500 * 375  # a real window, smaller than the image
        assert np.array_equal(random_crop(jpeg, cfg, tf.constant(seed, tf.int64)).numpy(), expected)
        assert np.array_equal(random_crop(png, cfg, tf.constant(seed, tf.int64)).numpy(), expected)


def test_deterministic_pipeline_repeats_its_crops_and_the_seed_changes_them(trees):
    cfg = DataConfig(format="imagenet", dir=trees["ilsvrc"], image_size=32, deterministic=True, shuffle_buffer=4)
    split = build_source(cfg).split("train")
    first = {seed: [next(iter(train_dataset(split, cfg, 8, seed=seed)))[0].numpy() for _ in range(2)]
             for seed in (0, 1)}
    for a, b in first.values():
        assert np.array_equal(a, b)  # the same seed: the same batch
    assert not np.array_equal(first[0][0], first[1][0])


@pytest.mark.parametrize("data_format", ["imagenet", "tfrecord"])
def test_a_stream_resumed_at_any_position_continues_the_uninterrupted_one(trees, shards, data_format):
    """Resuming at record k (within an epoch or past several) gives exactly the uninterrupted batches from k."""
    cfg = DataConfig(format=data_format, dir=trees["ilsvrc"] if data_format == "imagenet" else shards, image_size=32,
                     deterministic=True, shuffle_buffer=4)
    split = build_source(cfg).split("train")
    n = split.num_examples
    position = StreamPosition()
    stream = iter(train_dataset(split, cfg, 4, seed=5, books=Bookkeeping(position=position)))
    batches = [next(stream) for _ in range(3 * n // 4 + 2)]  # three data epochs and a bit
    assert position.after(3) == (12, 0)
    epoch1, epoch2 = [np.concatenate([b[1].numpy() for b in batches[i * n // 4:(i + 1) * n // 4]]) for i in (0, 1)]
    assert sorted(epoch1) == sorted(epoch2) and not np.array_equal(epoch1, epoch2)  # each epoch reshuffled
    for k in (1, n // 4 + 1, 2 * n // 4 + 1):
        resumed = iter(train_dataset(split, cfg, 4, seed=5, books=Bookkeeping(start=(4 * k, 0))))
        for want in batches[k:k + 2]:
            got = next(resumed)
            assert np.array_equal(got[0].numpy(), want[0].numpy()) and np.array_equal(got[1].numpy(), want[1].numpy())


def uninterrupted_copy(source, copy, data_format):
    """A copy of the data (for a test to damage), its config and training split, its size n, a resume
    point k, and the uninterrupted stream's first epoch of batches of 4 (seed 9)."""
    shutil.copytree(source, copy)
    cfg = DataConfig(format=data_format, dir=str(copy), image_size=32, deterministic=True, shuffle_buffer=4)
    split = build_source(cfg).split("train")
    n = split.num_examples
    uninterrupted = iter(train_dataset(split, cfg, 4, seed=9))
    return cfg, split, n, 8, [next(uninterrupted) for _ in range(n // 4)]


def corrupt_in_resumed_epoch(split, cfg, k, batches):
    """Resume the stream at record k, check it continues with the uninterrupted epoch's `batches`,
    and return the corrupt images it met up to that epoch's end. Read from the stream's own
    positions, not the running counter: the pipeline reads ahead into the next epoch, where the
    skipped records come round again."""
    position = StreamPosition()
    resumed = iter(train_dataset(split, cfg, 4, seed=9, books=Bookkeeping(start=(k, 0), position=position,
                                                                          corrupt=CorruptCounter())))
    for want in batches[k // 4:]:
        assert np.array_equal(next(resumed)[0].numpy(), want[0].numpy())
    return position.after(len(batches) - k // 4)[1]


def test_a_resumed_stream_reads_no_image_it_skips(trees, tmp_path):
    """Resuming at record k decodes only what follows: the k skipped files can even be gone."""
    cfg, split, n, k, batches = uninterrupted_copy(trees["ilsvrc"], tmp_path / "tree", "imagenet")
    for path in stream_files(split, cfg, seed=9, count=k):
        os.remove(path)
    assert corrupt_in_resumed_epoch(split, cfg, k, batches) == 0  # not one of them was read


def stream_files(split, cfg, seed, count):
    """The files behind the first `count` records of the training stream (the pipeline's own order)."""
    from tfdp.data import order
    ctx = tf.distribute.InputContext()
    ds = order.epoch_payloads(split, cfg, ctx, False, seed, split.num_examples).take(count)
    return [path.decode() for path, _ in ds.as_numpy_iterator()]


def shards_read_in_order(share, cfg, ctx, data_shard, seed, first_epoch, size, offset):
    """The record stream's definition: each epoch the shards in the permutation (seed, epoch) draws, read
    front to back, round robin 16 at a time (every n-th record when sharding by example), through the
    seeded shuffle buffer and repeated augmentation."""
    from tfdp.data import order as stream_order
    buffer = min(cfg.shuffle_buffer, max(share.num_examples, 1))
    files, n = tf.constant(list(share.files)), len(share.files)

    def epoch(e):
        order = tf.random.experimental.index_shuffle(tf.range(n, dtype=tf.int64),
                                                     tf.stack([tf.constant(seed, tf.int64), e]), n - 1)
        ds = tf.data.Dataset.from_tensor_slices(tf.gather(files, order)).interleave(
            tf.data.TFRecordDataset, cycle_length=min(n, 16))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id) if data_shard else ds
        return ds.shuffle(buffer, seed=seed, reshuffle_each_iteration=False).apply(
            stream_order.repeated(cfg.repeated_augmentation, size))
    return tf.data.Dataset.range(first_epoch, stream_order.MAX_EPOCHS).flat_map(epoch).skip(offset)


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """20 shards (more than one interleave cycle) of 0 to 6 records of different lengths; a Split of them."""
    from tfdp.data.layouts import Split
    from tfdp.data.layouts.tfrecord import IMAGENET_RECORDS
    root = tmp_path_factory.mktemp("many")
    files, counts = [], []
    for s in range(20):
        files.append(str(root / f"train-{s:05d}-of-00020"))
        counts.append((s * 7) % 6 if s != 4 else 0)
        with tf.io.TFRecordWriter(files[-1]) as writer:
            for r in range(counts[-1]):
                writer.write(f"shard {s} record {r} ".encode() * (1 + (s + r) % 5))
    return Split("train", tuple(files), counts=tuple(counts), records=IMAGENET_RECORDS)


@pytest.mark.parametrize("shuffle_buffer,repeated", [(7, 1), (1000, 1), (5, 3)])
@pytest.mark.parametrize("pipelines,index", [(1, 0), (3, 1), (25, 4)])  # 25 > 20 shards: sharded by example
def test_a_record_stream_is_the_shards_read_in_order_through_the_seeded_buffer(many_shards, shuffle_buffer, repeated,
                                                                               pipelines, index):
    """The records the training stream yields, position by position, are those reading the shards themselves
    gives: the same seed gives the same records as ever, from any epoch and offset."""
    from tfdp.data import order
    from tfdp.data.layouts.tfrecord import read_record
    cfg = DataConfig(shuffle_buffer=shuffle_buffer, repeated_augmentation=repeated)
    ctx = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=index,
                                     num_replicas_in_sync=pipelines)
    share, data_shard = pipeline_share(many_shards, ctx)
    size = order.share_sizes(many_shards, pipelines)[index]
    for first_epoch, offset in ((0, 0), (2, min(5, size - 1))):
        want = list(shards_read_in_order(share, cfg, ctx, data_shard, 9, first_epoch, size, offset)
                    .take(3 * size).as_numpy_iterator())
        stream = order.epoch_payloads(share, cfg, ctx, data_shard, 9, size, (first_epoch, offset))
        got = list(stream.take(3 * size).map(read_record).as_numpy_iterator())
        assert got == want


def damage_record(path: str, offset: int) -> None:
    """Flips a byte inside the data of the record at `offset`: its CRC no longer matches."""
    with open(path, "r+b") as f:
        f.seek(offset + 12 + 40)
        byte = f.read(1)
        f.seek(offset + 12 + 40)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_resumed_record_stream_reads_no_record_it_skips(shards, tmp_path):
    """Resuming at record k reads only what follows: the k skipped records can even be damaged."""
    from tfdp.data import order
    cfg, split, n, k, batches = uninterrupted_copy(shards, tmp_path / "shards", "tfrecord")
    skipped = order.epoch_payloads(split, cfg, tf.distribute.InputContext(), False, 9, n).take(k)
    for path, offset in skipped.as_numpy_iterator():
        damage_record(path.decode(), int(offset))
    assert corrupt_in_resumed_epoch(split, cfg, k, batches) == 0  # not one of them was read


def test_a_damaged_record_costs_only_itself(trees, tmp_path):
    """A record failing its CRC is one corrupt image; the records after it in its shard are still read."""
    from tfdp.data.layouts.tfrecord import record_offsets
    write_records(str(tmp_path / "rec"), trees["ilsvrc"])
    shard = str(tmp_path / "rec" / "train-00000-of-00001")
    damage_record(shard, int(record_offsets(shard)[0][5]))
    cfg = DataConfig(format="tfrecord", dir=str(tmp_path / "rec"), image_size=32, max_bad_fraction=0.5)
    counter = CorruptCounter()
    batches = list(eval_dataset(build_source(cfg).split("val"), cfg, 4, num_classes=CLASSES, corrupt=counter))
    assert sum(float(tf.reduce_sum(b[2])) for b in batches) == 19
    assert counter.value() == 1


def test_synthetic_format_needs_no_files():
    cfg = DataConfig(format="synthetic", synthetic_examples=100, image_size=16)
    source = build_source(cfg)
    assert source.split("train").num_examples == 100
    images, labels = next(iter(train_dataset(source.split("train"), cfg, 8, seed=0, books=Bookkeeping(num_classes=10))))
    assert images.shape == (8, 16, 16, 3) and images.dtype == tf.uint8 and int(tf.reduce_max(labels)) < 10
    batches = list(eval_dataset(source.split("val"), cfg, 8, num_classes=10))
    assert sum(float(tf.reduce_sum(w)) for _, _, w in batches) == source.split("val").num_examples


def test_synthetic_data_flows_through_the_same_sharding_and_resumable_stream():
    """Synthetic data is a source like any other: whole parts per pipeline, stream positions recorded,
    and a stream resumed at a position continues the uninterrupted one."""
    cfg = DataConfig(format="synthetic", synthetic_examples=100, image_size=8)
    train = build_source(cfg).split("train")
    sizes = [pipeline_share(train, tf.distribute.InputContext(2, i, 2))[0].num_examples for i in (0, 1)]
    assert sizes == [50, 50] and not any(pipeline_share(train, tf.distribute.InputContext(2, i, 2))[1] for i in (0, 1))
    position = StreamPosition()
    whole = list(train_dataset(train, cfg, 8, seed=0, books=Bookkeeping(position=position, num_classes=10)).take(5))
    assert position.after(3) == (24, 0)
    resumed = list(train_dataset(train, cfg, 8, seed=0, books=Bookkeeping(start=(24, 0), num_classes=10)).take(2))
    for (a, la), (b, lb) in zip(whole[3:], resumed):
        assert np.array_equal(a, b) and np.array_equal(la, lb)


# --- conversion ------------------------------------------------------------

def add_awkward_files(tree: str) -> dict[str, str]:
    """Beside the normal files, what ILSVRC2012 really contains, plus broken files. Returns {name: kind}."""
    from PIL import Image

    folder = os.path.join(tree, "train", SYNSETS[0][0])
    photo = Image.open(os.path.join(folder, sorted(os.listdir(folder))[0]))
    photo.convert("CMYK").save(os.path.join(folder, "cmyk.JPEG"), "JPEG")
    photo.save(os.path.join(folder, "png.JPEG"), "PNG")
    photo.convert("L").save(os.path.join(folder, "grey.JPEG"), "JPEG")
    data = open(os.path.join(folder, sorted(os.listdir(folder))[0]), "rb").read()
    with open(os.path.join(folder, "truncated.JPEG"), "wb") as f:
        f.write(data[: len(data) // 2])
    open(os.path.join(folder, "empty.JPEG"), "wb").close()
    return {"cmyk.JPEG": "cmyk", "png.JPEG": "png", "grey.JPEG": "grey", "truncated.JPEG": "bad", "empty.JPEG": "bad"}


def test_conversion_repairs_real_oddities_and_reports_every_bad_file(tmp_path):
    tree = str(tmp_path / "tree")
    truth = write_imagenet_tree(tree, CLASSES, 4, 2, "ilsvrc")
    kinds = add_awkward_files(tree)
    out = str(tmp_path / "out")
    report = convert(tree, out, train_shards=2, val_shards=1, workers=1, progress=False)
    bad = sorted(posixpath.basename(b["file"]) for b in report["bad_files"])
    assert bad == ["empty.JPEG", "truncated.JPEG"]
    assert {posixpath.basename(b["file"]): b["reason"].split(" (")[0] for b in report["bad_files"]} == {
        "empty.JPEG": "zero-byte file", "truncated.JPEG": "cannot decode"}
    listed = len(truth["train"]) + len(kinds)
    assert report["splits"]["train"]["examples"] == listed - 2
    assert report["splits"]["train"]["skipped"] == 2
    assert report["splits"]["validation"]["examples"] == len(truth["val"])
    records = {}
    for record in tf.data.TFRecordDataset(sorted(str(p) for p in (tmp_path / "out").glob("train-*"))):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        records[feature["image/filename"].bytes_list.value[0].decode()] = feature["image/encoded"].bytes_list.value[0]
    assert len(records) == listed - 2
    for name in ("cmyk.JPEG", "png.JPEG", "grey.JPEG"):
        assert tf.io.is_jpeg(records[name]), name
        image = tf.io.decode_jpeg(records[name], channels=3)
        assert image.shape[-1] == 3 and int(tf.reduce_max(image)) > 0
    original = open(os.path.join(tree, "train", SYNSETS[0][0], f"{SYNSETS[0][0]}_1.JPEG"), "rb").read()
    assert records[f"{SYNSETS[0][0]}_1.JPEG"] == original  # good JPEGs are stored untouched


def test_conversion_downscales_to_max_side(trees, tmp_path):
    out = str(tmp_path / "small")
    convert(trees["ilsvrc"], out, train_shards=1, val_shards=1, workers=1, max_side=128, progress=False)
    for record in tf.data.TFRecordDataset([os.path.join(out, "train-00000-of-00001")]):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        image = tf.io.decode_jpeg(feature["image/encoded"].bytes_list.value[0])
        assert max(image.shape[:2]) == 128
        assert (feature["image/height"].int64_list.value[0], feature["image/width"].int64_list.value[0]) == tuple(
            image.shape[:2])


@pytest.mark.slow
def test_interrupted_conversion_resumes_to_byte_identical_shards(tmp_path):
    """Kill the converter mid-way, run it again (in parallel this time): same bytes as one clean serial run."""
    import signal
    import subprocess
    import sys
    import time

    tree = str(tmp_path / "tree")
    write_imagenet_tree(tree, CLASSES, 12, 2, "ilsvrc")
    add_awkward_files(tree)
    clean = str(tmp_path / "clean")
    convert(tree, clean, train_shards=12, val_shards=2, workers=1, progress=False)

    resumed = str(tmp_path / "resumed")
    cmd = [sys.executable, "-m", "pipelines.convert_imagenet", f"--src={tree}", f"--out={resumed}",
           "--train_shards=12", "--val_shards=2"]
    repo = REPO
    proc = subprocess.Popen(cmd + ["--workers=1"], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.isdir(resumed) and len([n for n in os.listdir(resumed) if n.startswith("train-")]) >= 3:
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [n for n in os.listdir(resumed) if n.startswith("train-")]
    assert 3 <= len(done) < 12, "the converter was not interrupted mid-way"
    assert not os.path.exists(os.path.join(resumed, "counts.json"))

    result = subprocess.run(cmd + ["--workers=2"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skipped 2 bad file(s)" in last_line(result.stdout)
    shard_names = sorted(n for n in os.listdir(clean) if "-of-" in n and not n.startswith("."))
    assert sorted(n for n in os.listdir(resumed) if "-of-" in n and not n.startswith(".")) == shard_names
    for name in shard_names:
        with open(os.path.join(clean, name), "rb") as a, open(os.path.join(resumed, name), "rb") as b:
            assert a.read() == b.read(), name
    assert not [n for n in os.listdir(resumed) if ".tmp" in n]


def test_conversion_refuses_more_shards_than_images(trees, tmp_path):
    with pytest.raises(UserError, match="at most 6 shards"):
        convert(trees["ilsvrc"], str(tmp_path / "x"), train_shards=2, val_shards=7, workers=1, progress=False)


# --- corrupt records, labels, sharding --------------------------------------

def write_records(path: str, shards, corrupt_at=(), label_of=lambda i: i % CLASSES + 1, n: int = 20) -> None:
    """n records of real JPEGs, with garbage or truncated image bytes at `corrupt_at`."""
    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(shards) for f in fs if f.endswith(".JPEG"))
    os.makedirs(path, exist_ok=True)
    jpeg = open(files[0], "rb").read() if files else None
    with tf.io.TFRecordWriter(os.path.join(path, "train-00000-of-00001")) as writer:
        for i in range(n):
            data = jpeg if i not in corrupt_at else (b"not an image" if i % 2 else jpeg[:200])
            item = Item(f"img{i}.JPEG", label_of(i) - 1, SYNSETS[0][0], "t")
            writer.write(image_example(item, Prepared(data, 375, 500, (500, 375))).SerializeToString())
    for name in ("validation-00000-of-00001",):
        os.link(os.path.join(path, "train-00000-of-00001"), os.path.join(path, name))
    with open(os.path.join(path, "synsets.txt"), "w") as f:
        f.writelines(f"{s}\t{t}\n" for s, t in SYNSETS[:CLASSES])


def test_corrupt_records_are_counted_and_evaluation_still_counts_each_good_one(trees, tmp_path):
    write_records(str(tmp_path / "rec"), trees["ilsvrc"], corrupt_at=(3, 8, 11))
    cfg = DataConfig(format="tfrecord", dir=str(tmp_path / "rec"), image_size=32, max_bad_fraction=0.5)
    source = build_source(cfg)
    counter = CorruptCounter()
    batches = list(eval_dataset(source.split("val"), cfg, 4, num_classes=CLASSES, corrupt=counter))
    assert sum(b[0].shape[0] for b in batches) == 20       # padded back to whole steps
    assert sum(float(tf.reduce_sum(b[2])) for b in batches) == 17
    assert counter.value() == 3
    counter = CorruptCounter()
    it = iter(train_dataset(source.split("train"), cfg, 4, seed=0, books=Bookkeeping(corrupt=counter, num_classes=CLASSES)))
    for _ in range(10):  # 40 images: every record read at least once more than an epoch
        next(it)
    assert counter.value() >= 3


def test_too_many_corrupt_records_stop_with_a_clear_message(trees, tmp_path):
    write_records(str(tmp_path / "rec"), trees["ilsvrc"], corrupt_at=(1, 2, 3, 4, 5))
    cfg = DataConfig(format="tfrecord", dir=str(tmp_path / "rec"), image_size=32, max_bad_fraction=0.1)
    source = build_source(cfg)
    with pytest.raises(UserError, match=r"too many corrupt images: \d+ of the first \d+ records could not be decoded "
                                        r"\(data.max_bad_fraction is 0.1\)"):
        with data_errors():
            for _ in train_dataset(source.split("train"), cfg, 4, seed=0, books=Bookkeeping(num_classes=CLASSES)).take(20):
                pass


def test_labels_outside_the_class_range_are_errors(trees, tmp_path):
    write_records(str(tmp_path / "zero"), trees["ilsvrc"], label_of=lambda i: 0)  # 0-based labels in a 1-based format
    with pytest.raises(UserError, match="label -1 is outside 0..2 .*1-based labels"):
        build_source(DataConfig(format="tfrecord", dir=str(tmp_path / "zero")))
    write_records(str(tmp_path / "late"), trees["ilsvrc"], label_of=lambda i: 1 if i < 10 else 7)
    cfg = DataConfig(format="tfrecord", dir=str(tmp_path / "late"), image_size=32)
    with pytest.raises(UserError, match=r"label 6 is outside 0..2 \(data and model.num_classes disagree\)"):
        with data_errors():
            list(eval_dataset(build_source(cfg).split("val"), cfg, 4, num_classes=CLASSES))


def test_missing_shards_and_layout_errors_are_one_line(tmp_path, trees):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no TFRecord shards for split 'train' in .*empty \\(expected train-00000-of-01024"):
        build_source(DataConfig(format="tfrecord", dir=str(tmp_path / "empty")))
    import shutil
    shutil.copytree(os.path.join(trees["ilsvrc"], "train"), tmp_path / "nolabels" / "train")
    shutil.copytree(os.path.join(trees["ilsvrc"], "val"), tmp_path / "nolabels" / "val")
    with pytest.raises(UserError, match="no validation labels in .*nolabels: expected ILSVRC2012_validation_ground_truth.txt"):
        build_source(DataConfig(format="imagenet", dir=str(tmp_path / "nolabels")))
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    for split in ("train", "validation"):
        (garbage / f"{split}-00000-of-00001").write_bytes(b"\xff\xd8 these are JPEG bytes, not TFRecords")
    with pytest.raises(UserError, match="truncated TFRecord file: .*garbage/train-00000-of-00001 \\(record 0 runs past"):
        build_source(DataConfig(format="tfrecord", dir=str(garbage)))
    (garbage / "counts.json").write_text('{"shards": {"train-00000-of-00001": 1, "validation-00000-of-00001": 1}}')
    with pytest.raises(UserError, match="truncated TFRecord file: .*garbage/train-00000-of-00001 \\(first record"):
        build_source(DataConfig(format="tfrecord", dir=str(garbage)))


def test_file_level_sharding_when_files_suffice_else_by_example(trees, shards):
    source = build_source(DataConfig(format="tfrecord", dir=shards))
    split = source.split("train")   # 3 shards
    cfg = DataConfig(image_size=16)

    def images(n):
        out = []
        for i in range(n):
            ctx = tf.distribute.InputContext(num_input_pipelines=n, input_pipeline_id=i, num_replicas_in_sync=n)
            share, by_example = pipeline_share(split, ctx)
            assert by_example == (n > len(split.files))
            batches = eval_dataset(split, cfg, 2 * n, ctx, num_classes=CLASSES)
            out.append([bytes(img.numpy().tobytes()) for b in batches for img, w in zip(b[0], b[2]) if w > 0])
        return out

    for n in (2, 4):   # 2: file-level (3 files); 4: by example
        shares = images(n)
        flat = [img for share in shares for img in share]
        assert len(flat) == split.num_examples, n
        assert len({h for h in flat}) == len(set(images(1)[0])), n


# --- end to end --------------------------------------------------------------

@pytest.mark.slow
def test_train_on_shards_reports_corrupt_images_and_stops_when_too_many(trees, tmp_path):
    write_records(str(tmp_path / "rec"), trees["ilsvrc"], corrupt_at=(2, 9), n=40)
    common = ["train", "--config=configs/digits.yaml", "--model=simple_cnn", "--data_format=tfrecord",
              f"--data_dir={tmp_path / 'rec'}", "--set=model.num_classes=3", "--epochs=1",
              "--batch_size_per_replica=4", "--set=data.image_size=16", "--set=schedule.warmup_epochs=0"]
    # The run that goes through in this process (its exit status is not the point; the two that stop are
    # processes, for their status and their one line). Both corrupt records are in the first epoch.
    _, ok = train_in_process(*common[1:], f"--model_dir={tmp_path / 'ok'}", "--set=data.max_bad_fraction=0.1")
    assert "skipped" in last_line(ok) and "corrupt training image(s)" in last_line(ok)
    assert read_jsonl(tmp_path / "ok" / "metrics.jsonl")[-1]["corrupt_images"] >= 2
    strict = run_tfdp(*common, f"--model_dir={tmp_path / 'strict'}", "--set=data.max_bad_fraction=0.01", timeout=300)
    assert strict.returncode == 2
    assert last_line(strict.stderr).startswith("tfdp: error: too many corrupt images:")
    assert "Traceback" not in strict.stderr
    mismatch = run_tfdp(*common[:-5], "--set=model.num_classes=10", f"--model_dir={tmp_path / 'm'}", timeout=120)
    assert mismatch.returncode == 2
    assert last_line(mismatch.stderr) == "tfdp: error: the data has 3 classes but model.num_classes is 10"
    assert np.isfinite(read_jsonl(tmp_path / "ok" / "metrics.jsonl")[-1]["loss"])
