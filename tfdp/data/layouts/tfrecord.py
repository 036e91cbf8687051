"""The standard ImageNet TFRecord format, in one place: framing, feature keys, labels, Examples.

The format is the one TensorFlow's official conversion script
(`build_imagenet_data.py`) writes and Model Garden / TPU reference models
read: each shard a sequence of tf.train.Example with

    image/encoded  image/format  image/filename  image/height  image/width
    image/colorspace  image/channels
    image/class/label   (1-based: 0 is reserved for "background")
    image/class/synset  image/class/text
    image/object/bbox/{xmin,ymin,xmax,ymax,label}   (normalised to 0..1)

Each record is framed as uint64 length, uint32 masked CRC of the length, the
data, uint32 masked CRC of the data. Counting and checking records reads the
length headers only (`readable_records`, `count_records`, `first_record`);
the same walk gives each record's byte offset (`record_offsets`), so the
training stream can shuffle offsets and read each record where it is decoded
(`read_record`, used by `tfdp.data.readers`).

Readers (`tfdp.data.layouts.records`) use `IMAGENET_RECORDS`; the converter
(`pipelines/convert_imagenet.py`) writes records with `image_example`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import posixpath
import struct

import numpy as np
import tensorflow as tf

from tfdp.data.layouts import RecordFormat
from tfdp.data.storage import filesystem
from tfdp.errors import UserError

# Framing: uint64 length, uint32 crc of the length, data, uint32 crc of the data.
LENGTH = struct.Struct("<Q")
HEADER_BYTES, FOOTER_BYTES = LENGTH.size + 4, 4

IMAGE_KEY = "image/encoded"
LABEL_KEY = "image/class/label"
BBOX_KEYS = tuple(f"image/object/bbox/{k}" for k in ("xmin", "ymin", "xmax", "ymax"))
BBOX_LABEL_KEY = "image/object/bbox/label"
LABEL_OFFSET = 1   # stored label = 0-based label + 1 (0 is "background")

# Shards a training reader reads side by side (an interleave): what its order is made of, and how many shards a
# streamed share must hold on disk at once.
INTERLEAVE_CYCLE = 16
IMAGENET_RECORDS = RecordFormat(image_key=IMAGE_KEY, label_key=LABEL_KEY, label_offset=-LABEL_OFFSET)


@dataclasses.dataclass(frozen=True)
class Item:
    """One source image and everything its record needs."""
    path: str
    label: int            # 0-based; stored 1-based
    synset: str
    text: str
    boxes: tuple[tuple[float, float, float, float], ...] = ()   # pixels: xmin, ymin, xmax, ymax


@dataclasses.dataclass(frozen=True)
class Prepared:
    encoded: bytes        # RGB or greyscale JPEG
    height: int
    width: int
    source_size: tuple[int, int]   # (width, height) of the source image, for its boxes


def image_example(item: Item, image: Prepared):
    """A tf.train.Example with exactly the features of TensorFlow's official ImageNet shards."""
    import tensorflow as tf

    def ints(values):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=list(values)))

    def floats(values):
        return tf.train.Feature(float_list=tf.train.FloatList(value=list(values)))

    def strings(value: str | bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value.encode() if isinstance(value, str) else value]))

    # Boxes were measured on the source image; normalised coordinates survive downscaling.
    src_w, src_h = image.source_size
    boxes = [(min(max(x0 / src_w, 0.0), 1.0), min(max(y0 / src_h, 0.0), 1.0),
              min(max(x1 / src_w, 0.0), 1.0), min(max(y1 / src_h, 0.0), 1.0)) for x0, y0, x1, y1 in item.boxes]
    xmin, ymin, xmax, ymax = BBOX_KEYS
    return tf.train.Example(features=tf.train.Features(feature={
        "image/height": ints([image.height]),
        "image/width": ints([image.width]),
        "image/colorspace": strings("RGB"),
        "image/channels": ints([3]),
        LABEL_KEY: ints([item.label + LABEL_OFFSET]),
        "image/class/synset": strings(item.synset),
        "image/class/text": strings(item.text),
        xmin: floats(b[0] for b in boxes),
        ymin: floats(b[1] for b in boxes),
        xmax: floats(b[2] for b in boxes),
        ymax: floats(b[3] for b in boxes),
        BBOX_LABEL_KEY: ints([item.label + LABEL_OFFSET] * len(boxes)),
        "image/format": strings("JPEG"),
        "image/filename": strings(posixpath.basename(item.path)),
        IMAGE_KEY: strings(image.encoded),
    }))


