"""What the loopback servers of the tests (GCS emulator, S3) share: starting a process on a free port and
waiting for it, with environment variables set while it runs and restored after."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time

from tfdp.distribute.cluster import free_ports


@contextlib.contextmanager
def server_process(command: list[str], name: str, startup_seconds: float, env_keys: tuple[str, ...]):
    """Starts `command` (formatted with {port}) on a free loopback port; yields the port once it accepts.

    The variables in `env_keys` are saved first and restored when the server
    stops, whatever the caller set meanwhile.
    """
    port = free_ports(1)[0]
    server = subprocess.Popen([part.format(port=port) for part in command],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in env_keys}
    try:
        _wait_for_port(server, port, startup_seconds, name)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wait_for_port(server: subprocess.Popen, port: int, seconds: float, name: str) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"{name} did not start") from None
            time.sleep(0.2)
