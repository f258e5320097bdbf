"""The one reader of a host's ledgers, for the deploy (inside the host snapshot's one command) and the rollout (on
its own): the shell that prints the service's ledger file and every other ledger in the state dir, each in a section
of its own (gpufleet.hoststate.sections), and the parser that takes their texts back out. Which ledger a service
goes by is gpufleet.hoststate.rules' (a renamed service takes over the one on its port); what a text holds,
gpufleet.hoststate.ledger's.

    >>> output = ["", "@@gpufleet:state", "@@present", '{"schema": 2}', "", "@@gpufleet:other_ledgers",
    ...           "", "@@gpufleet:ledger /var/lib/gpufleet/old.json", "{", "", "@@gpufleet:end"]
    >>> read_output(output)
    LedgerTexts(own='{"schema": 2}\\n', others={'/var/lib/gpufleet/old.json': '{\\n'})
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpufleet.hoststate import sections

OWN = "state"  # the service's ledger: a line PRESENT, then the file; nothing when there is no file
OTHERS = "other_ledgers"  # opens the others (a section of its own: it is timed apart, bench/noop_breakdown.py)
OTHER = "ledger "  # + path: one other ledger in the state dir
PRESENT = "@@present"


@dataclass(frozen=True)
class LedgerTexts:
    own: str | None  # the service's ledger file; None: no file (an empty file reads "\n": corrupt, not absent)
    others: Mapping[str, str] = field(default_factory=dict)  # path -> text: the state dir's other *.json files


def read_lines(ledger_path: str) -> list[str]:
    """The reading's shell, one line a section (the host snapshot's command holds them as they are). Read-only, shell
    builtins and `[` only."""
    q = shlex.quote
    path = q(ledger_path)
    print_each = sections.print_file('"$f"')
    return [
        # A marker line first: an empty ledger file is corrupt, a missing one is a host gpufleet never converged.
        f"{sections.marker(OWN)}; [ -f {path} ] && echo {PRESENT} && {sections.print_file(path)}",
        # The other services' ledgers: a renamed vllm_service finds its committed version (and old unit) there.
        f"{sections.marker(OTHERS)}; for f in {q(posixpath.dirname(ledger_path))}/*.json; do "
        f"[ -f \"$f\" ] && [ \"$f\" != {path} ] && printf '\\n{sections.MARK}{OTHER}%s\\n' \"$f\" && "
        f"{print_each}; done",
    ]


def read_command(ledger_path: str) -> str:
    """The reading on its own (as root: the files are root's), its output ended by the end marker."""
    return "\n".join([*read_lines(ledger_path), sections.end()])


def ledger_texts(found: Mapping[str, list[str]]) -> LedgerTexts:
    """The texts in the sections of an output that holds read_lines' (sections.split took it apart)."""
    own = found.get(OWN, [])
    return LedgerTexts(own="\n".join(own[1:]) + "\n" if own and own[0] == PRESENT else None,
                       others={name[len(OTHER):]: "\n".join(body) + "\n" for name, body in found.items()
                               if name.startswith(OTHER)})


def read_output(lines: list[str]) -> LedgerTexts:
    """read_command's output. Raises sections.Truncated (cut before its end) or sections.Forged (a file carried a
    marker line)."""
    return ledger_texts(sections.split(lines))