def first_record(file_url: str) -> bytes | None:
    """The first record of a TFRecord file, local or remote (a few bytes read, nothing copied)."""
    fs, path = filesystem(file_url)
    size = fs.size(path)
    if size == 0:
        return None
    with fs.open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
        length = LENGTH.unpack(header[:LENGTH.size])[0] if len(header) == HEADER_BYTES else size
        if HEADER_BYTES + length + FOOTER_BYTES > size:
            raise UserError(f"truncated TFRecord file: {file_url} (first record cut short)")
        return f.read(length)


def count_records(path: str) -> int:
    """Number of records in a local TFRecord file, read from the length headers only.

    Seeking over each record's data makes counting a 140 GB ImageNet cost
    seconds, not a full read.
    """
    count, cut = readable_records(path)
    if cut is not None:
        raise UserError(f"truncated TFRecord file: {path} (record {count} {cut})")
    return count


def readable_records(path: str) -> tuple[int, str | None]:
    """(complete records at the start of a local TFRecord file, how the next one is cut short or None)."""
    offsets, cut = record_offsets(path)
    return len(offsets), cut


def record_offsets(path: str) -> tuple[np.ndarray, str | None]:
    """(byte offset of each complete record at the start of a local TFRecord file, how the next one is cut
    short or None).

    Only the framing is read, one 8-byte length per record at its offset (not
    the payload's CRC): cheap enough to run on every shard whenever a split is
    listed. Read-ahead is turned off, so a cold cache reads one page per
    record, not the images between the headers. The walk is kept per file
    version (path, size, modification time): listing a split walks each shard
    and building its input pipeline asks again, which then reads nothing.
    """
    stat = os.stat(path)
    return _walk_framing(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8192)   # ImageNet has 1,152 shards; 8 bytes per record kept
def _walk_framing(path: str, size: int, mtime_ns: int) -> tuple[np.ndarray, str | None]:
    offsets, offset, cut = [], 0, None
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        while offset < size:
            header = os.pread(fd, LENGTH.size, offset)
            if len(header) < LENGTH.size:
                cut = "header cut short"
                break
            end = offset + HEADER_BYTES + LENGTH.unpack(header)[0] + FOOTER_BYTES
            if end > size:
                cut = "runs past the end"
                break
            offsets.append(offset)
            offset = end
    finally:
        os.close(fd)
    result = np.array(offsets, np.int64)
    result.flags.writeable = False   # shared by every caller
    return result, cut


def read_record(path: tf.Tensor, offset: tf.Tensor) -> tf.Tensor:
    """The serialized record at byte `offset` of the TFRecord file `path`, its framing and CRCs checked.

    TensorFlow's own reader, started at the offset (`TFRecordDatasetV2`'s
    byte_offsets) and unbuffered: a few reads of the header, then the data
    and its footer straight into the result, never the records around it.
    A CRC mismatch, a record cut short or an offset past the end
    is an error of this op, which the decoding map counts as a corrupt image.
    """
    variant = tf.raw_ops.TFRecordDatasetV2(filenames=tf.reshape(path, [1]), compression_type="",
                                           buffer_size=tf.constant(0, tf.int64),
                                           byte_offsets=tf.reshape(tf.cast(offset, tf.int64), [1]))
    records = tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.string))
    return records.take(1).get_single_element()


def parse_record(serialized: tf.Tensor, fmt: RecordFormat) -> tuple[tf.Tensor, tf.Tensor]:
    """(encoded image, 0-based int32 label) of one serialized tf.train.Example in format `fmt`."""
    spec = {fmt.image_key: tf.io.FixedLenFeature([], tf.string), fmt.label_key: tf.io.FixedLenFeature([], tf.int64)}
    example = tf.io.parse_single_example(serialized, spec)
    return example[fmt.image_key], tf.cast(example[fmt.label_key] + fmt.label_offset, tf.int32)
