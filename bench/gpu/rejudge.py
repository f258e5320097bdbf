"""Judge a GPU evidence run's recorded sessions checks again with the current rules (judge_figures), from the raw
figures each result carries; the other checks carry none, so their recorded verdicts are counted as they stand.

    PYTHONPATH=src python bench/gpu/rejudge.py checks.json

A flip whose lead was past the top list in a record made before the figures carried the list's span (spans) cannot
be judged again: it is counted as undecided, with the span it would pass within.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
from collections import Counter
from pathlib import Path
from typing import Any

from gpufleet.health.serving_rules import BATCH_TIE_NATS, FIRST_TIE_NATS, Comparison, SessionFigures, judge_figures


def figures_of(recorded: dict[str, Any]) -> SessionFigures:
    """A session's recorded figures (JSON lists for tuples; fields a newer rule added take their defaults)."""
    known = {f.name for f in dataclasses.fields(Comparison)}
    fields: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in recorded["own"].items() if k in known
    }
    own = Comparison(**fields)
    return SessionFigures(
        own, recorded["first_own"], recorded["first_other"], recorded["apart"], recorded["shared_other"]
    )


def rejudge(result: dict[str, Any]) -> tuple[str, str]:
    """('passed' | 'failed' | 'undecided', the line) for one recorded sessions result."""
    for label in ("a", "b"):
        recorded = result["figures"][label]
        found = judge_figures(figures_of(recorded))
        if found.ok:
            continue
        c = found.figures.own
        if "spans" not in recorded["own"] and c.flip is not None and None in c.margins:
            bound = FIRST_TIE_NATS if c.flip == 0 else BATCH_TIE_NATS
            if judge_figures(dataclasses.replace(found.figures, own=dataclasses.replace(c, spans=(0.0, 0.0)))).ok:
                return "undecided", (
                    f"session {label}: a lead past the top list, whose span was not recorded; passes "
                    f"if it spanned at most {bound} nats"
                )
        return "failed", f"session {label}: {found.line}"
    return "passed", ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checks", type=Path, help="the evidence run's checks.json (or checks.json.xz)")
    args = parser.parse_args()
    counts: dict[str, Counter[str]] = {}
    if args.checks.suffix == ".xz":
        with lzma.open(args.checks, "rt") as packed:
            text = packed.read()
    else:
        text = args.checks.read_text()
    for phase in json.loads(text):
        for run, results in enumerate(phase["results"]):
            for result in results:
                if result["name"] == "sessions" and result.get("ran", True):
                    verdict, line = rejudge(result)
                    if line:
                        print(f"run {run}: sessions {verdict}: {line}")
                else:
                    verdict = "passed (as recorded)" if result["ok"] else "failed (as recorded)"
                counts.setdefault(result["name"], Counter())[verdict] += 1
    for name, count in counts.items():
        print(f"{name}: " + ", ".join(f"{n} {verdict}" for verdict, n in sorted(count.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
