"""Replace a root file on a host whole (docs/crash-safety.md, "Atomic writes")."""

from __future__ import annotations

import posixpath
import re
import shlex


def atomic_write_command(
    path: str,
    mode: str = "0644",
    owner: str = "root:root",
    source: str | None = None,
    sha256: str | None = None,
    sha256_from: str | None = None,
) -> str:
    """Root's shell replacing `path` with stdin or `source`, checked against sha256 or the file sha256_from."""
    directory, name = posixpath.split(path)
    if not directory or not name:
        raise ValueError(f"{path!r}: need an absolute file path")
    d, p = shlex.quote(directory), shlex.quote(path)
    read = "cat" if source is None else f"cat {shlex.quote(source)}"
    steps = [
        "set -e",
        f"mkdir -p {d}",
        f"tmp=$(mktemp -p {d} {shlex.quote('.' + name + '.XXXXXX')})",
        "trap 'rm -f \"$tmp\"' EXIT",
        f'{read} > "$tmp"',
        f'chmod {shlex.quote(mode)} "$tmp"',
        f'chown {shlex.quote(owner)} "$tmp"',
        *([] if sha256 is None and sha256_from is None else [_checked(path, sha256, sha256_from)]),
        # Unflushed, a crash can leave an empty file under the name.
        'sync "$tmp"',
        f'mv -fT "$tmp" {p}',
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
