#!/usr/bin/python3
"""Stand-in for the Hugging Face CLI's `hf download` inside the sandbox vLLM image, stdlib only.

    hf download REPO --local-dir DIR [--revision REV] [--token T]

"Downloads" a model bundled in the image (STANDIN_HUB, default /opt/gpufleet-standin/hub/<org>/<name>/) the way the
real CLI does for the deploy: files land in DIR with .cache/huggingface/download/*.metadata; a file that is already
complete is skipped, a partial one is resumed; progress goes to stderr; the local dir is printed last on stdout; an
unknown repo or revision fails (exit 1) with the real CLI's message.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

HUB = Path(os.environ.get("STANDIN_HUB", "/opt/gpufleet-standin/hub"))
CHUNK = 1 << 20


def revision_of(repo_dir: Path) -> str:
    return hashlib.sha1(repo_dir.name.encode() + b"/gpufleet-standin").hexdigest()


def download(repo: str, local_dir: Path, revision: str | None) -> int:
    src = HUB / repo
    if "/" not in repo or not src.is_dir():
        print(
            f"Repository Not Found for url: https://huggingface.co/api/models/{repo}/revision/{revision or 'main'}.\n"
            "Please make sure you specified the correct `repo_id` and `repo_type`.\n"
            "If you are trying to access a private or gated repo, make sure you are authenticated.",
            file=sys.stderr,
        )
        return 1
    commit = revision_of(src)
    if revision not in (None, "main", commit):
        print(
            f"Revision Not Found for url: https://huggingface.co/api/models/{repo}/revision/{revision}.\n"
            f"Invalid rev id: {revision}",
            file=sys.stderr,
        )
        return 1
    files = sorted(p for p in src.rglob("*") if p.is_file())
    meta_dir = local_dir / ".cache" / "huggingface" / "download"
    meta_dir.mkdir(parents=True, exist_ok=True)
    print(f"Fetching {len(files)} files:   0%|          | 0/{len(files)} [00:00<?, ?it/s]", file=sys.stderr, flush=True)
    for n, f in enumerate(files, 1):
        rel = f.relative_to(src)
        dest = local_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        size = f.stat().st_size
        have = dest.stat().st_size if dest.exists() else 0
        if have == size:
            print(f"{rel}: already complete, skipped", file=sys.stderr, flush=True)
        else:
            if have > size:
                have = 0
            with open(f, "rb") as inp, open(dest, "r+b" if have else "wb") as out:
                inp.seek(have)
                out.seek(have)
                if have:
                    print(f"{rel}: resuming at {have} bytes", file=sys.stderr, flush=True)
                while chunk := inp.read(CHUNK):
                    out.write(chunk)
                    out.truncate()
            print(f"{rel}: 100%|##########| {size}/{size} [00:00<00:00]", file=sys.stderr, flush=True)
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (meta_dir / f"{rel}.metadata").parent.mkdir(parents=True, exist_ok=True)
        (meta_dir / f"{rel}.metadata").write_text(f"{commit}\n{digest}\n{time.time()}\n")
        pct = n * 100 // len(files)
        print(f"Fetching {len(files)} files: {pct:3d}%|{'#' * (pct // 10):<10}| {n}/{len(files)}", file=sys.stderr, flush=True)
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
    return download(args.repo_id, Path(args.local_dir), args.revision)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
