"""Exceptions the library raises; the CLI turns them into one-line messages (no tracebacks for user errors)."""

from __future__ import annotations


class GpufleetError(Exception):
    """Base class: anything the user can fix. str() is the one-line message shown to them."""


class SettingError(GpufleetError):
    """A host's setting is invalid. Names the host, the setting and the fix, on one line."""

    def __init__(self, host: str, setting: str, problem: str, fix: str):
        self.host, self.setting, self.problem, self.fix = host, setting, problem, fix
        super().__init__(f"{host}: {setting}: {problem} (fix: {fix})")


class SettingErrors(GpufleetError):
    """Every invalid setting found in one pass, so the user fixes them all at once."""

    def __init__(self, errors: list[SettingError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))
