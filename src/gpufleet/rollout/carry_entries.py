"""Which compile-cache entries the carry moves: the regular files the canary's new version wrote in its vLLM cache dir
(new since a listing before its swap), and which entries a later host takes whole (docs/compile-cache.md)."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpufleet.vllm.spec import ServeSpec

CARRIED_MOUNT = "/root/.cache/vllm"  # the container side of the one mount whose new entries are carried


def carried_dir(spec: ServeSpec) -> str | None:
    """The host side of the spec's vLLM cache mount (None: the spec mounts none, so there is nothing to carry)."""
    for m in spec.mounts:
        if posixpath.normpath(m.container_path) == CARRIED_MOUNT:
            return posixpath.normpath(m.host_path)
    return None


def listing_command(directory: str) -> str:
    """Every path under directory with its type letter and change time, NUL-terminated; nothing when it is absent."""
    d = shlex.quote(directory)
    return f"if [ -d {d} ]; then cd {d} && find . -mindepth 1 -printf '%y %C@ %P\\0'; fi"


@dataclass(frozen=True)
class Listed:
    kind: str  # find's type letter: f, d, l, ...
    changed: float  # inode change time: no process can set it back


def parse_listing(out: str) -> dict[str, Listed]:
    """find's answer -> {relative path: Listed}; a path with an empty, `.` or `..` part is dropped."""
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
    """The regular files present after the canary's verify, absent before its swap, and changed since its new
    container started (`since`): what the old container wrote before its stop is not the new version's."""
    return sorted(p for p, seen in after.items() if seen.kind == "f" and p not in before and seen.changed >= since)


def entries(before: Mapping[str, Listed], files: Iterable[str]) -> list[str]:
    """Per new file, its shallowest ancestor (or itself) absent before the swap: usually one `<hash>/` dir."""
    found: set[str] = set()
    for f in files:
        parts = f.split("/")
        found.add(next("/".join(parts[:i]) for i in range(1, len(parts) + 1) if "/".join(parts[:i]) not in before))
    return sorted(found)


def placements(new: Sequence[str], files: Sequence[str], present: Mapping[str, Listed]) -> tuple[list[str], list[str]]:
    """(the paths to rename into a host's cache dir, the entries it has in part). An entry the host lacks goes in
    whole; one holding any of its new files is left as it is; one holding none (a canary whose cache was empty
    before cannot tell an entry from its parents) takes, per file, its shallowest path the host lacks."""
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
