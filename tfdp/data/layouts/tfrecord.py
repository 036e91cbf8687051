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
(`pipelines/convert_imagenet.py`) writes records with `image_example` and
`write_record`. Writing needs no TensorFlow (protobuf's runtime and a CRC-32C
library do it), so a converter worker does not import it: 3.8 s of CPU and
660 MB of memory each, on a host that runs one worker per core.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import posixpath
import struct

import google_crc32c
import numpy as np

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
    """A tf.train.Example with exactly the features of TensorFlow's official ImageNet shards (`example_type`: the
    same message, byte for byte, without TensorFlow)."""
    example = example_type()()
    feature = example.features.feature

    def ints(key: str, values):
        feature[key].int64_list.value.extend(values)

    def floats(key: str, values):
        feature[key].float_list.value.extend(values)   # present though empty, as TensorFlow's Feature(float_list=...)

    def strings(key: str, value: str | bytes):
        feature[key].bytes_list.value.append(value.encode() if isinstance(value, str) else value)

    # Boxes were measured on the source image; normalised coordinates survive downscaling.
    src_w, src_h = image.source_size
    boxes = [(min(max(x0 / src_w, 0.0), 1.0), min(max(y0 / src_h, 0.0), 1.0),
              min(max(x1 / src_w, 0.0), 1.0), min(max(y1 / src_h, 0.0), 1.0)) for x0, y0, x1, y1 in item.boxes]
    ints("image/height", [image.height])
    ints("image/width", [image.width])
    strings("image/colorspace", "RGB")
    ints("image/channels", [3])
    ints(LABEL_KEY, [item.label + LABEL_OFFSET])
    strings("image/class/synset", item.synset)
    strings("image/class/text", item.text)
    for i, key in enumerate(BBOX_KEYS):
        floats(key, [b[i] for b in boxes])
    ints(BBOX_LABEL_KEY, [item.label + LABEL_OFFSET] * len(boxes))
    strings("image/format", "JPEG")
    strings("image/filename", posixpath.basename(item.path))
    strings(IMAGE_KEY, image.encoded)
    return example


@functools.cache
def example_type() -> type:
    """tf.train.Example as a message type of protobuf's own runtime: the schema of TensorFlow's
    `core/example/{example,feature}.proto` given to a descriptor pool of its own (no clash with TensorFlow's
    where both are loaded). Its serialization is TensorFlow's (a test compares the bytes)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FieldDescriptorProto

    def field(name: str, number: int, kind: int, repeated: bool = False, message: str = "", oneof: int | None = None):
        f = proto(name=name, number=number, type=kind, label=proto.LABEL_REPEATED if repeated else proto.LABEL_OPTIONAL)
        if message:
            f.type_name = f".tensorflow.{message}"
        if oneof is not None:
            f.oneof_index = oneof
        return f

    file = descriptor_pb2.FileDescriptorProto(name="tfdp/example.proto", package="tensorflow", syntax="proto3")
    kinds = (("bytes_list", "BytesList", proto.TYPE_BYTES), ("float_list", "FloatList", proto.TYPE_FLOAT),
             ("int64_list", "Int64List", proto.TYPE_INT64))
    for _, name, kind in kinds:
        file.message_type.add(name=name, field=[field("value", 1, kind, repeated=True)])   # packed: proto3
    file.message_type.add(name="Feature", oneof_decl=[descriptor_pb2.OneofDescriptorProto(name="kind")], field=[
        field(name, number, proto.TYPE_MESSAGE, message=kind, oneof=0) for number, (name, kind, _) in enumerate(kinds, 1)])
    features = file.message_type.add(name="Features", field=[
        field("feature", 1, proto.TYPE_MESSAGE, repeated=True, message="Features.FeatureEntry")])
    features.nested_type.add(name="FeatureEntry", options=descriptor_pb2.MessageOptions(map_entry=True), field=[
        field("key", 1, proto.TYPE_STRING), field("value", 2, proto.TYPE_MESSAGE, message="Feature")])
    file.message_type.add(name="Example", field=[field("features", 1, proto.TYPE_MESSAGE, message="Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


def write_record(f, record: bytes) -> None:
    """Appends one record to a TFRecord file open for writing (`f`), framed as TensorFlow's writer frames it."""
    length = LENGTH.pack(len(record))
    f.write(length)
    f.write(_masked_crc(length))
    f.write(record)
    f.write(_masked_crc(record))


def _masked_crc(data: bytes) -> bytes:
    """TFRecord's checksum: CRC-32C, rotated right by 15 bits, plus a constant (tsl/lib/hash/crc32c.h's Mask)."""
    crc = google_crc32c.value(data)
    return _CRC.pack((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


_CRC = struct.Struct("<I")


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
    import tensorflow as tf

    variant = tf.raw_ops.TFRecordDatasetV2(filenames=tf.reshape(path, [1]), compression_type="",
                                           buffer_size=tf.constant(0, tf.int64),
                                           byte_offsets=tf.reshape(tf.cast(offset, tf.int64), [1]))
    records = tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.string))
    return records.take(1).get_single_element()


def parse_record(serialized: tf.Tensor, fmt: RecordFormat) -> tuple[tf.Tensor, tf.Tensor]:
    """(encoded image, 0-based int32 label) of one serialized tf.train.Example in format `fmt`."""
    import tensorflow as tf

    spec = {fmt.image_key: tf.io.FixedLenFeature([], tf.string), fmt.label_key: tf.io.FixedLenFeature([], tf.int64)}
    example = tf.io.parse_single_example(serialized, spec)
    return example[fmt.image_key], tf.cast(example[fmt.label_key] + fmt.label_offset, tf.int32)
