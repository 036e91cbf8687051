"""A real GCS server on loopback (PyPI `gcp-storage-emulator`) for tests, benchmarks and local trials.

gcsfs finds it through STORAGE_EMULATOR_HOST; its experimental bucket-type
lookup over gRPC would hang against an emulator, so it is switched off. Both
variables are restored when the server stops.
"""

from __future__ import annotations

import contextlib
import os
import sys

from support.servers import server_process

ENV_KEYS = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


@contextlib.contextmanager
def gcs_emulator(bucket: str = "tfdp", startup_seconds: float = 30):
    """Starts the emulator with `bucket` on a free port; yields gs://bucket."""
    command = [os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator"), "start", "--host=127.0.0.1",
               "--port={port}", "--in-memory", f"--default-bucket={bucket}", "-q"]
    with server_process(command, "the GCS emulator", startup_seconds, ENV_KEYS) as port:
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        yield f"gs://{bucket}"
