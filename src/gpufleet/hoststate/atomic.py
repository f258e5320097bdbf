"""How gpufleet replaces a root file on a host (the ledger, a unit, a router's member list): never in place, so a
reader or a cut run sees the old file or the new one, whole."""

from __future__ import annotations

import posixpath
import re
import shlex


def atomic_write_command(path: str, mode: str = "0644", owner: str = "root:root", source: str | None = None,
                         sha256: str | None = None, sha256_from: str | None = None) -> str:
    """A shell command that replaces `path` atomically with the content on its stdin (or in the uploaded file
    `source`, removed afterwards): a temp file in the same directory, fsync'd, then rename(2), then the directory
    fsync'd. A reader sees the old file or the new one, never a part; a cut leaves at most a `.<name>.*` temp file.
    Run it as root (sudo) for `owner` to apply. sha256 (or a file holding it, sha256_from): what the temp file
    must hash to before the rename.

    >>> atomic_write_command("/var/lib/gpufleet/vllm.json", mode="0600").split("; ")[2]
    'tmp=$(mktemp -p /var/lib/gpufleet .vllm.json.XXXXXX)'
    """
    directory, name = posixpath.split(path)
    if not directory or not name:
        raise ValueError(f"{path!r}: need an absolute file path")
    d, p = shlex.quote(directory), shlex.quote(path)
    read = "cat" if source is None else f"cat {shlex.quote(source)}"
    steps = [
        "set -e",
        f"mkdir -p {d}",
        f"tmp=$(mktemp -p {d} {shlex.quote('.' + name + '.XXXXXX')})",
        # A cut (error, signal) must not leave the temp file behind; after the rename it no longer exists.
        "trap 'rm -f \"$tmp\"' EXIT",
        f"{read} > \"$tmp\"",
        f"chmod {shlex.quote(mode)} \"$tmp\"",
        f"chown {shlex.quote(owner)} \"$tmp\"",
        *([] if sha256 is None and sha256_from is None else [_checked(path, sha256, sha256_from)]),
        # The data must be on disk before the name points at it, or a crash can leave an empty file under `path`.
        "sync \"$tmp\"",
        f"mv -fT \"$tmp\" {p}",
        # ... and the rename itself durable.
        f"sync {d}",
    ]
    if source is not None:
        steps.append(f"rm -f {shlex.quote(source)}")
    return "; ".join(steps)


def _checked(path: str, sha256: str | None, sha256_from: str | None) -> str:
    if sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ValueError(f"{sha256!r}: not a sha256 digest")
    want = sha256 if sha256 is not None else f"$(cat {shlex.quote(str(sha256_from))})"
    refused = shlex.quote(f"{path}: the upload is not what was sent (sha256 differs): not replaced")
    return f'[ "$(sha256sum < "$tmp" | cut -c1-64)" = "{want}" ] || {{ echo {refused} >&2; exit 1; }}'
