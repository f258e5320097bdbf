"""Exceptions the library raises; the CLI turns them into one-line messages (no tracebacks for user errors)."""

from __future__ import annotations

import re
from typing import Any

# Anything that ends or breaks a line somewhere: systemd ends unit lines at LF, CR and NUL, terminals and logs
# at the rest of C0/C1, some readers at Unicode's line and paragraph separators. Settings refuse them; messages
# show them escaped ("\\n").
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def shown(value: Any, limit: int = 80) -> str:
    """repr(value) for a message, cut short: a 10**400 or a 128 KiB string must not flood the terminal."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(text: str) -> str:
    """text with every control character escaped, so a message stays one line whatever it quotes.

    >>> one_line("box\\nExecStartPre=/bin/sh")
    'box\\\\nExecStartPre=/bin/sh'
    """
    return CONTROL_CHARACTERS.sub(lambda m: m.group().encode("unicode_escape").decode(), str(text))


class GpufleetError(Exception):
    """Base class: anything the user can fix. str() is the one-line message shown to them."""


class SettingError(GpufleetError):
    """A host's setting is invalid. Names the host, the setting and the fix, on one line."""

    def __init__(self, host: str, setting: str, problem: str, fix: str):
        self.host, self.setting, self.problem, self.fix = host, setting, problem, fix
        super().__init__(one_line(f"{host}: {setting}: {problem} (fix: {fix})"))


class SettingErrors(GpufleetError):
    """Every invalid setting found in one pass, so the user fixes them all at once."""

    def __init__(self, errors: list[SettingError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))
