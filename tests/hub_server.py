"""A local stand-in for the Hugging Face Hub's file API (what `huggingface_hub` calls for
`snapshot_download` and `hf_hub_download`), serving folders from disk; for HF_ENDPOINT in
tests, which may never reach the internet.

Repos: `owner/name` -> a folder; `gated/*` answers 401 with the Hub's GatedRepo error code;
any other repo 404 RepoNotFound. Every request's path is recorded in `requests`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    def __init__(self, repos: dict[str, Path]):
        self.repos = repos
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _files(self, repo: str) -> list[str]:
        root = self.repos[repo]
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def _error(self, h, status: int, code: str, message: str, body: bool) -> None:
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _json(self, h, obj, body: bool) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _serve(self, h, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append(f"{h.command} {path}")
        parts = path.strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        if api:
            parts = parts[2:]
        repo = "/".join(parts[:2])
        if len(parts) < 2:  # other API calls (e.g. the client's own telemetry)
            return self._error(h, 404, "EntryNotFound", f"no route for {path}", body)
        if repo.startswith("gated/"):
            return self._error(h, 401, "GatedRepo", f"Access to model {repo} is restricted", body)
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound", f"Repository {repo} not found", body)
        rest = parts[2:]
        if api and rest[:1] == ["tree"]:  # /api/models/{repo}/tree/{rev}: the file list
            root = self.repos[repo]
            entries = [
                {
                    "type": "file",
                    "path": f,
                    "size": (root / f).stat().st_size,
                    "oid": hashlib.sha1((root / f).read_bytes()).hexdigest(),
                }
                for f in self._files(repo)
            ]
            return self._json(h, entries, body)
        if api:  # /api/models/{repo}[/revision/{rev}]
            files = [{"rfilename": f} for f in self._files(repo)]
            info = {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": files, "private": False}
            return self._json(h, info, body)
        if len(rest) >= 3 and rest[0] == "resolve":  # /{repo}/resolve/{rev}/{file}
            name = "/".join(rest[2:])
            file = self.repos[repo] / name
            if not file.is_file():
                return self._error(h, 404, "EntryNotFound", f"{name} not found in {repo}", body)
            data = file.read_bytes()
            h.send_response(200)
            h.send_header("X-Repo-Commit", COMMIT)
            h.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
            h.send_header("Content-Length", str(len(data)))
            h.send_header("Content-Type", "application/octet-stream")
            h.end_headers()
            if body:
                h.wfile.write(data)
            return None
        return self._error(h, 404, "EntryNotFound", f"no route for {path}", body)
