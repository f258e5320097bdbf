"""What one image pull moved, from docker's output and the manifest, and whether a failed one was tampered with."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

# "<12 hex of the layer's digest>: <status>", docker pull's line per change when not on a terminal.
_LAYER_LINE = re.compile(r"^([0-9a-f]{12}): (.+?)\s*$")
# Any of these says this pull fetched the layer; a layer can skip "Download complete".
_FETCHED = ("Download complete", "Pull complete", "Verifying Checksum")
# docker's words for bytes that do not hash to the digest it asked for.
_TAMPERED = re.compile(
    r"verification failed|digest mismatch|does not match (?:the )?(?:expected )?digest|"
    r"unexpected (?:content )?digest",
    re.IGNORECASE,
)
MANIFEST_TYPES = ("application/vnd.docker.distribution.manifest.v2+json", "application/vnd.oci.image.manifest.v1+json")
INDEX_TYPES = ("application/vnd.docker.distribution.manifest.list.v2+json", "application/vnd.oci.image.index.v1+json")
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))


@dataclass(frozen=True)
class PullStats:
    """One host's pull of one digest, in compressed layer bytes; None: unknown (docs/site-cache.md)."""

    ref: str
    site_bytes: int | None
    upstream_bytes: int | None
    fell_back: bool  # the site cache could not serve it
    cache: str | None = None  # host:port
    warning: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> PullStats | None:
        """The record a pull wrote; None for anything else."""
        try:
            data = json.loads(text)
            stats = cls(**data)
        except (ValueError, TypeError):
            return None
        ints = (stats.site_bytes, stats.upstream_bytes)
        if not isinstance(stats.ref, str) or not all(v is None or isinstance(v, int) for v in ints):
            return None
        return stats


def layer_states(lines: Iterable[str]) -> dict[str, set[str]]:
    states: dict[str, set[str]] = {}
    for line in lines:
        m = _LAYER_LINE.match(line.strip())
        if m:
            states.setdefault(m[1], set()).add(m[2])
    return states


def downloaded(lines: Iterable[str]) -> set[str]:
    return {
        layer
        for layer, seen in layer_states(lines).items()
        if "Already exists" not in seen and any(s in seen for s in _FETCHED)
    }


def tampered(output: str) -> str | None:
    """The line of a failed pull saying content did not match its digest."""
    return next((line.strip() for line in output.splitlines() if _TAMPERED.search(line)), None)


def verified_manifest(body: bytes, digest: str) -> dict[str, Any] | None:
    """The manifest or index when `body` hashes to `digest`, else None."""
    if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def platform_manifest(index: Mapping[str, Any], arch: str, os_name: str = "linux") -> str | None:
    """The digest of `arch`'s manifest in an image index."""
    for entry in index.get("manifests") or ():
        platform = entry.get("platform") or {}
        if platform.get("architecture") == arch and platform.get("os", os_name) == os_name:
            digest = entry.get("digest")
            return digest if isinstance(digest, str) else None
    return None


def is_index(doc: Mapping[str, Any]) -> bool:
    return doc.get("mediaType") in INDEX_TYPES or ("manifests" in doc and "layers" not in doc)


def layer_sizes(manifest: Mapping[str, Any]) -> dict[str, int]:
    """short layer id, as docker pull prints it -> compressed size."""
    sizes: dict[str, int] = {}
    for layer in manifest.get("layers") or ():
        digest, size = layer.get("digest"), layer.get("size")
        if isinstance(digest, str) and digest.startswith("sha256:") and isinstance(size, int):
            sizes[digest[7:19]] = size
    return sizes


def pulled_bytes(layers: set[str], sizes: Mapping[str, int] | None) -> int | None:
    if sizes is None:
        return None
    return sum(sizes.get(layer, 0) for layer in layers)
