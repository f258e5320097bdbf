"""The one reading of a host's ledgers, for the deploy's snapshot and the rollout."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpufleet.hoststate import sections

OWN = "state"
OTHERS = "other_ledgers"  # timed apart by bench/noop_breakdown.py
OTHER = "ledger "  # + path
PRESENT = "@@present"


@dataclass(frozen=True)
class LedgerTexts:
    own: str | None  # None: no file (an empty one is corrupt)
    others: Mapping[str, str] = field(default_factory=dict)  # path -> text


def read_lines(ledger_path: str) -> list[str]:
    """The reading's shell, a line a section."""
    q = shlex.quote
    path = q(ledger_path)
    print_each = sections.print_file('"$f"')
    return [
        f"{sections.marker(OWN)}; [ -f {path} ] && echo {PRESENT} && {sections.print_file(path)}",
        f"{sections.marker(OTHERS)}; for f in {q(posixpath.dirname(ledger_path))}/*.json; do "
        f'[ -f "$f" ] && [ "$f" != {path} ] && printf \'\\n{sections.MARK}{OTHER}%s\\n\' "$f" && '
        f"{print_each}; done",
    ]


def read_command(ledger_path: str) -> str:
    """The reading alone, for root."""
    return "\n".join([*read_lines(ledger_path), sections.end()])


def ledger_texts(found: Mapping[str, list[str]]) -> LedgerTexts:
    own = found.get(OWN, [])
    return LedgerTexts(
        own="\n".join(own[1:]) + "\n" if own and own[0] == PRESENT else None,
        others={name[len(OTHER) :]: "\n".join(body) + "\n" for name, body in found.items() if name.startswith(OTHER)},
    )


def read_output(lines: list[str]) -> LedgerTexts:
    """Raises sections.Truncated or sections.Forged."""
    return ledger_texts(sections.split(lines))
