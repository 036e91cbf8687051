"""`data.decoder: dali`: NVIDIA DALI decodes and crops the training images, on each replica's own device.

tfdp's training stream stays whole and decides everything it decides on the
tf path: which examples, in which order (each data epoch's seeded order, the
checkpoint's position, each worker's share), bucket files through the bounded
cache, corrupt images counted and named, labels checked, every batch's stream
position recorded. Only the per-image work moves: on the tf path the stream's
transform decodes and crops (`tfdp.data.preprocess.train_transform`); with
DALI it only checks that the bytes will decode (`preprocess.encoded_transform`), so a
per-replica batch leaves the stream as encoded bytes and labels, already
counted. Each batch becomes one dense array (`pad_batch`), and `distribute`
hands each worker's arrays to its replicas in the order the tf path's
per-worker dataset gives them (batch k to local replica k mod n; one replica
takes the stream itself), each replica's to a DALI pipeline for that
replica's device, a batch at a time (`DALIDatasetWithInputs`: cut the images
out, decode with the random-resized crop, resize; "mixed" on the replica's
GPU, its CPU operators with `device_id=None`), whose batches TensorFlow
prefetches to the replica's device. DALI never reads a shard or a file
itself, so it needs no index files, and the flip, normalisation and batch
augmentations still run on the device as the model's first layers.

Through the tf.data service (`tfdp.data.service.client`) the service's
workers run the stream up to the checked batches and the trainer deals and
decodes what they send, as it does its own stream.

Evaluation goes the same way (`distribute_evaluation`): tfdp's validation
stream, its shares, padding and corrupt images as on the tf path, the
central crop decoded by DALI (`central_crop`: the tf path's window). What is
not the tf path's: DALI draws its own training crop windows (so
`data.deterministic` refuses it), resizes with its own rounding, and stops
on an image it cannot decode rather than skipping it, hence the check before
it. Prediction (`distribute_prediction`) decodes as evaluation does, each
image numbered rather than labelled.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Callable

import tensorflow as tf

from tfdp.config import DataConfig
from tfdp.config.image_sizes import eval_image_size
from tfdp.data.preprocess import ASPECT_RATIO_RANGE, host_cores
from tfdp.errors import UserError

INSTALL = ('pip install "tfdp[dali]" && pip install --no-build-isolation nvidia-dali-tf-plugin-cuda120==2.4.0')
HEADER = 8   # a row of a batch's array (`pad_batch`): the int32 label, the int32 length, then the encoded bytes


def available() -> str:
    """'' where DALI and its TensorFlow plugin import, else why not (the import's first line)."""
    try:
        import nvidia.dali  # noqa: F401
        import nvidia.dali.plugin.tf  # noqa: F401
    except Exception as e:  # ImportError, or the plugin's own failure to load against this TensorFlow
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
    return ""


# data.format's whose examples reach the pipeline as pixels, not encoded images: nothing for DALI to decode
PIXEL_FORMATS = ("idx",)


def choose(cfg: DataConfig, devices: list[str]) -> str:
    """The decoder a run uses: data.decoder, with auto resolved on the run's replica devices (this worker's).

    auto is DALI where it imports and every replica is a GPU of its own (DALI is given a physical GPU's
    number; a card split into logical GPUs has fewer numbers than replicas),
    else tf: DALI's CPU operators decode no faster than TensorFlow's
    (docs/benchmarks.md), so its worth is the GPU.
    """
    if cfg.decoder == "dali" and cfg.format in PIXEL_FORMATS:
        raise UserError(f"data.decoder: dali decodes encoded images, and data.format {cfg.format} holds pixels "
                        f"that need no decoding: use data.decoder tf")
    if cfg.decoder == "tf" or cfg.format == "synthetic" or cfg.format in PIXEL_FORMATS:
        return "tf"
    if cfg.decoder == "auto" and cfg.eval_interpolation != "fast":   # DALI's evaluation crop is the fast one
        return "tf"
    gpus = bool(devices) and all("GPU" in d.upper() for d in devices)
    if cfg.decoder == "auto":
        physical = len(tf.config.list_physical_devices("GPU"))
        fits = gpus and len(devices) <= physical and memory_grows()
        return "dali" if fits and not available() else "tf"
    why = available()
    if why:
        raise UserError(f"data.decoder: dali needs NVIDIA DALI and its TensorFlow plugin ({why}); install them "
                        f"with: {INSTALL}")
    if gpus and not memory_grows():
        raise UserError("data.decoder: dali on GPUs needs TF_FORCE_GPU_ALLOW_GROWTH=true in the environment: "
                        "TensorFlow otherwise reserves nearly all of each card's memory at start, and DALI's "
                        "decoder allocates its own beside it")
    return "dali"


def memory_grows() -> bool:
    """Whether TensorFlow grows its GPU memory as it needs it rather than taking the cards at start (DALI's
    documentation: with TensorFlow's default, DALI's own allocations fail)."""
    if os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").lower() == "true":
        return True
    cards = tf.config.list_physical_devices("GPU")
    return bool(cards) and all(tf.config.experimental.get_memory_growth(card) for card in cards)


class Dealer:
    """One worker's stream of per-replica batches dealt to its `n` local replicas: batch k to replica k mod n,
    as `distribute_datasets_from_function` deals a per-worker dataset's elements, each one array (`pad_batch`).

    Each replica's DALI input asks for its own next batch; the stream is read
    once, and a batch read for another replica waits in that replica's queue
    (every step takes one batch per replica, so the queues stay a few batches
    deep). Each new iterator of a replica's input is that replica's next
    round: round g of every replica reads round g's stream, made by whichever
    replica starts it first, and the round before it is let go.
    """

    def __init__(self, make: Callable[[], tf.data.Dataset], n: int):
        self.make, self.n = make, n
        self._lock = threading.Lock()
        self._calls = [0] * n
        self._rounds: dict[int, _Round] = {}

    def rows(self, replica: int, batch: int) -> tf.data.Dataset:
        """`replica`'s batches, each a [batch, width] array (`pad_batch`), as a dataset on the host."""
        with tf.device("/cpu:0"):
            return tf.data.Dataset.from_generator(self.batches(replica),
                                                  output_signature=tf.TensorSpec([batch, None], tf.uint8))

    def batches(self, replica: int):
        """The generator function of `replica`'s batches (for `Dataset.from_generator`)."""
        def generator():
            with self._lock:
                number = self._calls[replica]
                self._calls[replica] += 1
                if number not in self._rounds:
                    with tf.device("/cpu:0"):
                        rows = iter(padded(self.make()))
                    self._rounds[number] = _Round(rows, [collections.deque() for _ in range(self.n)])
                    for old in [g for g in self._rounds if g < min(self._calls) - 1]:
                        del self._rounds[old]
                this = self._rounds[number]
            while True:
                batch = this.next_for(replica, self.n)
                if batch is None:
                    return
                yield batch
        return generator


@dataclasses.dataclass
class _Round:
    iterator: object
    queues: list
    taken: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def next_for(self, replica: int, n: int):
        """`replica`'s next batch, None at the end of a finite stream (an evaluation's). The end is read as an
        empty optional, not an "End of sequence" error: an eager op that fails aborts the rendezvous all eager
        ops share, and a stream built meanwhile on another device failed with it (tfdp.data.corrupt.decodes)."""
        with self.lock:
            while not self.queues[replica]:
                element = self.iterator.get_next_as_optional()
                if not element.has_value():
                    return None
                self.queues[self.taken % n].append(element.get_value().numpy())
                self.taken += 1
            return self.queues[replica].popleft()


def input_options() -> tf.distribute.InputOptions:
    """Each replica's dataset iterated on its own device, where its last stage (`replica_pipeline`) has put
    the batches."""
    return tf.distribute.InputOptions(experimental_place_dataset_on_device=True, experimental_fetch_to_device=False,
                                      experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)


def distribute(runtime, worker_dataset: Callable, cfg: DataConfig, global_batch: int, seed: int,
               evaluation: bool = False, finish: Callable | None = None):
    """The distributed training dataset: this worker's stream (`worker_dataset(input_context)`, the tf path's
    per-worker dataset of checked batches of encoded bytes), each batch one array (`pad_batch`), decoded by one
    DALI pipeline per local replica (`evaluation`: the central crop, as `distribute_evaluation`; `finish`: a
    map of each replica's decoded (images, labels) batches).

    `runtime`: the run's `tfdp.distribute.strategy.Runtime` (its replicas, devices, workers, this worker's
    index), whose `datasets_per_replica` makes a dataset per local replica on any strategy.

    With one local replica its DALI pipeline reads the stream itself; with
    more, a `Dealer` reads it once and deals its batches through Python,
    which costs a copy of each batch (a generator's output is copied into a
    tensor) but none of it per image.
    """
    replicas, devices, worker_index = runtime.num_replicas, list(runtime.devices), runtime.worker_index
    local = len(devices)
    worker_ctx = tf.distribute.InputContext(num_input_pipelines=runtime.num_workers, input_pipeline_id=worker_index,
                                            num_replicas_in_sync=replicas)
    batch = worker_ctx.get_per_replica_batch_size(global_batch)
    dealer = Dealer(lambda: worker_dataset(worker_ctx), local)

    def replica_dataset(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        replica = ctx.input_pipeline_id % local
        with tf.device("/cpu:0"):   # the stream on the host, as the tf path's (this runs under the replica's device)
            rows = padded(worker_dataset(worker_ctx)) if local == 1 else dealer.rows(replica, batch)
        return replica_pipeline(rows, cfg, batch, devices[replica],
                                seed=(seed * 1_000_003 + worker_index * local + replica) % (1 << 31), replicas=local,
                                output=Output(evaluation, finish))
    return runtime.datasets_per_replica(replica_dataset, input_options())


def distribute_evaluation(runtime, worker_dataset: Callable, cfg: DataConfig, global_batch: int):
    """The distributed validation dataset: this worker's validation stream (`worker_dataset(input_context)`, the tf
    path's per-worker batches of (checked encoded bytes, label, weight)) dealt and decoded as `distribute` does
    the training stream's, each image's central crop at `data.eval_image_size`.

    Validation is decoded on the replicas' devices too: on a host that
    trains a light model on several GPUs, a whole validation split decoded on
    the CPUs each epoch would cost a large part of the epoch. A padding image
    (weight 0) crosses DALI as label -1, and its weight is made again after.
    """
    def rows(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return worker_dataset(ctx).map(lambda encoded, label, weight: (encoded, tf.where(weight > 0, label, -1)))
    return distribute(runtime, rows, cfg, global_batch, seed=0, evaluation=True, finish=weighted)


def weighted(image: tf.Tensor, label: tf.Tensor):
    """A decoded validation batch as (image, label, weight): label -1, a padding image, is weight 0."""
    return image, tf.maximum(label, 0), tf.cast(label >= 0, tf.float32)


def distribute_prediction(runtime, worker_dataset: Callable, cfg: DataConfig, global_batch: int):
    """`tfdp predict`'s distributed dataset: each replica's batches of (image number, image), number -1 a padding
    image, from `worker_dataset(input_context)` (`tfdp.data.pipeline.prediction_dataset`'s batches of image
    numbers and checked encoded bytes), dealt and decoded as `distribute_evaluation` does: the central crop at
    `data.eval_image_size`. A number crosses DALI as its label (int32: two billion images a run)."""
    def rows(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return worker_dataset(ctx).map(lambda numbers, encoded: (encoded, tf.cast(numbers, tf.int32)))
    return distribute(runtime, rows, cfg, global_batch, seed=0, evaluation=True, finish=numbered)


def numbered(image: tf.Tensor, label: tf.Tensor):
    """A decoded prediction batch as (image number, image), what `prediction_dataset` gives on the tf path."""
    return tf.cast(label, tf.int64), image


@dataclasses.dataclass(frozen=True)
class Output:
    """What a replica's DALI pipeline gives: training's random-resized crops, or (`evaluation`) each image's central
    crop at the evaluation size; `finish` maps the decoded batches on the host (`weighted`, `numbered`)."""
    evaluation: bool = False
    finish: Callable | None = None


def replica_pipeline(rows: tf.data.Dataset, cfg: DataConfig, batch: int, device: str, seed: int,
                     replicas: int = 1, decoder_options: dict | None = None, output: Output = Output()
                     ) -> tf.data.Dataset:
    """One replica's DALI dataset: the batches of `rows` (a host dataset of `pad_batch` arrays), each image cut
    out of its row, decoded, cropped and resized on `device` (a GPU: DALI's "mixed" decoder on that card; a CPU:
    DALI's CPU operators), as (image, label), cropped and finished as `output` says.

    The DALI dataset lives on the host: on a GPU, DALI copies each finished batch back to it (uint8 pixels,
    150 KB a 224 px image) and TensorFlow prefetches it to the replica's card, as the last stage of the
    replica's dataset. A DALI dataset placed on the GPU would need its inputs there too, and TensorFlow moves
    a dataset's elements to a device one call at a time (`copy_to_device`, about 2,000 elements/s here): one
    call per image would cap the input, one per decoded batch does not (docs/benchmarks.md, DALI). TensorFlow's
    own per-replica fetch (`InputOptions`) over a DALI dataset crashes when its iterator is deleted.

    `decoder_options`: more of DALI's own decoder arguments, on a GPU only
    (`benchmarks/input_pipeline.py --dali_alone` tries NVIDIA's buffer
    preallocation for ImageNet with them).
    """
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin import tf as dali_tf

    spec = tf.DeviceSpec.from_string(device)
    on_gpu = (spec.device_type or "").upper() == "GPU"
    threads = pipeline_threads(cfg, on_gpu, replicas)
    device_id = spec.device_index if on_gpu else None
    size = eval_image_size(cfg) if output.evaluation else cfg.image_size
    crop = central_crop if output.evaluation else random_crop
    options = {"hw_decoder_load": cfg.dali_hw_decoder_load, **(decoder_options or {})} if on_gpu else {}

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=device_id, seed=seed, prefetch_queue_depth=2,
                  exec_dynamic=True)   # the dynamic executor: a GPU batch copied back to the host (`.cpu()`)
    def decode():
        encoded, label = row_fields(fn.external_source(name="rows", dtype=types.UINT8, ndim=1, batch=True))
        image = crop(encoded, cfg, "mixed" if on_gpu else "cpu", options)
        image = fn.resize(image, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR, antialias=False,
                          dtype=types.UINT8)
        return (image.cpu() if on_gpu else image), label

    with tf.device("/cpu:0"):
        decoded = dali_tf.experimental.DALIDatasetWithInputs(
            pipeline=decode(), input_datasets={"rows": dali_tf.experimental.Input(rows, batch=True)},
            batch_size=batch, num_threads=threads, device_id=device_id, output_dtypes=(tf.uint8, tf.int32),
            output_shapes=((batch, size, size, 3), (batch,)))
        if output.finish is not None:
            decoded = decoded.map(output.finish)
    return decoded.apply(tf.data.experimental.prefetch_to_device(device, 2)).with_options(UNTUNED)


# The options of a replica's DALI dataset, outermost: nothing there for tf.data's autotuner to tune (the copy to the
# device and a prefetch of 2), and deleting the iterator waited on the autotuner's thread. Keras deletes the last
# validation iterator as each evaluation starts: on 2 workers on CPU (the demo, 3 epochs) that held the evaluations
# after the first by 7.6-8.8 s in 11 of 20, and in none of 28 with this (why one host never waited: not known).
# The stream DALI reads keeps its own autotuning.
UNTUNED = tf.data.Options()
UNTUNED.autotune.enabled = False


def row_fields(row):
    """A `pad_batch` row in a DALI pipeline: its image's encoded bytes, cut out of the row on DALI's threads, and
    its label."""
    from nvidia.dali import fn, types
    label = fn.reinterpret(row[0:4], dtype=types.INT32, shape=[1])
    length = fn.reinterpret(row[4:HEADER], dtype=types.INT32, shape=[])
    return row[HEADER:HEADER + length], label


def random_crop(encoded, cfg: DataConfig, device: str, options: dict):
    """DALI's random-resized crop (Inception-style window, `data.min_crop_area`..`data.max_crop_area`, aspect
    3/4..4/3, 10 attempts), decoding only the window; its windows are DALI's own, not tfdp's."""
    from nvidia.dali import fn, types
    return fn.decoders.image_random_crop(encoded, device=device, output_type=types.RGB,
                                         random_area=[cfg.min_crop_area, cfg.max_crop_area],
                                         random_aspect_ratio=list(ASPECT_RATIO_RANGE), num_attempts=10, **options)


def central_crop(encoded, cfg: DataConfig, device: str, options: dict):
    """The tf path's evaluation window (`tfdp.data.preprocess.center_crop`): a square of `data.eval_crop_fraction`
    of the shorter side, rounded down, at ((height - side) // 2, (width - side) // 2), decoding only the window
    (the shape read from the image's header)."""
    from nvidia.dali import fn, math, types
    shape = fn.peek_image_shape(encoded, dtype=types.FLOAT)
    side = math.floor(math.min(shape[0], shape[1]) * cfg.eval_crop_fraction)
    return fn.decoders.image_crop(encoded, device=device, output_type=types.RGB, crop_h=side, crop_w=side,
                                  crop_pos_x=0.5, crop_pos_y=0.5, rounding="truncate", **options)


GPU_THREADS = 3   # a GPU replica's DALI threads by default (pipeline_threads)


def pipeline_threads(cfg: DataConfig, on_gpu: bool, replicas: int = 1) -> int:
    """A replica's DALI CPU threads: `data.dali_threads`, or (0) the host's cores shared among its `replicas`
    replicas, at most `GPU_THREADS` for a GPU's.

    On a GPU the threads only parse each JPEG and hand it to the card's
    decoders, and more of them cost more than they give: on one H200 (16
    cores) ResNet-18 trained at 0.98x its synthetic rate with 3, 0.92x with
    4, 0.91x with 6 and 0.82x with 8, DALI's own threads taking 0.12, 0.19,
    0.40 and 0.66 ms of host CPU per image (docs/benchmarks.md, DALI on one H200).
    """
    if cfg.dali_threads:
        return cfg.dali_threads
    share = max(1, host_cores() // max(replicas, 1))
    return min(GPU_THREADS, share) if on_gpu else share


def padded(stream: tf.data.Dataset) -> tf.data.Dataset:
    """A worker's stream of checked (encoded images, labels) batches as DALI takes them (`pad_batch`), on the host."""
    with tf.device("/cpu:0"):
        return stream.map(pad_batch, num_parallel_calls=tf.data.AUTOTUNE)


def pad_batch(encoded: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """A batch of encoded images and their labels as one uint8 array [batch, HEADER + the longest image]: row i
    holds label i and image i's length in bytes (int32 each, the host's byte order), then the image's bytes,
    then zeros.

    DALI's plugin takes a batch whole only as one dense array (its batch
    mode), and a batch taken whole crosses to DALI in one step: the images
    are cut out of their rows inside DALI, on its threads. Taken image by
    image, each image was one more tf.data element on its way (cut out,
    converted, fetched by DALI in series), each hop a copy of its bytes on
    a single thread (docs/benchmarks.md, DALI). The padding costs memory,
    not copies: the rows are written once.
    """
    lengths = tf.strings.length(encoded)
    rows = tf.strings.join([_int32_bytes(labels), _int32_bytes(lengths), encoded])
    return tf.io.decode_raw(rows, tf.uint8, fixed_length=HEADER + tf.reduce_max(lengths))


def _int32_bytes(values: tf.Tensor) -> tf.Tensor:
    """Each value as the 4-byte string of its int32."""
    one_byte = tf.constant([bytes([b]) for b in range(256)])   # byte value → that one-byte string
    return tf.strings.reduce_join(tf.gather(one_byte, tf.cast(tf.bitcast(tf.cast(values, tf.int32), tf.uint8),
                                                              tf.int32)), axis=1)
