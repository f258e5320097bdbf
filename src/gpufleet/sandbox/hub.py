"""The stand-in Hugging Face hub: the part of the hub's HTTP API that `hf download` and huggingface_hub use, over
model repositories kept on disk, stdlib only.

    python -m gpufleet.sandbox.hub ROOT --bind 10.213.0.1 --port 8090 --log hub.log

ROOT/<org>/<name>/commits/<sha>/ holds each commit's files and ROOT/<org>/<name>/refs/<branch> its commit. The
routes answer with the hub's headers and 404s; LFS files are served in place, never redirected.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")  # what the hub's default .gitattributes stores in LFS
CHUNK = 1 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}")


def git_blob_id(data: bytes) -> str:
    """The git blob id: the hub's blobId and a small file's ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    blob_id: str  # an LFS file's is its pointer's
    sha256: str | None  # LFS files only

    def etag(self) -> str:
        return self.sha256 or self.blob_id

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": self.blob_id, "size": self.size, "path": self.path}
        if self.sha256:
            entry["lfs"] = {
                "oid": self.sha256,
                "size": self.size,
                "pointerSize": len(lfs_pointer(self.sha256, self.size)),
            }
        return entry


def describe(path: str, data: bytes) -> RepoFile:
    if path.endswith(LFS_SUFFIXES):
        sha = hashlib.sha256(data).hexdigest()
        return RepoFile(path, len(data), git_blob_id(lfs_pointer(sha, len(data))), sha)
    return RepoFile(path, len(data), git_blob_id(data), None)


def publish(root: Path, repo: str, files: Mapping[str, bytes | Path], branch: str = "main") -> str:
    """A new commit of `repo` holding exactly `files`, with `branch` moved to it unless it holds them already;
    returns the branch's commit."""
    base = root / repo
    (base / "refs").mkdir(parents=True, exist_ok=True)
    ref = base / "refs" / branch
    parent = ref.read_text().strip() if ref.exists() else ""
    entries = []
    for path in sorted(files):
        content = files[path]
        data = content.read_bytes() if isinstance(content, Path) else content
        entries.append(describe(path, data))
    if parent and listing(root, repo, parent) == entries:
        return parent
    sha = hashlib.sha1(json.dumps([parent, [f.tree_entry() for f in entries]]).encode()).hexdigest()
    tree = base / "commits" / sha
    if not tree.exists():
        tmp = base / "commits" / f".{sha}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for path, content in files.items():
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                shutil.copyfile(content, tmp / path)
            else:
                (tmp / path).write_bytes(content)
        (tmp.parent / f".{sha}.json.tmp").write_text(json.dumps([f.tree_entry() for f in entries]))
        (tmp.parent / f".{sha}.json.tmp").rename(tmp.parent / f"{sha}.json")
        tmp.rename(tree)
    (base / "refs" / f".{branch}.tmp").write_text(sha + "\n")
    (base / "refs" / f".{branch}.tmp").rename(ref)
    return sha


def listing(root: Path, repo: str, sha: str) -> list[RepoFile]:
    entries = json.loads((root / repo / "commits" / f"{sha}.json").read_text())
    return [RepoFile(e["path"], e["size"], e["oid"], (e.get("lfs") or {}).get("oid")) for e in entries]


def resolve(root: Path, repo: str, revision: str) -> str | None:
    """The commit a branch names, or the revision itself when it is a commit of the repo; None when unknown."""
    base = root / repo
    ref = base / "refs" / revision
    if "/" not in revision and not revision.startswith(".") and ref.is_file():
        return ref.read_text().strip()
    if _COMMIT.fullmatch(revision) and (base / "commits" / revision).is_dir():
        return revision
    return None


@dataclass(frozen=True)
class Request:
    client: str
    method: str
    path: str
    status: int
    sent: int  # body bytes
    ended_at: float  # epoch seconds, when the last byte was sent

    @property
    def download(self) -> bool:
        """A file's bytes, not the API's."""
        return self.method == "GET" and "/resolve/" in self.path


def requests(log: Path, since: int = 0) -> list[Request]:
    """The requests logged after log offset `since`, in order."""
    if not log.exists():
        return []
    with log.open("rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    return [
        Request(p[0], p[1], p[2], int(p[3]), int(p[4]), float(p[5]))
        for p in (line.split(" ") for line in lines)
        if len(p) == 6
    ]


def served_bytes(log: Path, since: int = 0) -> dict[str, int]:
    """Client address -> body bytes of `resolve` GETs the hub served after log offset `since`."""
    served: dict[str, int] = {}
    for r in requests(log, since):
        if r.download:
            served[r.client] = served.get(r.client, 0) + r.sent
    return served


