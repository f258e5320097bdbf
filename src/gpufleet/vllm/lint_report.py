"""A fleet's lint findings folded into what `gpufleet lint` prints (docs/lint.md)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.errors import SettingError, one_line
from gpufleet.vllm.lint import SEVERITIES, Finding, Severity, acceptable_rule_ids, lint_accept

# A setting the deploy refuses. It is no rule and cannot be accepted.
INVALID_SETTING = "invalid-setting"


@dataclass(frozen=True)
class FleetFinding:
    """A finding and every host it fires on."""

    id: str  # a rule id, or INVALID_SETTING
    severity: Severity
    message: str
    fix: str
    hosts: tuple[str, ...]  # in inventory order

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "severity": self.severity,
            "message": self.message,
            "fix": self.fix,
            "hosts": list(self.hosts),
        }


@dataclass(frozen=True)
class LintReport:
    hosts: tuple[str, ...]  # the vLLM hosts, in inventory order
    routers: tuple[str, ...]
    findings: tuple[FleetFinding, ...]
    accepted: tuple[FleetFinding, ...] = ()  # by gpufleet_accept: never counted

    def count(self, severity: Severity) -> int:
        return sum(1 for finding in self.findings if finding.severity == severity)

    def exit_code(self, strict: bool = False) -> int:
        """1 when an error is found (under strict, a warning too), else 0."""
        failing = ("error", "warning") if strict else ("error",)
        return 1 if any(finding.severity in failing for finding in self.findings) else 0

    def where(self, finding: FleetFinding) -> str:
        """The hosts' names, or "all 3 hosts" (vLLM hosts, routers) for all of them."""
        hosts, count = set(finding.hosts), len(finding.hosts)
        if count > 1 and hosts == {*self.hosts, *self.routers}:
            return f"all {count} hosts"
        if count > 1 and self.routers and hosts == set(self.hosts):
            return f"all {count} vLLM hosts"
        if count > 1 and hosts == set(self.routers):
            return f"all {count} routers"
        return ", ".join(finding.hosts)

    def line(self, finding: FleetFinding, accepted: bool = False) -> str:
        """Who, severity, rule, what, fix."""
        where = self.where(finding)
        if finding.id == INVALID_SETTING:
            text = f"{where}: {finding.message} (fix: {finding.fix})"
        elif accepted:
            text = f"{where}: accepted {finding.severity} [{finding.id}] {finding.message}"
        else:
            text = f"{where}: {finding.severity} [{finding.id}] {finding.message} (fix: {finding.fix})"
        return one_line(text)

    def as_json(self, strict: bool = False) -> dict[str, Any]:
        return {
            "ok": self.exit_code(strict) == 0,
            "findings": [f.as_json() for f in self.findings],
            "accepted": [f.as_json() for f in self.accepted],
        }


# (id, severity, message, fix)
_Key = tuple[str, Severity, str, str]


def _fold(keyed: Iterable[tuple[str, _Key]]) -> tuple[FleetFinding, ...]:
    hosts: dict[_Key, list[str]] = {}
    for host, key in keyed:
        named = hosts.setdefault(key, [])
        if host not in named:
            named.append(host)
    folded = [FleetFinding(*key, hosts=tuple(named)) for key, named in hosts.items()]
    # Most severe first, one rule's lines together.
    first_seen = {key[0]: index for index, key in reversed(list(enumerate(hosts)))}
    return tuple(sorted(folded, key=lambda finding: (SEVERITIES.index(finding.severity), first_seen[finding.id])))


def fleet_report(
    findings: Iterable[Finding],
    accepted: Mapping[str, Collection[str]],
    hosts: Sequence[str],
    routers: Sequence[str] = (),
) -> LintReport:
    """Fold the findings; `accepted` is each host's gpufleet_accept, whose unknown ids are findings themselves."""
    every = [*findings, *(f for host in (*hosts, *routers) for f in lint_accept(host, accepted.get(host, ())))]
    acceptable = acceptable_rule_ids()  # not "unknown-accepted-rule": accepting it would accept every typo

    def keyed(accepting: bool) -> Iterable[tuple[str, _Key]]:
        for f in every:
            if (f.rule.id in acceptable and f.rule.id in accepted.get(f.host, ())) == accepting:
                yield f.host, (f.rule.id, f.rule.severity, f.rule.message, f.fix)

    return LintReport(tuple(hosts), tuple(routers), _fold(keyed(False)), _fold(keyed(True)))


def invalid_settings_report(
    errors: Iterable[SettingError], hosts: Sequence[str], routers: Sequence[str] = ()
) -> LintReport:
    """Settings the deploy refuses, as errors folded like findings."""
    error: Severity = "error"
    keyed = ((e.host, (INVALID_SETTING, error, f"{e.setting}: {e.problem}", e.fix)) for e in errors)
    return LintReport(tuple(hosts), tuple(routers), _fold(keyed))
