"""Input pipeline images/s beside plain JPEG decoding of the same files, in one run.

Writes ImageNet-sized JPEGs (about 500x375, ~90 KB, cut from the real photos in
the scikit-image/scikit-learn wheels), converts them to TFRecord shards twice
(original size, and downscaled at conversion time to --max_side), then measures
in alternating rounds (best round reported, so a noisy neighbour hurts every
variant alike):

  full decode         read each JPEG file, tf.io.decode_jpeg the whole image
  crop + resize alone read each JPEG file, tfdp's random-resized crop and resize, and
                      nothing else (no shuffle, no corrupt-image counting): the
                      ceiling of TensorFlow's own kernels for this work
  tfdp train (files)  tfdp's training pipeline on the JPEG files
  tfdp train (shards) tfdp's training pipeline on the TFRecord shards
  tfdp train (WebDataset shards)   the same on the same JPEGs in WebDataset tar
                      shards (`data.format: wds`, written by webdataset's TarWriter)
  tfdp train (shards, repeated aug x3)   the same with data.repeated_augmentation: 3
  tfdp train (shards, max side N)   the same on the downscaled shards
  tfdp train (gs:// shards, warm)    the full-size shards read from a bucket (a real
                      GCS emulator on loopback), after the first read cached them
  tfdp train (shards, at REV)   with --baseline=REV: the same shard pipeline as tfdp
                      at git revision REV builds it, in a process of its own (its
                      tfdp/ unpacked with `git archive`), timed in the same rounds

The first (cold) read from the bucket is timed separately: it copies the
shards to the local cache in parallel.

tfdp's pipeline is the real one (`tfdp.data.pipeline.train_dataset`): random-
resized crop decoded with decode_and_crop_jpeg, bilinear resize to --size,
uint8 out, batch --batch, corrupt-image counting; the flip and the
normalisation happen later, on the device (the model's first layers).
Beside each rate: the CPU time the process spent per image (least of the
rounds), which other jobs on the host disturb far less than the rate.

  python benchmarks/input_pipeline.py [--images=768] [--size=224] [--batch=128] [--max_side=256] [--baseline=REV]

With --decoders, only the JPEG files are written and the rows are the two
decoders of `data.decoder` on the host's CPU, side by side in the same rounds:

  crop + resize alone (tf)        as above
  crop + resize alone (DALI CPU)  the same bytes, read by tf.data, decoded, cropped and
                                  resized by DALI's CPU operators (`device_id=None`)
  tfdp stream (files), decoder dali, to DALI's input   the same stream as far as DALI: checked,
                                  each batch one array (`dali.pad_batch`), nothing decoded
  tfdp train (files), decoder tf / dali (CPU)   tfdp's training pipeline on the files, its
                                  transform and batches as `data.decoder` makes them
                                  (tfdp.data.dali), on one CPU device

  python benchmarks/input_pipeline.py --decoders [--images=256] [--size=224] [--batch=64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tfdp this process times: this checkout's, or (a --baseline child) one unpacked from another revision.
TFDP_ROOT_ENV = "TFDP_BENCH_ROOT"
sys.path.insert(0, REPO)
sys.path.insert(0, os.environ.get(TFDP_ROOT_ENV, REPO))
sys.path.insert(1, os.path.join(REPO, "tests"))   # support.photos, support.gcs_emulator

import tfdp  # noqa: E402,F401  (TensorFlow environment defaults)


SHARD_SETS = ("shards", "small")   # full size, and the longer side at --max_side


def make_data(workdir: str, images: int, max_side: int, sets: tuple[str, ...] = SHARD_SETS) -> dict[str, str]:
    """The JPEG tree (written by one process per core) and the shard conversions named in `sets`, each in a
    process of its own (the converter imports no TensorFlow, so it leaves a GPU alone), each made once (a later
    call finds it): a GPU host's time goes to the measurement, not to making data, nor to a conversion its rows do
    not read."""
    tree = os.path.join(workdir, "tree")
    if not os.path.exists(tree + ".written"):   # written before (a lease's data made in steps), else now
        write_tree(tree, images)
    made = {"tree": tree}
    for name in sets:
        side = max_side if name == "small" else 0
        made[name] = os.path.join(workdir, f"shards-{side}" if side else "shards")
        if os.path.exists(made[name] + ".made"):
            continue
        subprocess.run([sys.executable, "-m", "pipelines.convert_imagenet", f"--src={tree}", f"--out={made[name]}",
                        "--train_shards=16", "--val_shards=1", f"--max_side={side}"], cwd=REPO,
                       check=True, capture_output=True)
        with open(made[name] + ".made", "w", encoding="utf-8") as f:
            f.write(f"{images}\n")
    return made


def write_wds(tree: str, out: str, shards: int = 16) -> str:
    """The tree's JPEGs, byte for byte, in WebDataset shards (an image and its `.cls` per sample), the
    training images dealt round robin to `shards` shards as the converter deals them; written once."""
    import webdataset

    from tfdp.config import DataConfig
    from tfdp.data import build_source
    if os.path.exists(out + ".made"):
        return out
    source = build_source(DataConfig(format="imagenet", dir=tree))
    os.makedirs(out, exist_ok=True)
    for name, split, n in (("train", source.split("train"), shards), ("validation", source.split("val"), 1)):
        for s in range(n):
            with webdataset.TarWriter(os.path.join(out, f"imagenet-{name}-{s:04d}.tar")) as writer:
                for number, (path, label) in enumerate(zip(split.files[s::n], split.labels[s::n])):
                    with open(path, "rb") as f:
                        writer.write({"__key__": f"{s:04d}-{number:06d}", "jpg": f.read(), "cls": str(label).encode()})
    open(out + ".made", "w", encoding="utf-8").close()
    return out


def write_tree(tree: str, images: int) -> None:
    """A raw ILSVRC tree of about `images` training JPEGs (and one validation image per class), written by one
    process per core: each writes its part of every class (a seed of its own) into a folder of its own, merged
    after (file names kept apart by the part's number)."""
    import concurrent.futures
    import multiprocessing
    import shutil

    from support.photos import SYNSETS
    classes = len(SYNSETS)
    per_class = max(images // classes, 1)
    parts = max(1, min(os.cpu_count() or 1, per_class))
    counts = [len(range(p, per_class, parts)) for p in range(parts)]
    folders = [os.path.join(tree + "-parts", str(p)) for p in range(parts)]
    with concurrent.futures.ProcessPoolExecutor(parts, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_write_part, folders, [classes] * parts, counts, [1] + [0] * (parts - 1), range(parts)))
    for p, folder in enumerate(folders):
        for root, _, files in os.walk(folder):
            target = os.path.join(tree, os.path.relpath(root, folder))
            os.makedirs(target, exist_ok=True)
            for name in files:
                os.replace(os.path.join(root, name), os.path.join(target, name if p == 0 else f"p{p}-{name}"))
    shutil.rmtree(tree + "-parts")
    with open(tree + ".written", "w", encoding="utf-8") as f:
        f.write(f"{images}\n")


def _write_part(folder: str, classes: int, per_class: int, val_per_class: int, seed: int) -> None:
    from support.photos import write_imagenet_tree
    write_imagenet_tree(folder, classes, per_class, val_per_class, "ilsvrc", seed=seed)


def allocator(environ=os.environ) -> str:
    """The malloc a process with `environ` runs on (this one: tfdp's TCMalloc where installed, as `main` preloads
    it; else glibc's): host CPU figures depend on it, glibc's page-faulting on large buffers TCMalloc reuses."""
    preloaded = environ.get("LD_PRELOAD", "")
    return f"allocator {os.path.basename(preloaded.split()[0])}" if "malloc" in preloaded else "allocator glibc"


def rate(dataset, batch: int, batches: int) -> tuple[float, float]:
    """(images/s, CPU microseconds of this process per image) over `batches` batches after three."""
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(iterator)
    return batches * batch / (time.perf_counter() - start), 1e6 * (time.process_time() - cpu) / (batches * batch)


def per_file(files: list[str], image_fn, batch: int):
    """`image_fn(encoded bytes)` on every file, as fast as tf.data runs it (unordered, AUTOTUNE)."""
    import tensorflow as tf
    ds = tf.data.Dataset.from_tensor_slices(files).repeat()
    ds = ds.map(lambda path: image_fn(tf.io.read_file(path)), num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    return ds.batch(batch).prefetch(tf.data.AUTOTUNE)


def full_decode(files: list[str], batch: int):
    import tensorflow as tf
    return per_file(files, lambda data: tf.shape(tf.io.decode_jpeg(data, channels=3)), batch)


def crop_and_resize_alone(files: list[str], size: int, batch: int):
    from tfdp.config import DataConfig
    from tfdp.data.preprocess import random_crop
    cfg = DataConfig(image_size=size)
    return per_file(files, lambda data: random_crop(data, cfg), batch)


def tfdp_stream(data_format: str, directory: str, size: int, batch: int, cache_dir: str = "~/.cache/tfdp/remote",
                **data):
    """tfdp's training pipeline (`train_dataset`) as a run with these `data` settings builds it: under
    `data.decoder: dali`, its checked batches of encoded images, before DALI."""
    from tfdp.config import DataConfig
    from tfdp.data import build_source
    from tfdp.data.pipeline import Bookkeeping, train_dataset
    cfg = DataConfig(format=data_format, dir=directory, image_size=size, shuffle_buffer=1024, cache_dir=cache_dir,
                     **data)
    return train_dataset(build_source(cfg).split("train"), cfg, batch, seed=0, books=Bookkeeping(num_classes=1000))


def tfdp_train(data_format: str, directory: str, size: int, batch: int, cache_dir: str = "~/.cache/tfdp/remote",
               **data):
    """tfdp's training input: the pipeline, and under `data.decoder: dali` its batches decoded by DALI on this
    process's CPU."""
    from tfdp.config import DataConfig
    stream = lambda: tfdp_stream(data_format, directory, size, batch, cache_dir, **data)  # noqa: E731
    if data.get("decoder", "tf") != "dali":
        return stream()
    from tfdp.data import dali
    return dali.replica_pipeline(dali.padded(stream()), DataConfig(image_size=size, **data), batch, "/device:CPU:0",
                                 seed=0)


def dali_feed_alone(data_format: str, directory: str, size: int, batch: int):
    """tfdp's stream under `data.decoder: dali` as far as DALI's input: checked encoded batches, each one array
    (`dali.pad_batch`), as one replica's DALI pipeline reads them; nothing decoded. The host work the DALI path
    does before DALI, on a GPU as here."""
    from tfdp.data import dali
    return dali.padded(tfdp_stream(data_format, directory, size, batch, decoder="dali"))


def dali_crop_and_resize_alone(files: list[str], size: int, batch: int):
    """Each file read by tf.data, decoded, cropped and resized by DALI's CPU operators, and nothing else."""
    import tensorflow as tf
    from tfdp.config import DataConfig
    from tfdp.data import dali
    paths = tf.data.Dataset.from_tensor_slices(files).repeat()
    encoded = paths.map(tf.io.read_file, num_parallel_calls=tf.data.AUTOTUNE).batch(batch, drop_remainder=True)
    batches = encoded.map(lambda data: (data, tf.zeros([batch], tf.int32)))
    return dali.replica_pipeline(dali.padded(batches), DataConfig(image_size=size), batch, "/device:CPU:0", seed=0)


def decoder_rows(args) -> None:
    """--decoders: tf and DALI's CPU operators on the same JPEG files, in alternating rounds."""
    load_at_start = os.getloadavg()[0]
    from tfdp.config import DataConfig
    from tfdp.data import build_source
    with tempfile.TemporaryDirectory() as workdir:
        tree = make_data(workdir, args.images, args.max_side, sets=())["tree"]
        files = list(build_source(DataConfig(format="imagenet", dir=tree)).split("train").files)
        variants = {
            "crop + resize alone (tf)": lambda: crop_and_resize_alone(files, args.size, args.batch),
            "crop + resize alone (DALI CPU)": lambda: dali_crop_and_resize_alone(files, args.size, args.batch),
            "tfdp stream (files), decoder dali, to DALI's input": lambda: dali_feed_alone("imagenet", tree, args.size,
                                                                                         args.batch),
            "tfdp train (files), decoder tf": lambda: tfdp_train("imagenet", tree, args.size, args.batch),
            "tfdp train (files), decoder dali (CPU)":
                lambda: tfdp_train("imagenet", tree, args.size, args.batch, decoder="dali"),
        }
        timers = {name: (lambda ds: lambda: rate(ds, args.batch, args.batches))(make())
                  for name, make in variants.items()}
        best, cpu = {name: 0.0 for name in timers}, {name: float("inf") for name in timers}
        for _ in range(args.rounds):
            for name, timed in timers.items():
                images_per_sec, cpu_us = timed()
                best[name], cpu[name] = max(best[name], images_per_sec), min(cpu[name], cpu_us)
    print(f"{len(files)} JPEGs; {args.size}x{args.size} crops, batch {args.batch}, {os.cpu_count()} CPU cores, "
          f"{allocator()}; best "
          f"of {args.rounds} rounds; 1-minute load average {load_at_start:.2f} at the start, {os.getloadavg()[0]:.2f} "
          f"after")
    print(f"{'pipeline':52s} {'images/s':>9s} {'CPU us/image':>13s}")
    for name, value in best.items():
        print(f"{name:52s} {value:9.0f} {cpu[name]:13.0f}")


class Baseline:
    """tfdp's shard pipeline as git revision `rev` builds it, timed round by round in a child process.

    The child imports the revision's own tfdp (unpacked with `git archive`, so
    this checkout is left alone) and builds its pipeline once; each round the
    parent asks for one measurement and waits, so the two processes never
    compete for the CPU.
    """

    def __init__(self, rev: str, shards: str, args, workdir: str):
        root = os.path.join(workdir, "baseline")
        os.makedirs(root)
        archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", rev, "tfdp"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
        env = {**os.environ, TFDP_ROOT_ENV: root}
        command = [sys.executable, os.path.abspath(__file__), "--serve", shards, f"--size={args.size}",
                   f"--batch={args.batch}", f"--batches={args.batches}"]
        self.child = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()  # built

    def _answer(self) -> str:
        while True:
            line = self.child.stdout.readline()
            if not line:
                raise RuntimeError(f"the baseline process ended (exit status {self.child.wait()})")
            if line.startswith("bench: "):
                return line.removeprefix("bench: ").strip()

    def rate(self) -> tuple[float, float]:
        self.child.stdin.write("go\n")
        self.child.stdin.flush()
        images_per_sec, cpu_us = self._answer().split()
        return float(images_per_sec), float(cpu_us)

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait()


def records_alone(shards: str, batch: int, whole: bool):
    """The shards' records as tfdp locates and reads them (`read_record` in one parallel, ordered map), batched,
    nothing else; `whole`: each also parsed and checked as under data.decoder dali, in the same map. No
    shuffle, no bookkeeping: the stream's parallel part, beside the stream itself."""
    import tensorflow as tf
    from tfdp.config import DataConfig
    from tfdp.data import build_source, preprocess, readers
    from tfdp.data.layouts.tfrecord import parse_record, read_record
    cfg = DataConfig(format="tfrecord", dir=shards, decoder="dali")
    share = build_source(cfg).split("train")
    check = preprocess.encoded_transform(cfg, 0)

    def one(path, offset):
        record = read_record(path, offset)
        return check(parse_record(record, share.records)[0], 0) if whole else tf.strings.length(record)
    locations = readers.payloads(share, cfg, tf.distribute.InputContext(), False).repeat()
    return locations.map(one, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).batch(batch)


def filled(ds, shards: str, batch: int):
    """`ds` (a data.cache stream) after one whole pass, which fills its cache: later batches come from memory."""
    from tfdp.config import DataConfig
    from tfdp.data import build_source
    iterator = iter(ds)
    for _ in range(build_source(DataConfig(format="tfrecord", dir=shards)).split("train").num_examples // batch + 1):
        next(iterator)
    del iterator
    return ds


STREAMS = {   # --streams' pipelines on shards: (shards, size, batch) → dataset of batches
    "records read alone": lambda d, size, b: records_alone(d, b, whole=False),
    "records read, parsed, checked, batched": lambda d, size, b: records_alone(d, b, whole=True),
    "dali stream, from the shards": lambda d, size, b: tfdp_stream("tfrecord", d, size, b, decoder="dali"),
    "dali stream as DALI takes it (one array a batch)": lambda d, size, b: dali_feed_alone("tfrecord", d, size, b),
    "dali stream, records in memory": lambda d, size, b: filled(
        tfdp_stream("tfrecord", d, size, b, decoder="dali", cache=True), d, b),
    "tf train pipeline, from the shards": lambda d, size, b: tfdp_stream("tfrecord", d, size, b),
}


def stream_rates(shards: str, args) -> None:
    """--streams: each of STREAMS on the shards, on the cores this process may use (its parent pins it), as one
    JSON line {name: [images/s, CPU us/image]}. The dali stream is what the DALI path's replicas are fed from
    (checked encoded batches, nothing decoded); its parts without the shuffle and the bookkeeping (the reads
    alone; the reads, parsing and checks) say what scales with the cores, and with the records in memory
    (`data.cache`, after one pass that fills it) it reads no file and checks no CRC, so it is the stream's own
    work between the reads. Beside the tf pipeline, where the host's time goes as cores are added."""
    out = {}
    for name, stream in STREAMS.items():
        ds = stream(shards, args.size, args.batch)
        out[name] = [round(v) for v in max(rate(ds, args.batch, args.batches) for _ in range(args.rounds))]
    print("streams: " + json.dumps(out), flush=True)


def dali_alone(shards: str, args) -> None:
    """--dali_alone: one replica's DALI pipeline on this process's first GPU (else its CPU) with nothing before
    it: --batches distinct batches of the shards' images, padded as the stream hands them to DALI
    (`dali.pad_batch`), held in memory and repeated, each decoded, cropped and resized by DALI with the data
    settings of --dali_settings ("dali_threads=4:dali_hw_decoder_load=0.65"); a key there that is no data
    setting is one of DALI's own decoder arguments, on a GPU ("preallocate_width_hint=5980": NVIDIA's ImageNet
    pipelines preallocate the decoder's buffers for the largest image), but "decode=false": DALI's feed alone
    (`dali_feed_only`). One JSON line [images/s, CPU us/image]: what DALI itself costs the host per image,
    apart from tfdp's stream."""
    import tensorflow as tf
    import yaml
    from tfdp.config import DataConfig
    from tfdp.data import dali
    settings = {k: yaml.safe_load(v) for k, v in (kv.split("=") for kv in args.dali_settings.split(":") if kv)}
    decode = settings.pop("decode", True)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    cfg = DataConfig(image_size=args.size, **{k: v for k, v in settings.items() if k in fields})
    rows = dali_feed_alone("tfrecord", shards, args.size, args.batch).take(args.batches).cache().repeat()
    on_gpu = bool(tf.config.list_physical_devices("GPU"))
    if decode:
        decoded = dali.replica_pipeline(rows, cfg, args.batch, "/device:GPU:0" if on_gpu else "/device:CPU:0",
                                        seed=0, decoder_options={k: v for k, v in settings.items() if k not in fields})
    else:
        decoded = dali_feed_only(rows, args.batch, dali.pipeline_threads(cfg, on_gpu))
    print("dali_alone: " + json.dumps([round(v) for v in max(rate(decoded, args.batch, args.batches)
                                                             for _ in range(args.rounds))]), flush=True)


def dali_feed_only(rows, batch: int, threads: int):
    """DALI's side of the feed without the decoder: the CPU operators before it in `dali.replica_pipeline` (each
    row's label and length read, its image cut out), with as many threads as a replica's pipeline gets; then
    only each image's header read (`peek_image_shape`). Beside the full pipeline on a GPU host, what DALI's
    executor costs per image apart from the decoder's host work (which the mixed decoder partly does on the
    executor's thread)."""
    import tensorflow as tf
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin import tf as dali_tf
    from tfdp.data.dali import row_fields

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=0, prefetch_queue_depth=2,
                  exec_dynamic=True)
    def feed():
        encoded, label = row_fields(fn.external_source(name="rows", dtype=types.UINT8, ndim=1, batch=True))
        return fn.peek_image_shape(encoded), label

    with tf.device("/cpu:0"):
        return dali_tf.experimental.DALIDatasetWithInputs(
            pipeline=feed(), input_datasets={"rows": dali_tf.experimental.Input(rows, batch=True)},
            batch_size=batch, num_threads=threads, device_id=None, output_dtypes=(tf.int64, tf.int32),
            output_shapes=((batch, 3), (batch,)))


def serve(shards: str, args) -> None:
    """The --baseline child: one shard-pipeline measurement per line read from stdin."""
    ds = tfdp_train("tfrecord", shards, args.size, args.batch)
    print("bench: ready", flush=True)
    for _ in sys.stdin:
        print("bench: {} {}".format(*rate(ds, args.batch, args.batches)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=768)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--max_side", type=int, default=256)
    parser.add_argument("--batches", type=int, default=30, help="timed batches per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    parser.add_argument("--baseline", default="", help="also time the shard pipeline of this git revision")
    parser.add_argument("--decoders", action="store_true", help="only data.decoder's rows: tf and DALI (CPU)")
    parser.add_argument("--serve", default="", help=argparse.SUPPRESS)   # the --baseline child: shard folder
    parser.add_argument("--streams", default="", help=argparse.SUPPRESS)   # benchmarks/gpu.py's scaling row: shards
    parser.add_argument("--dali_alone", default="", help=argparse.SUPPRESS)   # gpu.py's dali_alone row: shards
    parser.add_argument("--dali_settings", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from tfdp.startup.allocator import preload_tcmalloc
    preload_tcmalloc()   # the allocator `tfdp` runs on (this process starts again with it, where installed)
    if args.serve:
        return serve(args.serve, args)
    if args.streams:
        return stream_rates(args.streams, args)
    if args.dali_alone:
        return dali_alone(args.dali_alone, args)
    if args.decoders:
        return decoder_rows(args)
    load_at_start = os.getloadavg()[0]   # before this script's own work (making the data) adds to it

    from tfdp.config import DataConfig
    from tfdp.data import build_source

    from support.gcs_emulator import gcs_emulator

    with tempfile.TemporaryDirectory() as workdir, gcs_emulator("bench") as bucket:
        paths = make_data(workdir, args.images, args.max_side)
        import fsspec
        fs, _ = fsspec.core.url_to_fs(bucket)
        fs.put(paths["shards"], bucket.removeprefix("gs://") + "/shards", recursive=True)
        cache = os.path.join(workdir, "cache")
        start = time.perf_counter()
        tfdp_train("tfrecord", f"{bucket}/shards", args.size, args.batch, cache)  # cold: copies to the cache
        cold_seconds = time.perf_counter() - start
        shard_mb = sum(os.path.getsize(os.path.join(paths["shards"], n)) for n in os.listdir(paths["shards"])) / 2**20
        files = list(build_source(DataConfig(format="imagenet", dir=paths["tree"])).split("train").files)
        wds = write_wds(paths["tree"], os.path.join(workdir, "wds"))
        mean_kb = sum(os.path.getsize(f) for f in files) / len(files) / 1024
        variants = {
            "full decode": lambda: full_decode(files, args.batch),
            "crop + resize alone": lambda: crop_and_resize_alone(files, args.size, args.batch),
            "tfdp train (files)": lambda: tfdp_train("imagenet", paths["tree"], args.size, args.batch),
            "tfdp train (shards)": lambda: tfdp_train("tfrecord", paths["shards"], args.size, args.batch),
            "tfdp train (WebDataset shards)": lambda: tfdp_train("wds", wds, args.size, args.batch),
            "tfdp train (shards, repeated aug x3)":
                lambda: tfdp_train("tfrecord", paths["shards"], args.size, args.batch, repeated_augmentation=3),
            f"tfdp train (shards, max side {args.max_side})":
                lambda: tfdp_train("tfrecord", paths["small"], args.size, args.batch),
            "tfdp train (gs:// shards, warm)": lambda: tfdp_train("tfrecord", f"{bucket}/shards", args.size,
                                                                   args.batch, cache),
        }
        timers = {name: (lambda ds: lambda: rate(ds, args.batch, args.batches))(make())
                  for name, make in variants.items()}
        baseline = Baseline(args.baseline, paths["shards"], args, workdir) if args.baseline else None
        if baseline:
            timers[f"tfdp train (shards, at {args.baseline})"] = baseline.rate
        best = {name: 0.0 for name in timers}
        cpu = {name: float("inf") for name in timers}
        load_before = os.getloadavg()[0]
        for _ in range(args.rounds):
            for name, timed in timers.items():
                images_per_sec, cpu_us = timed()
                best[name], cpu[name] = max(best[name], images_per_sec), min(cpu[name], cpu_us)
        if baseline:
            baseline.close()
    base = best["full decode"]
    print(f"cold read from the bucket: {shard_mb:.0f} MB of shards copied to the local cache in {cold_seconds:.1f} s "
          f"(GCS emulator on loopback)")
    print(f"{len(files)} JPEGs, mean {mean_kb:.0f} KB; {args.size}x{args.size} crops, batch {args.batch}, "
          f"{os.cpu_count()} CPU cores, {allocator()}; best of {args.rounds} rounds; 1-minute load average {load_at_start:.2f} "
          f"at the start, {load_before:.2f} before the rounds, {os.getloadavg()[0]:.2f} after")
    print(f"{'pipeline':42s} {'images/s':>9s} {'vs full decode':>15s} {'CPU us/image':>13s}")
    for name, value in best.items():
        print(f"{name:42s} {value:9.0f} {value / base:14.2f}x {cpu[name]:13.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"images": len(files), "mean_kb": mean_kb, "images_per_sec": best, "cold_seconds": cold_seconds,
                       "ratio": {k: v / base for k, v in best.items()}, "cpu_us_per_image": cpu,
                       "load_average": [load_at_start, load_before, os.getloadavg()[0]]}, f, indent=1)


if __name__ == "__main__":
    main()