class HubHandler(BaseHTTPRequestHandler):
    server_version = "gpufleet-standin-hub"
    protocol_version = "HTTP/1.1"
    root: Path
    log_path: Path | None
    xet: bool = False  # advertise LFS files on Xet, as the real hub does for most repos
    log_lock = threading.Lock()

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_POST(self) -> None:
        """POST /api/models/<repo>/paths-info/<rev>, form field `paths` (repeated): their tree entries."""
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        length = int(self.headers.get("Content-Length") or 0)
        form = parse_qs(self.rfile.read(length).decode()) if length else {}
        if parts[:2] != ["api", "models"] or len(parts) < 6 or parts[4] != "paths-info":
            self._error(404, "EntryNotFound", "unknown API route")
            return
        repo = self._repo(parts[2:])
        sha = self._revision(repo, parts[5])
        if sha is None or repo is None:
            return
        wanted = set(form.get("paths", []))
        self._json([f.tree_entry() for f in listing(self.root, repo, sha) if f.path in wanted])

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the access log is ours (_log)

    def _log(self, status: int, sent: int) -> None:
        if self.log_path is None:
            return
        with self.log_lock, self.log_path.open("a") as f:
            f.write(
                f"{self.client_address[0]} {self.command} {urlsplit(self.path).path} {status} {sent} "
                f"{time.time():.3f}\n"
            )

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._log(status, 0)

    def _json(self, doc: Any, headers: Mapping[str, str] = {}) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._log(200, 0)

    def _repo(self, parts: list[str]) -> str | None:
        repo = "/".join(parts[:2])
        return repo if len(parts) >= 2 and (self.root / repo / "refs").is_dir() else None

    def _answer(self, body: bool) -> None:  # HEAD and GET share the routes
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if parts[:2] == ["api", "models"]:
            self._api(parts[2:], parse_qs(url.query))
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(parts)
        else:
            self._error(404, "EntryNotFound", f"no route for {url.path}")

    def _revision(self, repo: str | None, revision: str) -> str | None:
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        sha = resolve(self.root, repo, revision)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    def _api(self, parts: list[str], query: dict[str, list[str]]) -> None:
        repo = self._repo(parts)
        rest = parts[2:]
        if not rest or rest[0] == "revision":
            sha = self._revision(repo, unquote(rest[1]) if len(rest) > 1 else "main")
            if sha is None or repo is None:
                return
            files = listing(self.root, repo, sha)
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            siblings = [
                {
                    "rfilename": f.path,
                    **({"size": f.size, "blobId": f.blob_id} if blobs else {}),
                    **(
                        {"lfs": {"sha256": f.sha256, "size": f.size, "pointerSize": len(lfs_pointer(f.sha256, f.size))}}
                        if blobs and f.sha256
                        else {}
                    ),
                }
                for f in files
            ]
            self._json(
                {
                    "_id": sha[:24],
                    "id": repo,
                    "modelId": repo,
                    "sha": sha,
                    "private": False,
                    "gated": False,
                    "disabled": False,
                    "tags": [],
                    "siblings": siblings,
                }
            )
        elif rest[0] == "tree" and len(rest) >= 2:
            sha = self._revision(repo, rest[1])
            if sha is None or repo is None:
                return
            under = "/".join(rest[2:])
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            entries = [
                f.tree_entry() for f in listing(self.root, repo, sha) if not under or f.path.startswith(under + "/")
            ]
            if not recursive:
                depth = under.count("/") + 1 if under else 0
                entries = [e for e in entries if e["path"].count("/") == depth]
            self._json(entries)
        else:
            self._error(404, "EntryNotFound", "unknown API route")

    def _resolve(self, parts: list[str]) -> None:
        repo = self._repo(parts)
        sha = self._revision(repo, parts[3])
        if sha is None or repo is None:
            return
        path = "/".join(parts[4:])
        found = next((f for f in listing(self.root, repo, sha) if f.path == path), None)
        if found is None:
            self._error(404, "EntryNotFound", f"{path} does not exist on {parts[3]}")
            return
        start, end = 0, found.size - 1
        status = 200
        wanted = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if wanted and (wanted[1] or wanted[2]):
            if wanted[1]:
                start = int(wanted[1])
                end = min(int(wanted[2]), found.size - 1) if wanted[2] else found.size - 1
            else:
                start = max(0, found.size - int(wanted[2]))
            if start >= found.size or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{found.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                self._log(416, 0)
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{found.etag()}"')
        if found.sha256:
            self.send_header("X-Linked-Etag", f'"{found.sha256}"')
            self.send_header("X-Linked-Size", str(found.size))
            if self.xet:
                self.send_header("X-Xet-Hash", found.sha256)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{found.size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        sent = 0
        if self.command == "GET":
            with (self.root / repo / "commits" / sha / path).open("rb") as f:
                f.seek(start)
                left = end - start + 1
                try:
                    while left > 0 and (chunk := f.read(min(CHUNK, left))):
                        self.wfile.write(chunk)
                        sent += len(chunk)
                        left -= len(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
        self._log(status, sent)


def server(root: Path, bind: str, port: int, log: Path | None = None, xet: bool = False) -> ThreadingHTTPServer:
    """A hub serving `root` on bind:port, logging to `log`; call serve_forever()."""
    handler = type("Handler", (HubHandler,), {"root": root, "log_path": log, "xet": xet})
    httpd = ThreadingHTTPServer((bind, port), handler)
    httpd.daemon_threads = True
    return httpd


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpufleet.sandbox.hub", description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--log", type=Path)
    parser.add_argument("--xet", action="store_true", help="advertise LFS files as stored on Xet")
    args = parser.parse_args(argv)
    server(args.root, args.bind, args.port, args.log, args.xet).serve_forever()


if __name__ == "__main__":
    main()
