"""A Hugging Face Hub stand-in on loopback, for the real `huggingface_hub` client (HF_ENDPOINT).

It serves one model repository's files, or refuses the way the hub does: a gated repo
without access (403, X-Error-Code GatedRepo), an unknown repo or a bad token (401,
RepoNotFound). Only the few routes `snapshot_download` uses are here.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "0" * 40


class FakeHub:
    def __init__(self, repo: str, files: dict[str, bytes], token: str | None = None, gated: bool = False):
        self.repo, self.files, self.token, self.gated = repo, files, token, gated
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def refusal(self, path: str, auth: str | None) -> tuple[int, str] | None:
        if not path.startswith(f"/api/models/{self.repo}/") and not path.startswith(f"/{self.repo}/"):
            return 401, "RepoNotFound"
        if self.token and auth != f"Bearer {self.token}":
            return (403, "GatedRepo") if self.gated else (401, "RepoNotFound")
        return None

    def close(self) -> None:
        self.server.shutdown()


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            refused = hub.refusal(self.path, self.headers.get("authorization"))
            if refused:
                return self._send(refused[0], b'{"error": "refused"}', {"X-Error-Code": refused[1]}, body)
            if "/tree/" in self.path:  # the file listing
                tree = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                        for f, d in hub.files.items()]
                return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
            if self.path.startswith("/api/models/"):
                info = {"id": hub.repo, "sha": SHA, "siblings": [{"rfilename": f} for f in hub.files]}
                return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
            name = self.path.split("?")[0].split("/resolve/", 1)[-1].split("/", 1)[-1]
            if name not in hub.files:
                return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
            data = hub.files[name]
            etag = hashlib.sha1(data).hexdigest()
            self._send(200, data, {"X-Repo-Commit": SHA, "ETag": f'"{etag}"'}, body)

        def _send(self, code: int, data: bytes, headers: dict, body: bool) -> None:
            self.send_response(code)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Handler


def tokenizer_files(folder: Path) -> dict[str, bytes]:
    """A tokenizer folder's files as a model repository holds them (plus one it should skip)."""
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    files["model-00001-of-00004.safetensors"] = b"weights are not fetched"
    return files
