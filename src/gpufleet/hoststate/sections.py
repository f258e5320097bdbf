"""How gpufleet reads a host in one shell command: each part of the output under a marker line of its own
(`@@gpufleet:<name>`), the last one `end`, and the parts taken apart again here. The host snapshot
(gpufleet.vllm.host_command) and the ledger reader (gpufleet.hoststate.reader) print their parts this way.

    >>> split(["", "@@gpufleet:os", "ID=debian", "", "", "@@gpufleet:end"])
    {'os': ['ID=debian'], 'end': []}
"""

from __future__ import annotations

from collections.abc import Collection

from gpufleet.errors import GpufleetError
from gpufleet.wire.evidence import excerpt

MARK = "@@gpufleet:"
END = "end"


class Forged(GpufleetError):
    """A marker line came from something the command quoted (a file, a server's answer), not from the command: its
    output cannot be trusted. str() is the reason, one line."""


class Truncated(GpufleetError):
    """The output stops before its end marker (the command was cut, or failed on the way)."""


def marker(name: str) -> str:
    """The shell that prints a section's marker line (printf: a builtin)."""
    # Leading newline: a file without a final newline (json.dump writes none) must not swallow the marker.
    return f"printf '\\n{MARK}{name}\\n'"


def end() -> str:
    return marker(END)


def print_file(file: str, then: str = "") -> str:
    """The shell that prints a small file (a shell word: a quoted path or "$f") with shell builtins only (one program
    less than cat); nothing when it cannot be read. then: more shell run on each line ($l)."""
    # `|| [ -n ... ]` keeps a last line without a newline.
    return (f"while IFS= read -r l || [ -n \"$l\" ]; do printf '%s\\n' \"$l\"; {then}done 2>/dev/null "
            f"< {file}")


def split(lines: list[str], answers: str | None = None, after_answers: Collection[str] = (END,)) -> dict[str, list[str]]:
    """The output's sections by name, each without its trailing blank lines. Every section is printed once, so one
    seen twice came from something the command quoted: Forged. answers: the section from which on the output
    quotes what a server answered; after it only the sections in after_answers may begin (Forged otherwise).
    Truncated: no end marker."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith(MARK):
            current = line[len(MARK):].strip()
            if answers is not None and answers in sections and current not in after_answers:
                raise Forged(f"a section {excerpt(current, 60)!r} inside the service's answers (something that "
                             "answered on the host carried gpufleet's section marker)")
            if current in sections:
                # A forged ledger or checksum must never be what root acts on.
                raise Forged(f"its section {excerpt(current, 60)!r} appears twice (something that answered on the "
                             "host or a file it read carried gpufleet's section marker)")
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    for body in sections.values():
        while body and not body[-1].strip():
            body.pop()
    if END not in sections:
        raise Truncated("no end marker")
    return sections
