#!/usr/bin/python3
"""Stand-in for the Hugging Face CLI's `hf download` inside the sandbox vLLM image, stdlib only.

    hf download REPO [FILE...] --local-dir DIR [--revision REV] [--token T]

Speaks the hub's HTTP API at HF_ENDPOINT as huggingface_hub does for a local dir: resumes partial files and skips
those whose recorded etag matches, without hashing them. A file on Xet fails unless HF_HUB_DISABLE_XET=1, as the
real CLI would without Xet's servers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

CHUNK = 1 << 20


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a HEAD's redirect is read, not followed: its X-Linked-* headers describe the file


def request(
    url: str, token: str | None, method: str = "GET", headers: dict[str, str] | None = None, follow: bool = True
) -> Any:
    req = urllib.request.Request(url, method=method, headers={**(headers or {}), "Accept-Encoding": "identity"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener() if follow else urllib.request.build_opener(NoRedirect)
    try:
        return opener.open(req, timeout=30)
    except urllib.error.HTTPError as error:
        if not follow and 300 <= error.code < 400:
            return error
        raise


def fail(error: urllib.error.HTTPError, repo: str, revision: str) -> int:
    code = error.headers.get("X-Error-Code", "")
    url = f"https://huggingface.co/api/models/{repo}/revision/{revision}"
    if code == "RevisionNotFound":
        print(f"Revision Not Found for url: {url}.\nInvalid rev id: {revision}", file=sys.stderr)
    elif code == "RepoNotFound" or error.code in (401, 404):
        print(
            f"Repository Not Found for url: {url}.\nPlease make sure you specified the correct `repo_id` and "
            "`repo_type`.\nIf you are trying to access a private or gated repo, make sure you are authenticated.",
            file=sys.stderr,
        )
    else:
        print(f"{error.code} Server Error: {error.reason} for url: {error.url}", file=sys.stderr)
    return 1


def download(repo: str, local_dir: Path, revision: str | None, token: str | None, only: list[str]) -> int:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    xet_off = os.environ.get("HF_HUB_DISABLE_XET", "").lower() in ("1", "true", "yes", "on")
    rev = revision or "main"
    try:
        with request(f"{endpoint}/api/models/{repo}/revision/{quote(rev, safe='')}", token) as resp:
            info = json.load(resp)
    except urllib.error.HTTPError as error:
        return fail(error, repo, rev)
    except OSError as error:
        print(f"Cannot reach {endpoint}: {error}", file=sys.stderr)
        return 1
    commit = info["sha"]
    files = [s["rfilename"] for s in info.get("siblings", []) if not only or s["rfilename"] in only]
    meta_dir = local_dir / ".cache" / "huggingface" / "download"
    print(f"Fetching {len(files)} files:   0%|          | 0/{len(files)}", file=sys.stderr, flush=True)
    for n, name in enumerate(files, 1):
        url = f"{endpoint}/{repo}/resolve/{commit}/{quote(name)}"
        try:
            head = request(url, token, "HEAD", follow=False)
        except urllib.error.HTTPError as error:
            return fail(error, repo, rev)
        etag = (head.headers.get("X-Linked-Etag") or head.headers.get("ETag") or "").strip('"').removeprefix("W/")
        size = int(head.headers.get("X-Linked-Size") or head.headers.get("Content-Length") or 0)
        if head.headers.get("X-Xet-Hash") and not xet_off:
            print(
                f"{name}: stored on Xet: fetching it needs Xet's servers (cas-bridge.xethub.hf.co), which this "
                "host cannot reach",
                file=sys.stderr,
            )
            return 1
        dest, meta = local_dir / name, meta_dir / f"{name}.metadata"
        recorded = meta.read_text().split("\n") if meta.exists() else []
        if dest.exists() and recorded[1:2] == [etag]:  # the etag alone, as huggingface_hub
            meta.write_text(f"{commit}\n{etag}\n{time.time()}\n")
            print(f"{name}: already complete, skipped", file=sys.stderr, flush=True)
        else:
            meta.parent.mkdir(parents=True, exist_ok=True)
            partial = meta_dir / f"{name}.{etag}.incomplete"
            have = partial.stat().st_size if partial.exists() else 0
            if have > size:
                have = 0
            headers = {"Range": f"bytes={have}-"} if have else {}
            if have:
                print(f"{name}: resuming at {have} bytes", file=sys.stderr, flush=True)
            with request(url, token, headers=headers) as body, open(partial, "ab" if have else "wb") as out:
                if have and body.status != 206:
                    out.truncate(0)
                while chunk := body.read(CHUNK):
                    out.write(chunk)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, dest)
            meta.write_text(f"{commit}\n{etag}\n{time.time()}\n")
            print(f"{name}: 100%|##########| {size}/{size}", file=sys.stderr, flush=True)
        pct = n * 100 // len(files)
        print(
            f"Fetching {len(files)} files: {pct:3d}%|{'#' * (pct // 10):<10}| {n}/{len(files)}",
            file=sys.stderr,
            flush=True,
        )
    print(str(local_dir.resolve()))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf")
    sub = parser.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download", help="Download files from the Hub")
    dl.add_argument("repo_id")
    dl.add_argument("filenames", nargs="*")
    dl.add_argument("--local-dir", required=True)
    dl.add_argument("--revision")
    dl.add_argument("--token")
    dl.add_argument("--repo-type", default="model", choices=["model", "dataset", "space"])
    dl.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    token = args.token or os.environ.get("HF_TOKEN")
    return download(args.repo_id, Path(args.local_dir), args.revision, token, args.filenames)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
