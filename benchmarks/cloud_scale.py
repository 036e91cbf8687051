"""ImageNet's shape in an S3 bucket: listing, time to the first training step and peak memory, counts not bytes.

A real S3 server (moto's, `moto.server.ThreadedMotoServer`) runs on loopback
in this process, and a bucket is filled with ImageNet's layouts at two sizes,
1/16 and full:

  tfrecord  train-00000-of-01024 ... + validation-00000-of-00128 ... (1/16: -of-00064 and -of-00008), the
            standard shards tfdp's converter and TensorFlow's build_imagenet_data.py write, with the
            converter's synsets.txt and counts.json beside them; each shard a few real records
  raw       the image-net.org ILSVRC2012 tree: train/<wnid>/<wnid>_<n>.JPEG, 1,000 classes x 1,281 images
            (1/16: x 80), a flat val/ of 50,000 (1/16: 3,125) labelled by the devkit's
            ILSVRC2012_validation_ground_truth.txt and meta.mat

Bodies are small real JPEGs (a few KB, cut from the photos in the scikit-image
and scikit-learn wheels, `tests/support/photos.py`): the counts are
ImageNet's, the bytes are not. Uploading 1.3 M objects over HTTP would take
hours here, so the bucket is filled through moto's backend directly, in the
server's own process (`SharedBodyKey`: one bytes object per distinct body,
no per-object buffer); tfdp itself only ever talks HTTP to the server, with
the AWS_* settings a user would give (docs/data.md).

Measured, for each layout and size, each in a process of its own:

  listing     tfdp's own listing: `build_source` (both splits) in a fresh process, timed around the
              call alone (imports excluded), with a fresh data.cache_dir
  first step  a real `tfdp train` (simple_cnn, 32 px, global batch 64, data.cache_limit small so the
              training share streams) from process start to its first training step (Keras' "1/N"
              progress bar on a pseudo-terminal, as benchmarks/startup.py sees it); fresh cache and
              model_dir. The process is stopped there.
  peak MB     the largest resident set of that `tfdp train` process and its children (50 ms samples)
  requests    ListObjectsV2 / HEAD / GET requests the server answered for each

moto's listing. `S3Backend.list_objects_v2` (moto/s3/models.py) answers
every page by walking *every key of the bucket* (`list_objects`: a copy of
the key dict, a `startswith` per key), sorting the prefix's keys and then
scanning to the continuation token: each page costs O(objects in the bucket),
so a listing of the whole bucket is quadratic. At 1.33 M objects one page
takes seconds, and tfdp's ~3,300 pages (a listing per class folder, the flat
val/ and the training share's sizes) would take hours. With
--moto_listing=indexed (the default for buckets of more than
--index_above objects) the server answers ListObjectsV2 from a sorted index
of the key names instead (bisect to the prefix and the token, then walk the
page, stepping over a common prefix's keys at once); the same pages, checked
against moto's own answer at start-up on a set of prefixes, delimiters and
continuation tokens. --moto_listing=stock keeps moto's listing for every size;
the stock per-page time at each size is measured and printed either way.

  python benchmarks/cloud_scale.py [--sizes=1/16,full] [--layouts=tfrecord,raw] [--root=/tmp/cloud-scale]
                                   [--moto_listing=auto|stock|indexed] [--cache_limit=256KB]
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import startup  # noqa: E402  - the pseudo-terminal clock and the RSS sampler of the local-disk benchmark

CLASSES, TRAIN_PER_CLASS, VAL_IMAGES = 1000, 1281, 50_000
TRAIN_SHARDS, VAL_SHARDS = 1024, 128
RECORDS_PER_SHARD = 4
SIZES = {"1/16": 16, "full": 1}
JPEG_SIZE = (64, 48)          # pixels: a few KB of real JPEG per object
DISTINCT_JPEGS = 64
REGION = "us-east-1"
GLOBAL_BATCH = 64


def wnid(k: int) -> str:
    return f"n{k + 1:08d}"


# --- bodies ------------------------------------------------------------------

def jpegs() -> list[bytes]:
    """DISTINCT_JPEGS small real JPEGs cut from the photos in the scikit-image and scikit-learn wheels."""
    import numpy as np
    from support.photos import photo_jpeg, real_photos

    photos, rng = real_photos(), np.random.default_rng(0)
    return [photo_jpeg(photos[i % len(photos)], rng, JPEG_SIZE, quality=90) for i in range(DISTINCT_JPEGS)]


SHARD_MAKER = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
from tfdp.data.layouts.tfrecord import Item, Prepared, image_example
spec = json.load(sys.stdin)
images = [bytes.fromhex(h) for h in spec["jpegs"]]
w, h = spec["size"]
for name, labels in spec["shards"].items():
    with tf.io.TFRecordWriter(os.path.join(spec["out"], name)) as writer:
        for n, label in enumerate(labels):
            wnid = f"n{label + 1:08d}"
            item = Item(path=f"{wnid}_{n}.JPEG", label=label, synset=wnid, text=f"class {label}")
            writer.write(image_example(item, Prepared(images[(label + n) % len(images)], h, w, (w, h)))
                         .SerializeToString())
"""


