"""Which compile-cache files the canary's new version wrote, and which of them a later host takes."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpufleet.vllm.spec import ServeSpec

CARRIED_MOUNT = "/root/.cache/vllm"  # container side


def carried_dir(spec: ServeSpec) -> str | None:
    """The host side of the spec's vLLM cache mount, if it has one."""
    for m in spec.mounts:
        if posixpath.normpath(m.container_path) == CARRIED_MOUNT:
            return posixpath.normpath(m.host_path)
    return None


def listing_command(directory: str) -> str:
    """Every path under directory with its type letter and change time, NUL-terminated."""
    d = shlex.quote(directory)
    return f"if [ -d {d} ]; then cd {d} && find . -mindepth 1 -printf '%y %C@ %P\\0'; fi"


@dataclass(frozen=True)
class Listed:
    kind: str
    changed: float  # inode change time: no process can set it back


def parse_listing(out: str) -> dict[str, Listed]:
    """Drops any path with an empty, `.` or `..` part."""
    paths = {}
    for item in out.split("\0"):
        kind, _, rest = item.partition(" ")
        changed, _, path = rest.partition(" ")
        try:
            when = float(changed)
        except ValueError:
            continue
        if len(kind) == 1 and _plain(path):
            paths[path] = Listed(kind, when)
    return paths


def _plain(path: str) -> bool:
    return bool(path) and all(part not in ("", ".", "..") for part in path.split("/"))


def new_files(before: Mapping[str, Listed], after: Mapping[str, Listed], since: float) -> list[str]:
    """Regular files absent before the swap and changed since the new container started."""
    return sorted(p for p, seen in after.items() if seen.kind == "f" and p not in before and seen.changed >= since)


def entries(before: Mapping[str, Listed], files: Iterable[str]) -> list[str]:
    """Per new file, its shallowest path absent before the swap."""
    found: set[str] = set()
    for f in files:
        parts = f.split("/")
        found.add(next("/".join(parts[:i]) for i in range(1, len(parts) + 1) if "/".join(parts[:i]) not in before))
    return sorted(found)


def placements(new: Sequence[str], files: Sequence[str], present: Mapping[str, Listed]) -> tuple[list[str], list[str]]:
    """(paths to rename into the host's cache dir, entries it has in part, left as they are)."""
    roots: set[str] = set()
    partial = []
    for entry in new:
        if entry not in present:
            roots.add(entry)
            continue
        mine = files_under(files, [entry])
        if any(f in present for f in mine):
            if not all(f in present for f in mine):
                partial.append(entry)
            continue
        for f in mine:
            parts = f.split("/")
            roots.add(next("/".join(parts[:i]) for i in range(1, len(parts) + 1) if "/".join(parts[:i]) not in present))
    return sorted(r for r in roots if not any(r.startswith(q + "/") for q in roots)), partial


def files_under(files: Iterable[str], roots: Sequence[str]) -> list[str]:
    return [f for f in files if any(f == r or f.startswith(r + "/") for r in roots)]
