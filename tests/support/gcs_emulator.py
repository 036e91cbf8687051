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

# The emulator's CLI, with a listen backlog of 1,024 in place of http.server's 5. The emulator answers one connection
# at a time, and gcsfs opens one per file of a batch (`put` of a tree, `cat` of a list): past 5 waiting, the kernel
# drops the connection's SYN and the client's TCP resends it a second later. A 120-file `put` took 111 s so, and
# takes 0.5 s with the deeper queue; what the emulator answers is unchanged.
WITH_A_DEEP_BACKLOG = ("import http.server, sys; http.server.HTTPServer.request_queue_size = 1024; "
                       "from gcp_storage_emulator.__main__ import main; sys.exit(main())")


@contextlib.contextmanager
def gcs_emulator(bucket: str = "tfdp", startup_seconds: float = 30):
    """Starts the emulator with `bucket` on a free port; yields gs://bucket."""
    command = [sys.executable, "-c", WITH_A_DEEP_BACKLOG, "start", "--host=127.0.0.1",
               "--port={port}", "--in-memory", f"--default-bucket={bucket}", "-q"]
    with server_process(command, "the GCS emulator", startup_seconds, ENV_KEYS) as port:
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        yield f"gs://{bucket}"
