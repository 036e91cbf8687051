"""A Hugging Face Hub on loopback, for the real `huggingface_hub` client: the file protocol its `hf_hub_download`
speaks (HEAD, then GET, on `/ORG/NAME/resolve/REVISION/FILE`), over repositories that are folders of real files.

What the Hub answers is what this server answers: a file's commit in `X-Repo-Commit`, its sha256 as the ETag (the
name of the cache's blob), and the Hub's error codes in `X-Error-Code` (`RepoNotFound` with 401, `GatedRepo` with
401 without the repository's token, `RevisionNotFound` and `EntryNotFound` with 404), which huggingface_hub turns
into its own exceptions. Not served: the JSON API (`/api/...`), Xet transfers, redirects to a CDN. Every request is
recorded, so a test can tell a download from a cache hit.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import threading
import urllib.parse


class Hub:
    def __init__(self):
        # repo → its versions, oldest first: (commit, files)
        self.repos: dict[str, list[tuple[str, dict[str, bytes]]]] = {}
        self.gated: dict[str, str] = {}   # repo → the token that reads it
        self.requests: list[tuple[str, str]] = []   # (method, path)
        self.endpoint = ""

    def publish(self, repo: str, files: dict[str, bytes]) -> str:
        """A new commit of `repo` holding `files` (name → bytes), its main branch moved to it; the commit's hash."""
        digest = hashlib.sha1(repo.encode())
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        commit = hashlib.sha1(digest.digest() + str(len(self.repos.get(repo, []))).encode()).hexdigest()
        self.repos.setdefault(repo, []).append((commit, dict(files)))
        return commit

    def publish_folder(self, repo: str, folder: str, **extra: bytes) -> str:
        files = {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}
        return self.publish(repo, {**files, **extra})

    def answer(self, method: str, path: str, authorization: str | None) -> tuple[int, dict[str, str], bytes]:
        self.requests.append((method, path))
        parts = [urllib.parse.unquote(p) for p in path.split("?")[0].strip("/").split("/")]
        if len(parts) < 5 or parts[2] != "resolve":
            return 404, {}, b"not a resolve URL"
        repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        if repo not in self.repos:
            return 401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b""
        if repo in self.gated and authorization != f"Bearer {self.gated[repo]}":
            return 401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is restricted"}, b""
        versions = self.repos[repo]
        found = versions[-1] if revision == "main" else next((v for v in versions if v[0] == revision), None)
        if found is None:
            return 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}, b""
        commit, files = found
        if name not in files:
            return 404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found",
                         "X-Repo-Commit": commit}, b""
        body = files[name]
        return 200, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                     "Content-Length": str(len(body)), "Content-Type": "application/octet-stream"}, body

    def gets(self, name: str) -> int:
        """How many times a file of this name was downloaded."""
        return sum(1 for method, path in self.requests if method == "GET" and path.endswith("/" + name))


@contextlib.contextmanager
def hub_server():
    """A `Hub` serving on 127.0.0.1 (its `endpoint` is what HF_ENDPOINT takes) until the block ends."""
    hub = Hub()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, with_body: bool):
            status, headers, body = hub.answer(self.command, self.path, self.headers.get("Authorization"))
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_HEAD(self):
            self._reply(with_body=False)

        def do_GET(self):
            self._reply(with_body=True)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
