"""Read pyinfra's own "Results" table, so tests count changes the way pyinfra reports them."""

from __future__ import annotations

import re


def results(output: str) -> dict[str, tuple[str, ...]]:
    """operation -> (hosts, success, error, no change); "Grand total" included."""
    table = output[output.rindex("--> Results:") :]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 5:
            rows[cells[0]] = tuple(cells[1:])
    return rows


def changes(output: str) -> int:
    """Operations that changed something, over all hosts ("Success" counts executed changes; "-" is none)."""
    success = results(output)["Grand total"][1]
    return 0 if success == "-" else int(success)


def changed_ops(output: str) -> dict[str, int]:
    return {op.split(" | ")[-1]: int(r[1]) for op, r in results(output).items() if op != "Grand total" and r[1] != "-"}