def shard_bodies(root: str, divisor: int, images: list[bytes]) -> dict[str, bytes]:
    """name → bytes of every shard at one size: standard ImageNet records (tfdp.data.layouts.tfrecord.image_example,
    written by TensorFlow's own TFRecordWriter in a process of its own), built once under `root`."""
    from tfdp.data.layouts.records import shard_name

    train, val = TRAIN_SHARDS // divisor, VAL_SHARDS // divisor
    names = [shard_name("train", i, train) for i in range(train)] + [shard_name("validation", i, val) for i in range(val)]
    folder = os.path.join(root, f"shards-{train}")
    if not all(os.path.exists(os.path.join(folder, n)) for n in names):
        os.makedirs(folder, exist_ok=True)
        shards = {n: [(i * RECORDS_PER_SHARD + j) * 7 % CLASSES for j in range(RECORDS_PER_SHARD)]
                  for i, n in enumerate(names)}
        spec = {"out": folder, "jpegs": [j.hex() for j in images], "size": JPEG_SIZE, "shards": shards}
        subprocess.run([sys.executable, "-c", SHARD_MAKER], input=json.dumps(spec), text=True, check=True, cwd=REPO)
    bodies = {}
    for n in names:
        with open(os.path.join(folder, n), "rb") as f:
            bodies[n] = f.read()
    return bodies


