"""A local stand-in for the Hugging Face hub on 127.0.0.1: answers what `huggingface_hub` asks of
`{endpoint}/{org}/{name}/resolve/{revision}/{filename}` (HEAD with `X-Repo-Commit`, `ETag` and
`Content-Length`; GET with `Range` support), refuses repositories with a chosen status, and counts
the bytes of every file it serves. Also the local cache layout `huggingface_hub` writes, and
`metrale` run in a fresh interpreter against either."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Hub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # repo -> the HTTP status every request for it gets (401, 403, ...).
    refuse: dict[str, int] = field(default_factory=dict)
    # (repo, filename) -> bytes of file content sent.
    served: Counter[tuple[str, str]] = field(default_factory=Counter)
    endpoint: str = ""

    def add(self, repo: str, directory: Path) -> None:
        self.repos[repo] = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, body: bool) -> None:
            m = _RESOLVE.match(self.path.split("?", 1)[0])
            if m is None:
                self.send_error(404)
                return
            repo, rev, name = m.group("repo"), m.group("rev"), m.group("file")
            if repo in hub.refuse:
                self.send_response(hub.refuse[repo])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            files = hub.repos.get(repo)
            if files is None or rev not in ("main", COMMIT) or name not in files:
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound" if files is None
                                 else "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = files[name]
            start, end = 0, len(data)
            ranged = _RANGE.match(self.headers.get("Range", ""))
            if ranged:
                start = int(ranged.group(1))
                end = int(ranged.group(2)) + 1 if ranged.group(2) else len(data)
                end = min(end, len(data))
            self.send_response(206 if ranged else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(end - start))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if body:
                self.wfile.write(data[start:end])
                hub.served[(repo, name)] += end - start

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

    return Handler


@contextmanager
def serve(hub: Hub) -> Iterator[Hub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def cache_repo(cache: Path, repo: str, directory: Path, ref: str = "main") -> Path:
    """Put `directory`'s files into a hub cache as `huggingface_hub` lays it out: content in
    `blobs/<sha256>`, `snapshots/<commit>/<file>` symlinks to them, `refs/<ref>` naming the
    commit. Returns the snapshot directory."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(COMMIT)
    for path in directory.iterdir():
        data = path.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


def run_metrale(hub: Hub | str, cache: Path, *args: object,
                **env: str) -> subprocess.CompletedProcess:
    """`metrale ARGS` in a fresh interpreter whose hub is `hub` (or an endpoint URL)."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("HF_", "METRALE_ONLINE"))}
    environ |= {"HF_HUB_CACHE": str(cache), "HF_TOKEN": "hf_test",
                "HF_ENDPOINT": hub if isinstance(hub, str) else hub.endpoint, **env}
    return subprocess.run([sys.executable, "-m", "metrale_cli", *map(str, args)],
                          capture_output=True, text=True, env=environ, timeout=300)
