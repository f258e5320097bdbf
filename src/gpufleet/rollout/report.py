"""What a rollout did to each host: outcomes, the final table and the --json rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from rich.filesize import decimal
from rich.table import Table
from rich.text import Text

from gpufleet.facts.pull import PullStats
from gpufleet.rollout.carry import CarryResult
from gpufleet.wire.speed import FIGURES, SpeedFigures, speed_ratios


class Outcome(StrEnum):
    """One host's end state; docs/rollout.md's table says what each means."""

    UPDATED = "updated"
    UNCHANGED = "unchanged"
    ROLLED_BACK = "rolled-back"
    NOT_STARTED = "not-started"
    FAILED_PREPARE = "failed-prepare"
    FAILED = "failed"
    SKIPPED = "skipped"


OK = (Outcome.UPDATED, Outcome.UNCHANGED)
STYLE = {
    Outcome.UPDATED: "green",
    Outcome.UNCHANGED: "dim",
    Outcome.ROLLED_BACK: "yellow",
    Outcome.NOT_STARTED: "dim",
    Outcome.FAILED_PREPARE: "red",
    Outcome.FAILED: "red",
    Outcome.SKIPPED: "red",
}
# The fix for a host that did not end on the target.
FIX = {
    Outcome.ROLLED_BACK: "its committed version serves again and the target is marked failed there: fix what the "
    "failed check names (docs/verify.md) or roll out another image; --retry-failed tries this "
    "one again on purpose",
    Outcome.NOT_STARTED: "nothing changed on {host}: fix the host that stopped the rollout, then run it again",
    Outcome.FAILED_PREPARE: "nothing was swapped: fix what the detail names (the deploy output, --log, has the "
    "whole run), then run the rollout again",
    Outcome.FAILED: "`gpufleet history INVENTORY --host {host}` shows its ledger and the deploy output (--log) why; "
    "run the rollout again (a cut run resumes) or `gpufleet rollback INVENTORY --host {host}`",
    Outcome.SKIPPED: "{host} still serves its committed version: do what the detail says NVIDIA recommends, then run "
    "the rollout again (docs/gpu-health.md)",
}


@dataclass(frozen=True)
class SpeedResult:
    """A swap's speed check: the old version's figures, measured before it, and the new one's, as committed."""

    before: SpeedFigures | None
    after: SpeedFigures | None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        ratios = speed_ratios(self.before, self.after) if self.before and self.after else None
        return {
            "before": self.before.as_dict() if self.before else None,
            "after": self.after.as_dict() if self.after else None,
            "ratios": {k: round(v, 3) for k, v in ratios.items()} if ratios else None,
            "note": self.note or None,
        }

    def cell(self) -> str:
        """New over old per figure, e.g. "prefill 1.02x"."""
        if self.after is None:
            return "-"
        if self.before is None:
            return "recorded (no earlier figures)"
        ratios = speed_ratios(self.before, self.after)
        return ", ".join(f"{FIGURES[name][0]} {r:.2f}x" for name, r in ratios.items())


@dataclass(frozen=True)
class HostOutcome:
    host: str
    from_ref: str | None  # the committed digest before the rollout
    to_ref: str
    outcome: Outcome
    downtime_s: float | None = None  # stop to ready, measured from the controller
    detail: str = ""
    checks: tuple[tuple[str, bool], ...] = ()  # in order; none run after a failed one
    pull: PullStats | None = None
    start: CarryResult | None = None
    speed: SpeedResult | None = None

    @property
    def ok(self) -> bool:
        return self.outcome in OK

    @property
    def phase(self) -> str:
        """The host's last progress line; a failed host's carries its detail, so a piped log says why."""
        down = f" ({self.downtime_s:.1f} s down)" if self.downtime_s is not None else ""
        failed = (
            self.outcome in (Outcome.FAILED_PREPARE, Outcome.FAILED, Outcome.ROLLED_BACK, Outcome.SKIPPED)
            and self.detail
        )
        return f"{self.outcome.value}{down}" + (f": {self.detail}" if failed else "")

    def problems(self) -> list[dict[str, str]]:
        if self.ok:
            return []
        return [
            {
                "id": self.outcome.value,
                "message": self.detail or self.outcome.value,
                "fix": FIX[self.outcome].format(host=self.host),
            }
        ]

    def as_dict(self) -> dict[str, Any]:
        """The host's row of the --json document (docs/cli.md)."""
        return {
            "host": self.host,
            "ok": self.ok,
            "problems": self.problems(),
            "from": self.from_ref,
            "to": self.to_ref,
            "outcome": self.outcome.value,
            "downtime_s": None if self.downtime_s is None else round(self.downtime_s, 2),
            "detail": self.detail,
            "checks": [{"check": name, "ok": ok} for name, ok in self.checks],
            "speed": self.speed.as_dict() if self.speed else None,
            "site_bytes": self.pull.site_bytes if self.pull else None,
            "upstream_bytes": self.pull.upstream_bytes if self.pull else None,
            "fell_back": self.pull.fell_back if self.pull else None,
            **(self.start.as_dict() if self.start else dict.fromkeys(CarryResult().as_dict())),
        }

    @property
    def pulled_cell(self) -> str:
        """E.g. "105 MB site, 0 B upstream"."""
        if self.pull is None:
            return "-"
        parts = [
            f"{decimal(n)} {where}"
            for n, where in ((self.pull.site_bytes, "site"), (self.pull.upstream_bytes, "upstream"))
            if n is not None
        ]
        if self.pull.fell_back:
            parts.append("site cache missed")
        return ", ".join(parts) or "-"

    @property
    def checks_cell(self) -> str:
        """E.g. "6 passed, models failed"."""
        if not self.checks:
            return "-"
        passed = sum(ok for _, ok in self.checks)
        bad = [name for name, ok in self.checks if not ok]
        return f"{passed} passed" + (f", {bad[0]} failed" if bad else "")


def succeeded(outcomes: Sequence[HostOutcome]) -> bool:
    return all(o.ok for o in outcomes)


def short(ref: str | None) -> str:
    """repo@sha256:0123456789ab... -> sha256:0123456789ab."""
    if not ref:
        return "-"
    digest = ref.rsplit("@", 1)[-1]
    return digest[:19] if digest.startswith("sha256:") else ref


def table(outcomes: Sequence[HostOutcome], title: str | None = None) -> Table:
    t = Table(title=title, show_lines=False)
    for column in (
        "host",
        "from",
        "to",
        "outcome",
        "downtime",
        "checks",
        "speed (new/old)",
        "pulled",
        "start",
        "detail",
    ):
        t.add_column(column, overflow="fold")
    for o in outcomes:
        downtime = "-" if o.downtime_s is None else f"{o.downtime_s:.1f} s"
        # Text, never markup: details quote server output, whose "[...]" must not be parsed.
        t.add_row(
            Text(o.host),
            Text(short(o.from_ref)),
            Text(short(o.to_ref)),
            Text(o.outcome.value, style=STYLE[o.outcome]),
            Text(downtime),
            Text(o.checks_cell, style="red" if any(not ok for _, ok in o.checks) else ""),
            Text(o.speed.cell() if o.speed else "-"),
            Text(o.pulled_cell),
            Text(o.start.cell() if o.start else "-"),
            Text(o.detail),
        )
    return t