def meta_mat() -> bytes:
    """The devkit's meta.mat for CLASSES leaf synsets, their ILSVRC2012_IDs in reverse synset order (as in the
    real one, the IDs are not in label order), plus one non-leaf."""
    import numpy as np
    import scipy.io

    dtype = [("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("gloss", "O"), ("num_children", "O"),
             ("children", "O"), ("wordnet_height", "O"), ("num_train_images", "O")]
    rows = [(i + 1, wnid(CLASSES - 1 - i), f"class {CLASSES - 1 - i}", "", 0, np.zeros(0), 0, 0)
            for i in range(CLASSES)]
    rows.append((CLASSES + 1, "n00001740", "entity", "", CLASSES, np.arange(1, CLASSES + 1), 19, 0))
    out = io.BytesIO()
    scipy.io.savemat(out, {"synsets": np.array(rows, dtype=dtype)})
    return out.getvalue()


def raw_objects(divisor: int, images: list[bytes]):
    """(key, body) of the raw ILSVRC2012 tree at 1/divisor of the images per class (all 1,000 classes)."""
    per_class, val = TRAIN_PER_CLASS // divisor, VAL_IMAGES // divisor
    for k in range(CLASSES):
        for n in range(1, per_class + 1):
            yield f"train/{wnid(k)}/{wnid(k)}_{n}.JPEG", images[(k + n) % len(images)]
    # val image n is of class (n - 1) mod CLASSES, whose ILSVRC2012_ID is CLASSES - class (see meta_mat)
    truth = "".join(f"{CLASSES - (n - 1) % CLASSES}\n" for n in range(1, val + 1)).encode()
    for n in range(1, val + 1):
        yield f"val/ILSVRC2012_val_{n:08d}.JPEG", images[n % len(images)]
    yield "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt", truth
    yield "ILSVRC2012_devkit_t12/data/meta.mat", meta_mat()


def tfrecord_objects(root: str, divisor: int, images: list[bytes]):
    bodies = shard_bodies(root, divisor, images)
    yield from bodies.items()
    yield "synsets.txt", "".join(f"{wnid(k)}\tclass {k}\n" for k in range(CLASSES)).encode()
    counts = {n: RECORDS_PER_SHARD for n in bodies}
    splits = {p: {"examples": RECORDS_PER_SHARD * sum(n.startswith(p + "-") for n in bodies)}
              for p in ("train", "validation")}
    yield "counts.json", json.dumps({"shards": counts, "splits": splits}, indent=1).encode()


# --- the server ----------------------------------------------------------------

class Server:
    """moto's S3 server on a loopback port in this process; buckets filled through its backend."""

    def __init__(self, listing: str, index_above: int):
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import FakeKey, S3Backend, get_canned_acl, s3_backends
        from moto.s3.responses import S3Response
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)   # one log line per request otherwise

        class SharedBodyKey(FakeKey):
            """A FakeKey whose body is a bytes object shared with every key of the same body, not a
            SpooledTemporaryFile of its own; its etag given, not hashed from the buffer."""
            __module__ = "moto.s3.models"   # moto's model registry files classes under their service

            @property
            def value(self) -> bytes:
                return self._shared

            @value.setter
            def value(self, new: bytes) -> None:
                self._shared, self.contentsize = new, len(new)

        self.SharedBodyKey, self.account = SharedBodyKey, DEFAULT_ACCOUNT_ID
        self.backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        self.bucket_accounts = s3_backends.bucket_accounts
        self.acl = get_canned_acl("private")
        self.listing, self.index_above = listing, index_above
        self.counts = {"list": 0, "head": 0, "get": 0}
        self._index: dict[str, tuple[int, list[str]]] = {}
        stock_list = S3Backend.list_objects_v2
        self.stock_list = stock_list
        server = self

        def list_objects_v2(backend, bucket, prefix, delimiter, continuation_token, start_after, max_keys):
            if server.indexed(bucket):
                return server.indexed_list(backend, bucket, prefix, delimiter, continuation_token, start_after,
                                           max_keys)
            return stock_list(backend, bucket, prefix, delimiter, continuation_token, start_after, max_keys)

        def counted(name, method):   # HTTP requests, counted where moto answers them (its backend calls
            def call(*args, **kwargs):   # get_object more than once per GET request)
                server.counts[name] += 1
                return method(*args, **kwargs)
            return call
        S3Backend.list_objects_v2 = list_objects_v2
        S3Response.list_objects_v2 = counted("list", S3Response.list_objects_v2)
        S3Response.head_object = counted("head", S3Response.head_object)
        S3Response.get_object = counted("get", S3Response.get_object)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def env(self) -> dict:
        """What a user sets to point boto3/s3fs at an S3-compatible store (docs/data.md), and nothing of theirs."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_S3"))}
        return {**env, "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": REGION,
                "AWS_ACCESS_KEY_ID": "benchmark", "AWS_SECRET_ACCESS_KEY": "benchmark",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def fill(self, bucket_name: str, objects) -> int:
        """Makes `bucket_name` holding `objects` ((key, body) pairs); the number of objects."""
        bucket = self.backend.create_bucket(bucket_name, REGION)
        etags: dict[int, str] = {}
        n = 0
        for key, body in objects:
            etag = etags.get(id(body))
            if etag is None:
                etag = etags[id(body)] = hashlib.md5(body).hexdigest()
            k = self.SharedBodyKey(key, body, self.account, REGION, etag=etag, bucket_name=bucket_name)
            k._value_buffer.close()
            k._value_buffer, k.acl = None, self.acl
            bucket.keys[key] = k
            n += 1
        return n

    def drop(self, bucket_name: str) -> None:
        """Forgets the bucket and its keys (moto keeps every model instance in `instances_tracked` too)."""
        import gc
        self.backend.buckets.pop(bucket_name, None)
        self.bucket_accounts.pop(bucket_name, None)
        self._index.pop(bucket_name, None)
        self.SharedBodyKey.instances_tracked.clear()
        gc.collect()

    # --- ListObjectsV2 from a sorted index of the key names ------------------

    def indexed(self, bucket) -> bool:
        return self.listing == "indexed" or (self.listing == "auto" and len(bucket.keys) > self.index_above)

    def names(self, bucket) -> list[str]:
        count, names = self._index.get(bucket.name, (-1, []))
        if count != len(bucket.keys):
            names = sorted(dict.keys(bucket.keys))
            self._index[bucket.name] = (len(names), names)
        return names

    def indexed_list(self, backend, bucket, prefix, delimiter, continuation_token, start_after, max_keys):
        """moto's `list_objects_v2` answer (same items, truncation and token), from the sorted key names."""
        from moto.s3.models import FakeDeleteMarker, md5_hash

        names, prefix = self.names(bucket), prefix or ""
        i = bisect.bisect_left(names, prefix)
        after = backend._pagination_tokens.get(continuation_token) if continuation_token else start_after
        if after:
            i = max(i, bisect.bisect_right(names, after))
            if delimiter and after.endswith(delimiter) and after.startswith(prefix):   # a common prefix: past it
                i = max(i, bisect.bisect_left(names, _successor(after)))
        items: list = []
        while i < len(names) and names[i].startswith(prefix) and len(items) <= max_keys:
            name = names[i]
            cut = name.find(delimiter, len(prefix)) if delimiter else -1
            if cut >= 0:
                folder = name[:cut + len(delimiter)]
                items.append(folder)
                i = bisect.bisect_left(names, _successor(folder), i)
                continue
            key = bucket.keys[name]
            if not isinstance(key, FakeDeleteMarker):
                items.append(key)
            i += 1
        if max_keys == 0:
            return [], False, None
        if len(items) <= max_keys:
            return items, False, None
        items = items[:max_keys]
        last = items[-1] if isinstance(items[-1], str) else items[-1].name
        token = md5_hash(last.encode("utf-8")).hexdigest()
        backend._pagination_tokens[token] = last
        return items, True, token

    def check_indexed(self, bucket_name: str, prefixes: list[str], pages: int = 4) -> int:
        """Pages compared: the index's answers equal moto's own for `prefixes`, with and without a delimiter,
        paged through at 1,000 and at 7 keys a page."""
        bucket = self.backend.buckets[bucket_name]
        compared = 0
        for prefix in prefixes:
            for delimiter in ("/", None):
                for max_keys in (1000, 7):
                    token = None
                    for _ in range(pages):
                        a = self.stock_list(self.backend, bucket, prefix, delimiter, token, None, max_keys)
                        b = self.indexed_list(self.backend, bucket, prefix, delimiter, token, None, max_keys)
                        names = lambda r: [x if isinstance(x, str) else x.name for x in r[0]]  # noqa: E731
                        if names(a) != names(b) or a[1:] != b[1:]:
                            raise AssertionError(f"indexed listing differs from moto's at {prefix!r} "
                                                 f"{delimiter!r} {max_keys} {token}: {names(a)[:3]} {names(b)[:3]}")
                        compared += 1
                        token = a[2]
                        if not token:
                            break
        return compared

    def stock_page_seconds(self, bucket_name: str, prefix: str, delimiter: str | None = "/") -> float:
        """Seconds moto's own listing takes for the first page of `prefix` in the bucket as it is now."""
        bucket = self.backend.buckets[bucket_name]
        start = time.perf_counter()
        self.stock_list(self.backend, bucket, prefix, delimiter, None, None, 1000)
        return time.perf_counter() - start

    def stop(self) -> None:
        self.server.stop()


