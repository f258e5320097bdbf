"""Exceptions the library raises; the CLI prints each as one line, without a traceback.

Every error a user can meet derives from GpufleetError:

* GpufleetError (errors): str() is the one-line message
  * SettingError (errors): names the host, the setting and the fix
  * SettingErrors (errors)
  * HostLockError (hostlock): the lock failed, not for a holder
    * HostLockBusy (hostlock)
    * BadLockSettings (hostlock)
    * NotOverSsh (hostlock)
    * LockLost (hostlock): its lease ran out
  * CorruptLedger (hoststate.ledger)
  * LedgerStateError (hoststate.ledger): a caller's bug
  * Forged (hoststate.sections): a marker line came from quoted data
  * Truncated (hoststate.sections): a read cut short
  * RouterError (router.api)
  * SandboxError (sandbox.procs)
"""

from __future__ import annotations

import re
from typing import Any

# Line ends somewhere: systemd stops at LF, CR and NUL, terminals at the rest of C0/C1, some readers at U+2028/9.
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def shown(value: Any, limit: int = 80) -> str:
    """repr(value) for a message, cut short so a huge value cannot flood the terminal."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(text: str) -> str:
    """text with every control character escaped, so a message stays one line whatever it quotes."""
    return CONTROL_CHARACTERS.sub(lambda m: m.group().encode("unicode_escape").decode(), str(text))


class GpufleetError(Exception):
    """Anything the user can fix."""


class SettingError(GpufleetError):
    """A host's setting is invalid."""

    def __init__(self, host: str, setting: str, problem: str, fix: str):
        self.host, self.setting, self.problem, self.fix = host, setting, problem, fix
        super().__init__(one_line(f"{host}: {setting}: {problem} (fix: {fix})"))


class SettingErrors(GpufleetError):
    """Every invalid setting found in one pass, so the user fixes them all at once."""

    def __init__(self, errors: list[SettingError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))
