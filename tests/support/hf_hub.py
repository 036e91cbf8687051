"""A Hugging Face Hub on loopback, for the real `huggingface_hub` client: the file protocol its `hf_hub_download`
speaks (HEAD, then GET, on `/ORG/NAME/resolve/REVISION/FILE`, `/datasets/ORG/NAME/resolve/...` for a dataset, with
byte ranges), and the JSON API its `HfFileSystem` (`hf://` URLs) lists repositories with: a repository's revision
(`/api/{models,datasets}/ORG/NAME/revision/REV`), a folder's tree (`.../tree/REV/PATH`, paged as the Hub pages, with
a `Link` header) and paths' info (`POST .../paths-info/REV`), over repositories that are folders of real files.

What the Hub answers is what this server answers: a file's commit in `X-Repo-Commit`, its sha256 as the ETag (the
name of the cache's blob), and the Hub's error codes in `X-Error-Code` (`RepoNotFound` with 401, `GatedRepo` with
401 without the repository's token, `RevisionNotFound` and `EntryNotFound` with 404), which huggingface_hub turns
into its own exceptions. Not served: Xet transfers, redirects to a CDN, the rest of the API. Every request is
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

    def answer(self, method: str, path: str, authorization: str | None, form: dict | None = None,
               byte_range: str | None = None) -> tuple[int, dict[str, str], bytes]:
        self.requests.append((method, path))
        url = urllib.parse.urlsplit(path)
        parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
        if parts[0] == "api" and len(parts) in (4, 6) or len(parts) > 6 and parts[1] in ("models", "datasets"):
            repo = "/".join(parts[2:4]) if parts[1] == "models" else "datasets/" + "/".join(parts[2:4])
            # /api/TYPE/ORG/NAME is the repository at main, as /api/TYPE/ORG/NAME/revision/main
            action, revision, rest = (parts[4], parts[5], "/".join(parts[6:])) if len(parts) > 4 else ("revision",
                                                                                                        "main", "")
            return self._api(repo, action, revision, rest, authorization, form or {},
                             urllib.parse.parse_qs(url.query))
        width = 3 if parts[0] == "datasets" else 2   # a dataset's id: datasets/ORG/NAME
        if len(parts) < width + 3 or parts[width] != "resolve":
            return 404, {}, b"not a resolve URL"
        repo, revision, name = "/".join(parts[:width]), parts[width + 1], "/".join(parts[width + 2:])
        found = self._version(repo, revision, authorization)
        if isinstance(found[0], int):
            return found
        commit, files = found
        if name not in files:
            return 404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found",
                         "X-Repo-Commit": commit}, b""
        body = files[name]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                   "Content-Length": str(len(body)), "Content-Type": "application/octet-stream",
                   "Accept-Ranges": "bytes"}
        if byte_range and method == "GET":   # bytes=START-END (inclusive), as fsspec's reads ask
            start, _, end = byte_range.removeprefix("bytes=").partition("-")
            first, last = int(start), min(int(end) if end else len(body) - 1, len(body) - 1)
            part = body[first:last + 1]
            return 206, {**headers, "Content-Length": str(len(part)),
                         "Content-Range": f"bytes {first}-{last}/{len(body)}"}, part
        return 200, headers, body

    def _version(self, repo: str, revision: str, authorization: str | None):
        """(commit, files) of `repo` at `revision`, or the Hub's error answer for it."""
        if repo not in self.repos:
            return 401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b""
        if repo in self.gated and authorization != f"Bearer {self.gated[repo]}":
            return 401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this repository is restricted"}, b""
        versions = self.repos[repo]
        found = versions[-1] if revision == "main" else next((v for v in versions if v[0] == revision), None)
        if found is None:
            return 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}, b""
        return found

    def _api(self, repo, action, revision, rest, authorization, form, query) -> tuple[int, dict[str, str], bytes]:
        found = self._version(repo, revision, authorization)
        if isinstance(found[0], int):
            return found
        commit, files = found
        if action == "revision":
            return self._json({"id": repo.removeprefix("datasets/"), "sha": commit, "private": False,
                               "siblings": [{"rfilename": name} for name in sorted(files)]})
        if action == "paths-info":
            wanted = form.get("paths", [])
            return self._json([e for e in self._entries(files, "", recursive=True, commit=commit)
                               if e["path"] in wanted] + [self._folder(p, commit) for p in wanted
                                                           if p not in files and self._is_folder(files, p)])
        if action == "tree":
            if rest and not self._is_folder(files, rest):
                return 404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": f"{rest} does not exist"}, b""
            entries = self._entries(files, rest, recursive=query.get("recursive", ["False"])[0].lower() == "true",
                                    commit=commit)
            start = int(query.get("cursor", ["0"])[0])
            page, headers = entries[start:start + self.page_size], {}
            if start + self.page_size < len(entries):
                base = f"{self.endpoint}/api/{'datasets' if repo.startswith('datasets/') else 'models'}/" \
                       f"{repo.removeprefix('datasets/')}/tree/{revision}/{urllib.parse.quote(rest, safe='')}"
                params = urllib.parse.urlencode({**{k: v[0] for k, v in query.items()},
                                                 "cursor": start + self.page_size})
                headers["Link"] = f'<{base}?{params}>; rel="next"'
            return self._json(page, headers)
        return 404, {}, b"not served here"

    page_size = 1000   # the Hub's page of a tree listing

    @staticmethod
    def _is_folder(files: dict, path: str) -> bool:
        return any(name.startswith(path.rstrip("/") + "/") for name in files)

    @staticmethod
    def _folder(path: str, commit: str) -> dict:
        return {"type": "directory", "oid": hashlib.sha1((commit + path).encode()).hexdigest(), "path": path}

    def _entries(self, files: dict, folder: str, recursive: bool, commit: str) -> list[dict]:
        """A folder's tree entries as the Hub lists them: its files and sub-folders (all below it when recursive)."""
        prefix = folder.rstrip("/") + "/" if folder else ""
        entries, folders = [], set()
        for name in sorted(files):
            if not name.startswith(prefix):
                continue
            below = name[len(prefix):].split("/")
            for depth in range(1, len(below) if recursive else min(len(below), 2)):
                folders.add(prefix + "/".join(below[:depth]))
            if recursive or len(below) == 1:
                entries.append({"type": "file", "oid": hashlib.sha1(files[name]).hexdigest(), "size": len(files[name]),
                                "path": name})
        return sorted(entries + [self._folder(f, commit) for f in folders], key=lambda e: e["path"])

    @staticmethod
    def _json(value, headers: dict | None = None) -> tuple[int, dict[str, str], bytes]:
        import json
        return 200, {"Content-Type": "application/json", **(headers or {})}, json.dumps(value).encode()

    def gets(self, name: str) -> int:
        """How many times a file of this name was downloaded."""
        return sum(1 for method, path in self.requests if method == "GET" and path.endswith("/" + name))


@contextlib.contextmanager
def hub_server():
    """A `Hub` serving on 127.0.0.1 (its `endpoint` is what HF_ENDPOINT takes) until the block ends."""
    hub = Hub()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, with_body: bool, form: dict | None = None):
            status, headers, body = hub.answer(self.command, self.path, self.headers.get("Authorization"), form,
                                               self.headers.get("Range"))
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

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            form = urllib.parse.parse_qs(self.rfile.read(length).decode())
            self._reply(with_body=True, form=form)

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
