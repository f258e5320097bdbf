"""What one image pull moved, read from docker's own words: which layers each `docker pull` downloaded (its
per-layer status lines), their compressed sizes (the image manifest), and how a failed pull through the site cache
is told apart: unreachable (fall back to upstream) or content that does not match its digest (refuse).

Pure parsers: no SSH, no docker.

>>> downloaded(["0123456789ab: Already exists", "89abcdef0123: Pull complete"])
{'89abcdef0123'}
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

# docker pull (not on a terminal) prints one "<12 hex of the layer's blob digest>: <status>" line per change.
_LAYER_LINE = re.compile(r"^([0-9a-f]{12}): (.+?)\s*$")
# A layer whose bytes this pull fetched ("Download complete" comes first; a layer can skip it when fetched and
# extracted at once, "Pull complete" always ends a fetched one). "Already exists" is a layer that was present.
_FETCHED = ("Download complete", "Pull complete", "Verifying Checksum")
# docker's words when bytes it received do not hash to the digest it asked for (distribution's verifiers; the
# daemon's "filesystem layer verification failed" for a blob, "manifest verification failed" for a manifest,
# "digest mismatch"/"content digest" for the rest).
_TAMPERED = re.compile(r"verification failed|digest mismatch|does not match (?:the )?(?:expected )?digest|"
                       r"unexpected (?:content )?digest", re.IGNORECASE)
MANIFEST_TYPES = ("application/vnd.docker.distribution.manifest.v2+json",
                  "application/vnd.oci.image.manifest.v1+json")
INDEX_TYPES = ("application/vnd.docker.distribution.manifest.list.v2+json",
               "application/vnd.oci.image.index.v1+json")
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))


@dataclass(frozen=True)
class PullStats:
    """One host's pull of one digest. Bytes are the compressed layer sizes the manifest gives for the layers each
    pull downloaded; None: the manifest could not be read (the site cache did not answer), so unknown."""

    ref: str  # the upstream reference pinned by digest that was pulled
    site_bytes: int | None  # layers pulled from the site cache
    upstream_bytes: int | None  # layers pulled from the image's own registry
    fell_back: bool  # a site cache was configured for this pull and could not serve it: pulled from upstream
    cache: str | None = None  # the site cache's address ("host:port"), None when none was used
    warning: str | None = None  # the one warning line of a fall back

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> PullStats | None:
        """The record a pull wrote; None for anything else (a record of an older format is no record)."""
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
    """short layer id -> every status docker printed for it."""
    states: dict[str, set[str]] = {}
    for line in lines:
        m = _LAYER_LINE.match(line.strip())
        if m:
            states.setdefault(m[1], set()).add(m[2])
    return states


def downloaded(lines: Iterable[str]) -> set[str]:
    """The short ids (12 hex) of the layers this pull's output says it fetched."""
    return {layer for layer, seen in layer_states(lines).items()
            if "Already exists" not in seen and any(s in seen for s in _FETCHED)}


def tampered(output: str) -> str | None:
    """The line of a failed pull saying received content did not match its digest, or None."""
    return next((line.strip() for line in output.splitlines() if _TAMPERED.search(line)), None)


def verified_manifest(body: bytes, digest: str) -> dict[str, Any] | None:
    """The manifest (or index) JSON when `body` hashes to `digest` ("sha256:<hex>"), else None: sizes are read only
    from the manifest the pull itself verified."""
    if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def platform_manifest(index: Mapping[str, Any], arch: str, os_name: str = "linux") -> str | None:
    """The digest of `arch`'s manifest in an image index (a multi-platform tag pins the index's digest)."""
    for entry in index.get("manifests") or ():
        platform = entry.get("platform") or {}
        if platform.get("architecture") == arch and platform.get("os", os_name) == os_name:
            digest = entry.get("digest")
            return digest if isinstance(digest, str) else None
    return None


def is_index(doc: Mapping[str, Any]) -> bool:
    return doc.get("mediaType") in INDEX_TYPES or ("manifests" in doc and "layers" not in doc)


def layer_sizes(manifest: Mapping[str, Any]) -> dict[str, int]:
    """short layer id (12 hex of its blob digest, as docker pull prints it) -> compressed size."""
    sizes: dict[str, int] = {}
    for layer in manifest.get("layers") or ():
        digest, size = layer.get("digest"), layer.get("size")
        if isinstance(digest, str) and digest.startswith("sha256:") and isinstance(size, int):
            sizes[digest[7:19]] = size
    return sizes


def pulled_bytes(layers: set[str], sizes: Mapping[str, int] | None) -> int | None:
    """The compressed bytes of `layers`; None when the sizes are unknown."""
    if sizes is None:
        return None
    return sum(sizes.get(layer, 0) for layer in layers)
