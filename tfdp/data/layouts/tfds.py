"""Any TFDS image-classification dataset already prepared in a data_dir.

Nothing is downloaded: the prepared TFRecord shards are read directly, with
the image left encoded so the pipeline decodes only the crop it needs. From a
bucket data_dir only the builder's metadata is copied to the local cache up
front; the shards stay remote in the `Split`, and each input pipeline copies
only its own share (see `storage.localize`).
`imagenet2012` can be prepared here from its manual_dir (the two ILSVRC2012
tars, which users download themselves after registering): TFDS builds it
from those archives alone.
"""

from __future__ import annotations

import os
import posixpath

from absl import logging

from tfdp.data.layouts import RecordFormat, Source, Split
from tfdp.data.storage import filesystem, is_remote, localize, url
from tfdp.errors import UserError

SPLIT_ALIASES = {"val": "validation"}


def tfds_source(data_dir: str, name: str, split_names: tuple[str, ...], cache_dir: str, manual_dir: str = "") -> Source:
    import tensorflow_datasets as tfds

    if not name:
        raise UserError("data.format 'tfds' needs data.tfds_name (for example imagenet2012)")
    builder_dir, shard_root = _local_builder_dir(data_dir, name, cache_dir)
    if builder_dir is None:
        builder_dir = shard_root = _prepare_from_manual_dir(data_dir, name, manual_dir)
    builder = tfds.builder_from_directory(builder_dir)
    image_key, label_key = _supervised_keys(builder.info, name)
    label_feature = builder.info.features[label_key]
    splits = {}
    for split_name in split_names:
        tfds_split = split_name if split_name in builder.info.splits else SPLIT_ALIASES.get(split_name, split_name)
        if tfds_split not in builder.info.splits:
            raise UserError(f"TFDS dataset {name} has no split '{split_name}' "
                            f"(it has: {', '.join(sorted(builder.info.splits.keys()))})")
        info = builder.info.splits[tfds_split]
        files = tuple(posixpath.join(shard_root, posixpath.basename(str(p))) for p in info.filepaths)
        splits[split_name] = Split(name=split_name, files=files,
                                   counts=tuple(info.shard_lengths),
                                   records=RecordFormat(image_key=image_key, label_key=label_key))
    names = tuple(label_feature.names)
    return Source(class_names=names, splits=splits, class_text=names)


def _supervised_keys(info, name: str) -> tuple[str, str]:
    import tensorflow_datasets as tfds

    keys = info.supervised_keys
    if not keys or len(keys) != 2 or not isinstance(keys[0], str):
        raise UserError(f"TFDS dataset {name} is not an image-classification dataset (no (image, label) supervised keys)")
    image_key, label_key = keys
    if not isinstance(info.features[image_key], tfds.features.Image):
        raise UserError(f"TFDS dataset {name}: supervised input '{image_key}' is not an image")
    if not isinstance(info.features[label_key], tfds.features.ClassLabel):
        raise UserError(f"TFDS dataset {name}: supervised target '{label_key}' is not a class label")
    return image_key, label_key


def _local_builder_dir(data_dir: str, name: str, cache_dir: str) -> tuple[str | None, str]:
    """(local folder with the newest prepared version's metadata, where its shards are), or (None, "").

    Config folders are searched too. From a bucket only the metadata (not the
    `.tfrecord-` shards) is copied, into the local cache.
    """
    fs, root = filesystem(data_dir)
    base = posixpath.join(root, name)
    infos = sorted(p for p in fs.glob(posixpath.join(base, "**", "dataset_info.json")))
    if not infos:
        return None, ""
    builder_dir = posixpath.dirname(max(infos, key=_version_key))
    metadata = [url(fs, p) for p in fs.find(builder_dir) if ".tfrecord-" not in posixpath.basename(p)]
    local = localize(metadata, cache_dir)
    info = local[metadata.index(url(fs, posixpath.join(builder_dir, "dataset_info.json")))]
    return os.path.dirname(info), url(fs, builder_dir)


def _version_key(info_path: str) -> tuple[int, ...]:
    version = posixpath.basename(posixpath.dirname(info_path))
    try:
        return tuple(int(x) for x in version.split("."))
    except ValueError:
        return (-1,)


def _prepare_from_manual_dir(data_dir: str, name: str, manual_dir: str) -> str:
    import tensorflow_datasets as tfds

    if not manual_dir:
        raise UserError(f"TFDS dataset {name} is not prepared in {data_dir} (no {name}/<version>/dataset_info.json); "
                        f"prepare it there, or set data.tfds_manual_dir to build it from manually downloaded files")
    if is_remote(filesystem(data_dir)[0]):
        raise UserError("preparing a TFDS dataset from data.tfds_manual_dir needs a local data.dir")
    logging.info("preparing TFDS %s in %s from %s (no download)", name, data_dir, manual_dir)
    try:
        builder = tfds.builder(name, data_dir=os.path.expanduser(data_dir))
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
            manual_dir=os.path.expanduser(manual_dir), try_download_gcs=False))
    except tfds.core.registered.DatasetNotFoundError:
        raise UserError(f"unknown TFDS dataset '{name}'") from None
    except AssertionError as e:  # TFDS reports missing manual files this way
        raise UserError(f"cannot prepare {name} from {manual_dir}: {str(e).splitlines()[0]}") from None
    return str(builder.data_path)