def _successor(prefix: str) -> str:
    """The least string greater than every string that starts with `prefix`."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


# --- the measurements -----------------------------------------------------------

LISTER = r"""
import json, os, sys, time
import tensorflow  # imported by the listing (a shard's first record is parsed) and by tfdp train anyway: not timed
from tfdp.config import DataConfig
from tfdp.data import build_source
def peak_mb():   # VmHWM: this process image's own peak (ru_maxrss would include the 5 GB server it forked from)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
cfg = DataConfig(format=sys.argv[1], dir=sys.argv[2], cache_dir=sys.argv[3])
start = time.perf_counter()
source = build_source(cfg)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "classes": source.num_classes,
                  "train": source.split(cfg.train_split).num_examples, "val": source.split(cfg.val_split).num_examples,
                  "train_files": len(source.split(cfg.train_split).files),
                  "peak_mb": peak_mb()}))
"""


def listing(server: Server, fmt: str, url: str, work: str, timeout: float) -> dict:
    cache = tempfile.mkdtemp(prefix="cache-", dir=work)
    before = dict(server.counts)
    try:
        out = subprocess.run([sys.executable, "-c", LISTER, fmt, url, cache], capture_output=True, text=True,
                             env={**server.env(), "TF_CPP_MIN_LOG_LEVEL": "2"}, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout, "requests": _delta(server.counts, before)}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if out.returncode:
        raise RuntimeError(f"listing {url} failed:\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "requests": _delta(server.counts, before),
            "load": round(os.getloadavg()[0], 2)}


def first_step(server: Server, fmt: str, url: str, work: str, cache_limit: str, warm: bool = False) -> dict:
    """`tfdp train` to its first step with a fresh model_dir and an empty data.cache_dir; `warm`: with the
    data.cache_dir the last run left (the validation split's copies, which evaluation keeps)."""
    model_dir, cache = os.path.join(work, "run"), os.path.join(work, "cache")
    shutil.rmtree(model_dir, ignore_errors=True)
    if not warm:
        shutil.rmtree(cache, ignore_errors=True)
    before = dict(server.counts)
    command = [*startup.TFDP, "train", f"--data_dir={url}", f"--model_dir={model_dir}", f"--set=data.format={fmt}",
               f"--set=data.cache_dir={cache}", f"--set=data.cache_limit={cache_limit}",
               "--set=model.name=simple_cnn", f"--set=model.num_classes={CLASSES}", "--set=data.image_size=32",
               f"--set=train.batch_size_per_replica={GLOBAL_BATCH}", "--set=train.epochs=1",
               "--set=log.tensorboard=false"]
    seconds, peak, text = startup.until(command, startup.FIRST_STEP, env=server.env())
    data_line = next((line.strip() for line in text.splitlines() if line.startswith("tfdp: data:")), "")
    return {"seconds": seconds, "peak_mb": peak / 2**20, "requests": _delta(server.counts, before),
            "data_line": data_line, "load": round(os.getloadavg()[0], 2)}


def _delta(now: dict, before: dict) -> dict:
    return {k: now[k] - before.get(k, 0) for k in now}


def machine() -> str:
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2**20
    date = subprocess.run(["date", "+%Y-%m-%d %H:%M %Z"], capture_output=True, text=True).stdout.strip()
    return f"{date}, {os.cpu_count()} cores ({model}), {mem:.0f} GiB, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1/16,full")
    parser.add_argument("--layouts", default="tfrecord,raw")
    parser.add_argument("--root", default="/tmp/cloud-scale")
    parser.add_argument("--moto_listing", choices=("auto", "stock", "indexed"), default="auto")
    parser.add_argument("--index_above", type=int, default=200_000,
                        help="auto: buckets with more objects are listed from the index")
    parser.add_argument("--cache_limit", default="256KB", help="data.cache_limit of the training run")
    parser.add_argument("--listing_timeout", type=float, default=1800)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to the first step before giving up")
    parser.add_argument("--skip", default="", help="comma list of listing,train to leave out")
    args = parser.parse_args()
    startup.TIMEOUT = args.timeout
    skip = set(filter(None, args.skip.split(",")))
    for key in [k for k in os.environ if k.startswith(("AWS_", "FSSPEC_S3"))]:   # the user's own store: not here
        del os.environ[key]
    os.makedirs(args.root, exist_ok=True)
    head = machine()
    print(f"# {head}", flush=True)
    images = jpegs()
    print(f"# {len(images)} distinct JPEGs of {min(map(len, images))}-{max(map(len, images))} bytes", flush=True)
    server = Server(args.moto_listing, args.index_above)
    print(f"# moto S3 server at {server.endpoint}", flush=True)
    rows = []
    try:
        for layout in args.layouts.split(","):
            for size in args.sizes.split(","):
                divisor = SIZES[size]
                bucket = f"imagenet-{layout}-{'full' if divisor == 1 else f'div{divisor}'}"
                start = time.perf_counter()
                objects = (raw_objects(divisor, images) if layout == "raw"
                           else tfrecord_objects(args.root, divisor, images))
                count = server.fill(bucket, objects)
                filled = time.perf_counter() - start
                fmt = "imagenet" if layout == "raw" else "tfrecord"
                url = f"s3://{bucket}"
                probe = (f"train/{wnid(CLASSES // 2)}/" if layout == "raw" else "")
                page = server.stock_page_seconds(bucket, probe)
                # the listing of the training share's sizes (streaming._sizes: fs.find, no delimiter)
                find_page = server.stock_page_seconds(bucket, "train/" if layout == "raw" else "", None)
                indexed = server.indexed(server.backend.buckets[bucket])
                checked = (server.check_indexed(bucket, [probe, "train/", "val/", "", "train-", "ILSVRC"])
                           if divisor > 1 else server.check_indexed(bucket, [probe, "val/"], pages=2) if indexed else 0)
                print(f"{layout} {size}: {count:,} objects in {filled:.0f} s; moto's own ListObjectsV2 page of "
                      f"{probe or '/'}: {page:.3f} s, of {'train/' if layout == 'raw' else '/'} without a delimiter: "
                      f"{find_page:.3f} s; listing {'indexed' if indexed else 'stock'}"
                      + (f" ({checked} pages checked equal to moto's)" if checked else ""), flush=True)
                work = os.path.join(args.root, f"work-{bucket}")
                os.makedirs(work, exist_ok=True)
                row = {"layout": layout, "size": size, "objects": count, "listing_mode": "indexed" if indexed
                       else "stock", "stock_page_s": page, "stock_find_page_s": find_page}
                if "listing" not in skip:
                    row["listing"] = listing(server, fmt, url, work, args.listing_timeout)
                    print(f"  listing: {json.dumps(row['listing'])}", flush=True)
                if "train" not in skip:
                    row["train"] = first_step(server, fmt, url, work, args.cache_limit)
                    print(f"  first step: {json.dumps(row['train'])}", flush=True)
                    row["warm"] = first_step(server, fmt, url, work, args.cache_limit, warm=True)
                    print(f"  first step, cache kept: {json.dumps(row['warm'])}", flush=True)
                    shutil.rmtree(os.path.join(work, "cache"), ignore_errors=True)
                rows.append(row)
                with open(os.path.join(args.root, "results.json"), "w") as f:
                    json.dump({"machine": head, "rows": rows}, f, indent=1)
                server.drop(bucket)
    finally:
        server.stop()
    print(f"\n{head}")
    print(f"{'layout':9s} {'size':5s} {'objects':>10s} {'listing s':>10s} {'first step s':>13s} {'peak MB':>8s}"
          f" {'warm s':>7s} {'warm MB':>8s} {'server listing':>15s}  requests to first step (list/head/get)")
    for r in rows:
        lst, tr, wm = r.get("listing", {}), r.get("train", {}), r.get("warm", {})
        ls = f"{lst['seconds']:.1f}" if "seconds" in lst else (f">{lst['timeout']:.0f}" if lst else "-")
        fs, pk = (f"{tr['seconds']:.1f}", f"{tr['peak_mb']:.0f}") if tr else ("-", "-")
        ws, wk = (f"{wm['seconds']:.1f}", f"{wm['peak_mb']:.0f}") if wm else ("-", "-")
        req = "/".join(str(tr["requests"][k]) for k in ("list", "head", "get")) if tr else "-"
        print(f"{r['layout']:9s} {r['size']:5s} {r['objects']:>10,} {ls:>10s} {fs:>13s} {pk:>8s} {ws:>7s} {wk:>8s} "
              f"{r['listing_mode']:>15s}  {req}")


if __name__ == "__main__":
    main()
