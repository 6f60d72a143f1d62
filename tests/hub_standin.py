"""A local stand-in for the Hugging Face Hub's file API, over real HTTP on loopback, for tests that
point ``HF_ENDPOINT`` at it (no test reaches the real Hub).

It serves folders as repositories and answers the endpoints huggingface_hub's ``snapshot_download``
and ``hf_hub_download`` call (huggingface_hub 2.4: ``hf_api.py`` ``repo_info`` / ``list_repo_tree``,
``file_download.py`` ``get_hf_file_metadata``): ``GET /api/{models|datasets}/{repo}/revision/{rev}``
(``id``, ``sha``, ``siblings``), ``GET /api/{type}s/{repo}/tree/{rev}[/path]`` (one page of
``{"type": "file", "path", "size", "oid"}``), ``HEAD`` and ``GET`` of ``[/datasets]/{repo}/resolve/{rev}/{file}``
with the headers the client checks (``X-Repo-Commit``, ``ETag``, ``Content-Length``). An unknown
repository is a 404 with ``X-Error-Code: RepoNotFound``, an unknown revision ``RevisionNotFound``.
Every request is counted by (method, endpoint, repository[, file]).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_API = re.compile(r"^/api/(?P<type>models|datasets)/(?P<repo>[^/]+/[^/]+)/(?P<what>revision|tree)/(?P<rest>.+)$")
_RESOLVE = re.compile(r"^/(?:(?P<type>datasets)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class HubStandIn:
    """``repos``: (``"model"`` or ``"dataset"``, ``"org/name"``) -> folder. Start with ``with``;
    ``url`` is its endpoint; ``counts`` a Counter of (method, endpoint, repo[, file]); ``requests``
    every (method, path) in order."""

    def __init__(self, repos: dict[tuple[str, str], Path]) -> None:
        self.repos = {key: Path(folder) for key, folder in repos.items()}
        self.counts: Counter = Counter()
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo_type: str, repo_id: str) -> dict[str, Path]:
        root = self.repos[(repo_type, repo_id)]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def commit(self, repo_type: str, repo_id: str) -> str:
        """The repository's one commit: 40 hex digits of its files' content."""
        h = hashlib.sha1(repo_id.encode())
        for name, path in self.files(repo_type, repo_id).items():
            h.update(name.encode() + b"\0" + path.read_bytes())
        return h.hexdigest()

    def _count(self, method: str, key: tuple) -> None:
        with self._lock:
            self.counts[(method, *key)] += 1

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._serve(body=True)

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def _send(self, code: int, data: bytes, headers: dict[str, str], body: bool) -> None:
                self.send_response(code)
                for k, v in {"Content-Length": str(len(data)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _error(self, code: str, message: str, body: bool) -> None:
                self._send(404, json.dumps({"error": message}).encode(),
                           {"Content-Type": "application/json", "X-Error-Code": code}, body)

            def _serve(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                with hub._lock:
                    hub.requests.append((self.command, path))
                api, resolve = _API.match(path), _RESOLVE.match(path)
                if api is None and resolve is None:
                    hub._count(self.command, ("unknown", path))
                    return self._error("EntryNotFound", f"no such endpoint {path}", body)
                m = api or resolve
                repo_type = "dataset" if m.group("type") in ("datasets",) else "model"
                repo = m.group("repo")
                if (repo_type, repo) not in hub.repos:
                    hub._count(self.command, ("missing", repo))
                    return self._error("RepoNotFound", f"Repository {repo} not found", body)
                commit = hub.commit(repo_type, repo)
                files = hub.files(repo_type, repo)
                if api is not None:
                    rev, _, sub = api.group("rest").partition("/")
                    if rev not in ("main", commit):
                        return self._error("RevisionNotFound", f"Invalid rev id: {rev}", body)
                    hub._count(self.command, (api.group("what"), repo))
                    if api.group("what") == "revision":
                        out = {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
                    else:
                        out = [{"type": "file", "path": f, "size": p.stat().st_size,
                                "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                               for f, p in files.items() if f == sub or f.startswith(sub)]
                    return self._send(200, json.dumps(out).encode(), {"Content-Type": "application/json"}, body)
                name = resolve.group("file")
                if resolve.group("rev") not in ("main", commit):
                    return self._error("RevisionNotFound", f"Invalid rev id: {resolve.group('rev')}", body)
                if name not in files:
                    return self._error("EntryNotFound", f"{name} does not exist", body)
                hub._count(self.command, ("resolve", repo, name))
                data = files[name].read_bytes()
                self._send(200, data, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                                       "Content-Type": "application/octet-stream"}, body)

        return Handler
