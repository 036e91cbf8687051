"""The order an image-file split is listed and streamed in, and what the pipeline's graphs hold.

An image split's stream is ordered as file numbers and turned into paths
only at the end (`tfdp.data.order.epoch_payloads`): these tests pin that
this gives the order permuting the paths themselves gives (the same seed,
the same files as ever), that the corrupt-image names replay it, and that
no per-epoch function holds the file list as a constant.
"""

import os

import pytest
import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.data import build_source, order as stream_order, readers
from tfdp.data.naming import StreamNames
from tfdp.data.layouts import Split, folder_entries
from tfdp.data.storage import filesystem

FILES = 37


def listed_split() -> Split:
    return Split("train", tuple(f"/data/train/c{i % 5}/{i:03d}.jpg" for i in range(FILES)),
                 tuple(i % 5 for i in range(FILES)))


def paths_permuted_then_shuffled(share, cfg, ctx, data_shard, seed, first_epoch, size, offset):
    """The stream's definition: each epoch the (path, label) pairs in the permutation (seed, epoch) draws,
    through the seeded shuffle buffer and repeated augmentation."""
    buffer = min(cfg.shuffle_buffer, max(share.num_examples, 1))

    def epoch(e):
        order = tf.stack([tf.constant(seed, tf.int64), e])
        return readers.payloads(share, cfg, ctx, data_shard, order_seed=order).shuffle(
            buffer, seed=seed, reshuffle_each_iteration=False).apply(
            stream_order.repeated(cfg.repeated_augmentation, size))
    return tf.data.Dataset.range(first_epoch, stream_order.MAX_EPOCHS).flat_map(epoch).skip(offset)


def pairs(ds, count):
    return [(path.decode(), int(label)) for path, label in ds.take(count).as_numpy_iterator()]


@pytest.mark.parametrize("shuffle_buffer,repeated", [(10, 1), (1000, 1), (8, 3)])
@pytest.mark.parametrize("pipelines,index", [(1, 0), (3, 1), (50, 7)])  # 50 > 37 files: sharded by example
def test_an_image_stream_is_the_permuted_files_through_the_seeded_buffer(shuffle_buffer, repeated, pipelines, index):
    cfg = DataConfig(shuffle_buffer=shuffle_buffer, repeated_augmentation=repeated)
    ctx = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=index,
                                     num_replicas_in_sync=pipelines)
    share, data_shard = stream_order.pipeline_share(listed_split(), ctx)
    size = stream_order.share_sizes(listed_split(), pipelines)[index]
    for first_epoch, offset in ((0, 0), (2, min(5, size - 1))):
        want = pairs(paths_permuted_then_shuffled(share, cfg, ctx, data_shard, 9, first_epoch, size, offset), 3 * size)
        got = pairs(stream_order.epoch_payloads(share, cfg, ctx, data_shard, 9, size, (first_epoch, offset)), 3 * size)
        assert got == want
        names = StreamNames.of_training(share, cfg, ctx, data_shard, 9, size)
        start = first_epoch * size + offset
        assert [names(p) for p in range(start, start + 2 * size)] == [path for path, _ in want[:2 * size]]


def test_corrupt_image_names_replay_the_cached_stream_too(tmp_path):
    files = []
    for i in range(FILES):
        path = tmp_path / f"{i:03d}.jpg"
        path.write_text(str(path))  # data.cache streams each file's bytes: here, its own path
        files.append(str(path))
    split = Split("train", tuple(files), tuple(i % 5 for i in range(FILES)))
    cfg = DataConfig(shuffle_buffer=6, cache=True)
    ctx = tf.distribute.InputContext()
    stream = stream_order.epoch_payloads(split, cfg, ctx, False, 4, FILES)
    names = StreamNames.of_training(split, cfg, ctx, False, 4, FILES)
    assert [names(p) for p in range(3 * FILES)] == [path for path, _ in pairs(stream, 3 * FILES)]


def test_no_per_epoch_function_holds_the_file_list(tmp_path):
    """The paths live in one tensor the stream captures, not in a constant of the function each epoch runs:
    such a constant is copied with every function library tf.data rewrites and instantiates."""
    split = listed_split()
    ds = stream_order.epoch_payloads(split, DataConfig(), tf.distribute.InputContext(), False, 1, FILES)
    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    for function in graph.library.function:
        for node in function.node_def:
            if node.op == "Const" and node.attr["dtype"].type == tf.string.as_datatype_enum:
                assert len(node.attr["value"].tensor.string_val) < FILES, function.signature.name
    assert pairs(ds, 1)[0][0] in split.files


def test_a_local_folder_is_listed_by_name_and_a_link_is_never_a_folder(tmp_path):
    folder = tmp_path / "c"
    (folder / "sub").mkdir(parents=True)
    for name in ("b.JPEG", "a.jpg", "notes.txt", "C.png"):
        (folder / name).write_bytes(b"x")
    os.symlink(folder / "sub", folder / "linked-folder")
    os.symlink(folder / "a.jpg", folder / "z-link.jpg")
    fs, path = filesystem(str(folder))
    base = str(folder)
    assert folder_entries(fs, path) == [(f"{base}/C.png", False), (f"{base}/a.jpg", False), (f"{base}/b.JPEG", False),
                                        (f"{base}/linked-folder", False), (f"{base}/notes.txt", False),
                                        (f"{base}/sub", True), (f"{base}/z-link.jpg", False)]
    # fsspec's own listing says the same, in the same order
    detail = sorted(fs.ls(path, detail=True), key=lambda e: e["name"])
    assert folder_entries(fs, path) == [(e["name"], e["type"] == "directory") for e in detail]


def test_an_image_folder_lists_each_class_in_name_order_and_skips_what_is_not_an_image(tmp_path, capsys):
    for split, per_class in (("train", 3), ("val", 1)):
        for cls in ("dog", "cat"):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for n in reversed(range(per_class)):
                (folder / f"{cls}{n}.jpg").write_bytes(b"x")
    (tmp_path / "train" / "cat" / "readme.txt").write_text("x")
    (tmp_path / "train" / "cat" / "nested").mkdir()
    source = build_source(DataConfig(format="image_folder", dir=str(tmp_path)))
    train = source.split("train")
    assert source.class_names == ("cat", "dog")
    assert train.files == tuple(str(tmp_path / "train" / c / f"{c}{n}.jpg") for c in ("cat", "dog") for n in range(3))
    assert train.labels == (0, 0, 0, 1, 1, 1)
    out = capsys.readouterr().out
    assert "ignored 2 file(s)" in out and "1 .txt" in out and "1 folder" in out
