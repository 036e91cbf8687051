"""Training from a bucket against training from local disk: time to the first step and steady-state images/s.

One run, side by side, each variant a `tfdp train` process of its own, one at a time, on the same
images: ImageNet-sized JPEGs (500 x 375, quality 90) cut from the real photos in the scikit-image and
scikit-learn wheels, in an image_folder tree, on local disk and in a bucket of a real S3 server on
loopback (moto's, its own process; tfdp talks HTTP to it as to any S3 endpoint).

  local            data on local disk, model_dir on local disk
  bucket, whole    data in the bucket, data.cache_limit above its size: the share is copied whole into
                   a fresh data.cache_dir before the first step, read from disk afterwards
  bucket, streamed data in the bucket, data.cache_limit a quarter of its size: streamed through the bounded
                   cache (downloaded ahead of the reader, deleted after)
  bucket + run     the same, and model_dir in the bucket too (checkpoints uploaded with their markers,
                   logs as they grow)

The first step is seen from outside, as benchmarks/startup.py sees it (Keras' progress bar on a
pseudo-terminal); images/s is the run's own summary line (the mean over the epochs after the first);
"server CPU s" is what the S3 server process used during the whole run, on the same 2 cores.
A loopback server is faster than a real bucket (no network latency, no bandwidth limit): these figures
show what tfdp itself costs, not what a cloud store delivers.

  python benchmarks/cloud_input.py [--root=/tmp/cloud-input] [--images=1600] [--epochs=3]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import startup  # noqa: E402  (benchmarks/startup.py: the pseudo-terminal clock)

CLASSES = 16
DONE = re.compile(r"tfdp: done: .*?, ([\d.]+) s/epoch, (\d+) images/s")


def images(root: str, count: int) -> str:
    """root/tree/{train,val}/<class>/*.JPEG, written once: `count` training images, a tenth as many to validate."""
    import numpy as np
    from support.photos import photo_jpeg, real_photos

    out = os.path.join(root, "tree")
    if os.path.exists(os.path.join(out, ".complete")):
        return out
    photos, rng = real_photos(), np.random.default_rng(0)
    for split, n in (("train", count), ("val", max(count // 10, CLASSES))):
        for i in range(n):
            folder = os.path.join(out, split, f"c{i % CLASSES:02d}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{i:06d}.JPEG"), "wb") as f:
                f.write(photo_jpeg(photos[i % len(photos)], rng, quality=90))
    open(os.path.join(out, ".complete"), "w").close()
    return out


def tree_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(folder, "train"))
               for f in files)


def server_cpu(port: str) -> float:
    """CPU seconds the S3 server process (moto's, serving `port`) has used so far."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if b"moto.server" in cmdline and port.encode() in cmdline:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return 0.0


def run(name: str, data: str, model_dir: str, cache: str, limit: str, epochs: int, env: dict, port: str) -> dict:
    """Runs one variant to its end; (first step s, peak MB, images/s, the server's CPU seconds in the whole run)."""
    def command(run_dir: str) -> list[str]:
        return [*startup.TFDP, "train", f"--data_dir={data}", f"--model_dir={run_dir}", f"--epochs={epochs}", *flags]
    flags = ["--set=data.format=image_folder", "--set=model.name=simple_cnn", f"--set=model.num_classes={CLASSES}",
               "--set=data.image_size=64", "--set=train.batch_size_per_replica=64", "--set=schedule.warmup_epochs=0",
               "--set=train.checkpoint_every_steps=0", f"--set=data.cache_dir={cache}",
               f"--set=data.cache_limit={limit}", f"--set=scratch_dir={cache}-scratch"]
    first, peak, _ = startup.until(command(model_dir), startup.FIRST_STEP, env=env)   # stopped at its first step
    before = server_cpu(port)
    end, _, text = startup.until(command(model_dir + "-full"), DONE.pattern, env=env)   # a whole run
    served = server_cpu(port) - before
    found = DONE.search(text)
    return {"name": name, "first": first, "peak": peak / 1e6, "images_per_sec": int(found.group(2)),
            "seconds_per_epoch": float(found.group(1)), "whole": end, "server_cpu": served}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="/tmp/cloud-input")
    parser.add_argument("--images", type=int, default=1600)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    import fsspec
    from support.s3_server import s3_server

    tree = images(args.root, args.images)
    size = tree_bytes(tree)
    rows = []
    with s3_server("tfdp-bench") as s3:
        fs, _ = fsspec.core.url_to_fs(s3.bucket)
        fs.put(tree, f"{s3.bucket}/tree", recursive=True)
        data = f"{s3.bucket}/tree"
        stamp = str(int(time.time()))
        work = os.path.join(args.root, "work-" + stamp)
        variants = [("local", tree, os.path.join(work, "local"), "10GB"),
                    ("bucket, whole", data, os.path.join(work, "whole"), "10GB"),
                    ("bucket, streamed", data, os.path.join(work, "streamed"), str(size // 4)),
                    ("bucket + run", data, f"{s3.bucket}/runs/{stamp}", str(size // 4))]
        for name, where, model_dir, limit in variants:
            cache = os.path.join(work, "cache-" + name.replace(" ", "").replace(",", "-").replace("+", "-"))
            rows.append(run(name, where, model_dir, cache, limit, args.epochs, s3.env, s3.endpoint.rsplit(":", 1)[1]))
            print(f"  {name}: done", flush=True)
    print(f"\n{platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{args.images} training images ({size / 1e6:.0f} MB), simple_cnn at 64 px, batch 64, "
          f"{args.epochs} epochs; streamed limit {size // 4 / 1e6:.0f} MB")
    local = rows[0]
    print(f"{'variant':<18} {'first step s':>12} {'peak MB':>8} {'images/s':>9} {'vs local':>9} "
          f"{'run s':>6} {'server CPU s':>13}")
    for r in rows:
        print(f"{r['name']:<18} {r['first']:>12.1f} {r['peak']:>8.0f} {r['images_per_sec']:>9} "
              f"{r['images_per_sec'] / local['images_per_sec']:>8.2f}x {r['whole']:>6.1f} {r['server_cpu']:>13.1f}")


if __name__ == "__main__":
    main()
