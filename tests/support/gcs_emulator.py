"""A real GCS server on loopback (PyPI `gcp-storage-emulator`) for tests, benchmarks and local trials.

gcsfs finds it through STORAGE_EMULATOR_HOST; its experimental bucket-type
lookup over gRPC would hang against an emulator, so it is switched off. Both
variables are restored when the server stops.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

from tfdp.cluster import free_ports

ENV_KEYS = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


@contextlib.contextmanager
def gcs_emulator(bucket: str = "tfdp", startup_seconds: float = 30):
    """Starts the emulator with `bucket` on a free port; yields gs://bucket."""
    port = free_ports(1)[0]
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator"), "start", "--host=127.0.0.1",
         f"--port={port}", "--in-memory", f"--default-bucket={bucket}", "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    try:
        _wait_for_port(server, port, startup_seconds)
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        yield f"gs://{bucket}"
    finally:
        server.terminate()
        server.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wait_for_port(server: subprocess.Popen, port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the GCS emulator did not start") from None
            time.sleep(0.2)
