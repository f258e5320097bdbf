"""argv quoted once, at the boundary: for a POSIX shell or systemd's ExecStart."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from gpufleet.errors import one_line


def shell_line(argv: Sequence[str], continuation: bool = True) -> str:
    """argv as a shell line; with continuation, an option and its value per line."""
    quoted = [shlex.quote(a) for a in argv]
    if not continuation:
        return " ".join(quoted)
    lines: list[str] = [" ".join(quoted[:2])]
    for token in quoted[2:]:
        previous = lines[-1]
        if not token.startswith("-") and previous.startswith("-") and " " not in previous:
            lines[-1] = f"{previous} {token}"
        else:
            lines.append(token)
    return " \\\n  ".join(lines)


def systemd_exec(argv: Sequence[str]) -> str:
    """A value for ExecStart= that systemd splits back into exactly argv."""
    return " ".join(_systemd_word(a) for a in argv)


def _systemd_word(arg: str) -> str:
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if escaped and not any(c in escaped for c in " \t\n\"'\\;"):
        return escaped
    escaped = escaped.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def systemd_text(text: str) -> str:
    """Free text for Description= or a comment; never at a line's end, where a backslash continues."""
    return one_line(text).replace("%", "%%")
