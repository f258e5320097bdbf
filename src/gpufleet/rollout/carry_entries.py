"""Which compile-cache entries the carry moves: the files the canary's new version wrote in its vLLM cache dir (new
between a listing before its swap and one after it committed), and where each goes in a later host's cache dir
without overwriting anything the host has (docs/compile-cache.md)."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable, Mapping, Sequence

from gpufleet.vllm.spec import ServeSpec

CARRIED_MOUNT = "/root/.cache/vllm"  # the container side of the one mount whose new entries are carried


def carried_dir(spec: ServeSpec) -> str | None:
    """The host side of the spec's vLLM cache mount (None: the spec mounts none, so there is nothing to carry)."""
    for m in spec.mounts:
        if posixpath.normpath(m.container_path) == CARRIED_MOUNT:
            return posixpath.normpath(m.host_path)
    return None


def listing_command(directory: str) -> str:
    """Every path under directory, NUL-terminated, each prefixed with find's type letter (f, d, l, ...); nothing
    when the directory does not exist."""
    d = shlex.quote(directory)
    return f"if [ -d {d} ]; then cd {d} && find . -mindepth 1 -printf '%y %P\\0'; fi"


def parse_listing(out: str) -> dict[str, str]:
    """find's answer -> {relative path: type letter}."""
    paths = {}
    for item in out.split("\0"):
        if len(item) >= 3 and item[1] == " ":
            paths[item[2:]] = item[0]
    return paths


def new_files(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """The files (and links) the canary's new version wrote: present after its verify, absent before its swap."""
    return sorted(p for p, kind in after.items() if kind in "fl" and p not in before)


def placements(files: Iterable[str], present: Mapping[str, str]) -> list[str]:
    """The paths to rename into a host's cache dir so that it has every file: for each file, its shallowest
    ancestor (or itself) the host lacks. A file the host already has is left as it is (never overwritten)."""
    out: set[str] = set()
    for f in files:
        if f in present:
            continue
        parts = f.split("/")
        for i in range(1, len(parts) + 1):
            path = "/".join(parts[:i])
            if path not in present:
                out.add(path)
                break
    # A placement inside another one is moved with it.
    return sorted(p for p in out if not any(p.startswith(q + "/") for q in out))


def files_under(files: Iterable[str], roots: Sequence[str]) -> list[str]:
    return [f for f in files if any(f == r or f.startswith(r + "/") for r in roots)]
