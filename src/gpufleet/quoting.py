"""Quoting at the boundary: an argv list becomes a POSIX shell line or a systemd ExecStart value, once."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from gpufleet.errors import one_line


def shell_line(argv: Sequence[str], continuation: bool = True) -> str:
    """A POSIX shell command line for argv; one option per line with backslash continuations when asked.

    >>> shell_line(["docker", "run", "--gpus", '"device=0,1"', "img"], continuation=False)
    'docker run --gpus \\'"device=0,1"\\' img'
    """
    quoted = [shlex.quote(a) for a in argv]
    if not continuation:
        return " ".join(quoted)
    # One option per line with its value ("--port 5000"), as people write them; the program and its
    # subcommand ("docker run") share the first line.
    lines: list[str] = [" ".join(quoted[:2])]
    for token in quoted[2:]:
        previous = lines[-1]
        if not token.startswith("-") and previous.startswith("-") and " " not in previous:
            lines[-1] = f"{previous} {token}"
        else:
            lines.append(token)
    return " \\\n  ".join(lines)


def systemd_exec(argv: Sequence[str]) -> str:
    """A value for ExecStart= that systemd splits back into exactly argv.

    systemd splits on whitespace, honours double quotes with C-style backslash escapes, expands $VAR and
    %-specifiers: so every argument is double-quoted when needed, backslashes and quotes are escaped, and
    "$" and "%" are doubled.
    """
    return " ".join(_systemd_word(a) for a in argv)


def _systemd_word(arg: str) -> str:
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if escaped and not any(c in escaped for c in ' \t\n"\'\\;'):
        return escaped
    escaped = escaped.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def systemd_text(text: str) -> str:
    """Free text for a unit's Description= or a comment line: "%" doubled (Description= expands specifiers such
    as %n), control characters shown escaped (settings refuse them; this keeps any that slip in from starting a
    new directive). The template never ends a line with such text, so a trailing backslash continues nothing.

    >>> systemd_text("50% of %n")
    '50%% of %%n'
    """
    return one_line(text).replace("%", "%%")
