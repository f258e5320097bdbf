"""A shell command's output in sections, each under a marker line; the last is `end`."""

from __future__ import annotations

from collections.abc import Collection

from gpufleet.errors import GpufleetError
from gpufleet.wire.evidence import excerpt

MARK = "@@gpufleet:"
END = "end"


class Forged(GpufleetError):
    """A marker line came from quoted data."""


class Truncated(GpufleetError):
    """The output stops before its end."""


def marker(name: str) -> str:
    # A file without a final newline must not swallow the marker.
    return f"printf '\\n{MARK}{name}\\n'"


def end() -> str:
    return marker(END)


def print_file(file: str, then: str = "") -> str:
    """Shell printing a small file with builtins; `then` runs on each line ($l)."""
    # `|| [ -n ... ]` keeps a last line without a newline.
    return f'while IFS= read -r l || [ -n "$l" ]; do printf \'%s\\n\' "$l"; {then}done 2>/dev/null < {file}'


def split(
    lines: list[str], answers: str | None = None, after_answers: Collection[str] = (END,)
) -> dict[str, list[str]]:
    """The sections by name; raises Forged or Truncated. Only after_answers may follow `answers`."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith(MARK):
            current = line[len(MARK) :].strip()
            if answers is not None and answers in sections and current not in after_answers:
                raise Forged(
                    f"a section {excerpt(current, 60)!r} inside the service's answers (something that "
                    "answered on the host carried gpufleet's section marker)"
                )
            if current in sections:
                raise Forged(
                    f"its section {excerpt(current, 60)!r} appears twice (something that answered on the "
                    "host or a file it read carried gpufleet's section marker)"
                )
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    for body in sections.values():
        while body and not body[-1].strip():
            body.pop()
    if END not in sections:
        raise Truncated("no end marker")
    return sections
