"""An HTTP proxy on loopback in front of a real object store that holds back the requests a test names.

A client pointed at it (AWS_ENDPOINT_URL) talks to the server behind it as
before: each request is forwarded with its own headers, Host included, so the
server checks the client's signature as if it had been sent straight to it.
A request `hold(method, path)` picks is answered never: the proxy notes it
(`held` is set) and keeps the connection open, so the client process stays
at exactly that point until the test has done what it wanted there (kill -9
it between a checkpoint's objects and its marker, say).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import threading
import urllib.parse
from typing import Callable, Iterator

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class HoldingProxy:
    """The proxy's address and what it held: `url` to point clients at, `held` set at the first hold,
    `held_paths` every request path it held."""

    def __init__(self, upstream: str, hold: Callable[[str, str], bool]):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.hold, self.held, self.held_paths = hold, threading.Event(), []
        self._release = threading.Event()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _handler(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                body = self._body()
                if proxy.hold(self.command, urllib.parse.urlsplit(self.path).path):
                    proxy.held_paths.append(self.path)
                    proxy.held.set()
                    proxy._release.wait()   # never answered: the client waits here until it is killed
                    self.close_connection = True
                    return
                upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=120)
                upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for key, value in self.headers.items():
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        upstream.putheader(key, value)
                upstream.putheader("Content-Length", str(len(body)))
                upstream.endheaders(body)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response_only(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", answer.getheader("Content-Length", str(len(data)))
                                 if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while (size := int(self.rfile.readline().split(b";")[0], 16)):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):   # trailers
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def holding_proxy(upstream: str, hold: Callable[[str, str], bool]) -> Iterator[HoldingProxy]:
    """A `HoldingProxy` in front of `upstream` (http://host:port), serving on a thread of this process."""
    proxy = HoldingProxy(upstream, hold)
    thread = threading.Thread(target=proxy._server.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.close()
        thread.join(timeout=10)
