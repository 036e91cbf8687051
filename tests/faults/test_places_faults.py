"""Faults at the edges of tfdp (issue #14): an unreachable bucket, a launch whose
worker dies, start-up cost of commands that need no TensorFlow. Every case is a
real process (and, where one is needed, a real server on loopback)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from conftest import last_line, run_tfdp
from tfdp.cluster import free_ports


def assert_one_line_error(result, exit_code: int, *fragments: str) -> str:
    """The run ended with `exit_code`, no traceback, and its last line names every fragment."""
    output = result.stdout + result.stderr
    assert result.returncode == exit_code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    line = last_line(result.stderr)
    assert line.startswith("tfdp: error: "), output[-3000:]
    for fragment in fragments:
        assert fragment in line, line
    return line


# --- a bucket that cannot be reached --------------------------------------------------------

@contextlib.contextmanager
def silent_server():
    """A loopback server that accepts connections and never answers: a hung endpoint."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted, stop = [], threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(server.accept()[0])
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def train_from_bucket(endpoint: str, timeout_s: float):
    """`tfdp train` on gs://nobody/data with gcsfs pointed at `endpoint`; (result, seconds)."""
    start = time.monotonic()
    result = run_tfdp("train", "--data_format=image_folder", "--data_dir=gs://nobody/data",
                      "--model_dir=/tmp/tfdp-never-written", f"--set=data.remote_timeout={timeout_s}",
                      timeout=120, env_extra={"STORAGE_EMULATOR_HOST": endpoint})
    return result, time.monotonic() - start


def test_bucket_endpoint_that_never_answers_is_one_line_within_the_timeout():
    with silent_server() as port:
        result, seconds = train_from_bucket(f"http://127.0.0.1:{port}", 3)
    endpoint = f"http://127.0.0.1:{port}"
    assert_one_line_error(result, 2, endpoint, "did not answer within 3 s", "data.remote_timeout",
                          "gs://nobody/data")
    assert 3 <= seconds < 3 + 20, seconds  # the timeout, plus interpreter start-up; gcsfs alone took ~40 s


def test_bucket_endpoint_that_refuses_is_one_line_at_once():
    port = free_ports(1)[0]  # nothing listens there
    result, seconds = train_from_bucket(f"http://127.0.0.1:{port}", 30)
    assert_one_line_error(result, 2, f"http://127.0.0.1:{port}", "refused", "gs://nobody/data")
    assert seconds < 20, seconds  # long before the 30 s timeout: a refusal needs no waiting
