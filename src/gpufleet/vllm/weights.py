"""A model sha's hub file list, and the host commands that check, keep and restore its files (docs/deploy.md)."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import quote

MARKER = ".gpufleet-model"  # "<repo>@<sha>" once every file matched the hub
MODEL_SHA = re.compile(r"[0-9a-f]{40}")
_HEX = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
HUB = "https://huggingface.co"
RESTORED = "@@gpufleet:model-restored"  # restore_command's output after a restore


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    blob_id: str  # git's; an LFS file's is its pointer's
    sha256: str | None  # LFS files only

    @property
    def expected(self) -> str:
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class HubRevision:
    repo: str
    sha: str
    files: tuple[HubFile, ...]

    @property
    def pinned(self) -> str:
        return f"{self.repo}@{self.sha}"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class ModelTarget:
    """pin: repo@sha, when known before the run."""

    repo: str
    revision: str | None
    pin: str | None = None

    def ask(self) -> str | None:
        return self.pin.rpartition("@")[2] if self.pin else self.revision


def info_url(endpoint: str, repo: str, revision: str | None) -> str:
    """blobs=true adds each file's blob id and LFS sha256."""
    rev = quote(revision or "main", safe="")
    return f"{endpoint.rstrip('/')}/api/models/{repo}/revision/{rev}?blobs=true"


def parse_info(repo: str, body: str) -> HubRevision:
    """ValueError (one phrase) when it is no revision."""
    try:
        doc = json.loads(body)
    except json.JSONDecodeError:
        raise ValueError("the hub's answer is not JSON") from None
    model_sha = doc.get("sha") if isinstance(doc, dict) else None
    if not isinstance(model_sha, str) or not MODEL_SHA.fullmatch(model_sha):
        raise ValueError("the hub's answer names no commit")
    files = []
    for sibling in doc.get("siblings") or ():
        lfs = sibling.get("lfs") or {}
        path, blob, size = sibling.get("rfilename"), sibling.get("blobId"), sibling.get("size")
        if not (isinstance(path, str) and isinstance(blob, str) and isinstance(size, int)) or _unsafe(path):
            raise ValueError(f"the hub's answer lists a file without its name, size or blob id: {sibling!r:.80}")
        sha = lfs.get("sha256")
        if (sha is not None and not _HEX.fullmatch(str(sha))) or not _HEX.fullmatch(blob):
            raise ValueError(f"the hub's answer has no usable hash for {path}")
        files.append(HubFile(path, size, blob, sha))
    return HubRevision(repo, model_sha, tuple(files))


def _unsafe(path: str) -> bool:
    return path.startswith("/") or ".." in path.split("/") or "\n" in path


def hash_command(model_dir: str, files: Sequence[HubFile]) -> str:
    """Shell printing "<hash> <path>" per file ("- <path>" if absent): LFS sha256, else git's blob id."""
    lines = []
    for f in files:
        q = shlex.quote(f.path)
        digest = (
            f"sha256sum < {q}" if f.sha256 else f"{{ printf 'blob %s\\0' \"$(stat -c %s {q})\"; cat {q}; }} | sha1sum"
        )
        lines.append(f'if [ -f {q} ]; then h=$({digest} | cut -c1-64); echo "${{h%% *}} "{q}; else echo - {q}; fi')
    return f"cd {shlex.quote(model_dir)} && {{ " + "; ".join(lines) + "; }"


def mismatches(revision: HubRevision, output: Sequence[str]) -> list[str]:
    """Missing or changed files, from hash_command's output."""
    seen: dict[str, str] = {}
    for line in output:
        digest, _, path = line.strip().partition(" ")
        seen[path] = digest
    return [f.path for f in revision.files if seen.get(f.path) != f.expected]


def partial_paths(model_dir: str, paths: Sequence[str]) -> list[str]:
    """The file and hf's completion record, so a refused file is fetched again."""
    meta = f"{model_dir}/.cache/huggingface/download"
    return [p for path in paths for p in (f"{model_dir}/{path}", f"{meta}/{path}.metadata")]


def marker_text(revision: HubRevision) -> str:
    return revision.pinned + "\n"


def kept_dir(model_dir: str) -> str:
    """Where the committed files wait for a rollback."""
    return model_dir.rstrip("/") + ".gpufleet-kept"


def keep_command(model_dir: str) -> str:
    """Shell keeping the files as hard links, unless a copy is kept already (docs/deploy.md)."""
    d, k, tmp = (shlex.quote(p) for p in (model_dir, kept_dir(model_dir), kept_dir(model_dir) + ".tmp"))
    return (
        f"[ -e {k} ] || {{ rm -rf {tmp} && cp -al {d} {tmp} && rm -rf {tmp}/.cache && "
        f"{{ [ ! -d {d}/.cache ] || cp -a {d}/.cache {tmp}/.cache; }} && mv {tmp} {k}; }}"
    )


def restore_command(model_dir: str, pinned: str) -> str:
    """Shell putting the kept copy back when it holds `pinned`, printing RESTORED; a re-run finishes a cut one."""
    d, k, old = (shlex.quote(p) for p in (model_dir, kept_dir(model_dir), model_dir.rstrip("/") + ".gpufleet-old"))
    return (
        f'{{ rm -rf {old}; if [ "$(cat {k}/{MARKER} 2>/dev/null)" = {shlex.quote(pinned)} ]; then '
        f"{{ [ ! -e {d} ] || mv {d} {old}; }} && mv {k} {d} && rm -rf {old} && echo {RESTORED}; fi; }}"
    )


def drop_kept_command(model_dir: str) -> str:
    kept = kept_dir(model_dir)
    return f"rm -rf {shlex.quote(kept)} {shlex.quote(kept + '.tmp')}"


def token_header_command(env_file: str | None) -> str:
    """curl's Authorization header from the env file's HF_TOKEN: the token never reaches a command line."""
    if env_file is None:
        return "true"
    return f"sed -n 's/^HF_TOKEN=/Authorization: Bearer /p' {shlex.quote(env_file)}"


def fetch_info_command(url: str, env_file: str | None) -> str:
    return (
        f"{token_header_command(env_file)} | curl -fsS --noproxy '*' --connect-timeout 5 --max-time 60 -H @- "
        f"{shlex.quote(url)}"
    )


def env_for_download(endpoint: str) -> Mapping[str, str]:
    """The hub or its mirror, with Xet off so no byte comes around it (docs/deploy.md)."""
    return {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"}
