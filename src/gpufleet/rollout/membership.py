"""Who belongs in the routers' worker sets (docs/rollout.md)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from gpufleet.facts.gpu_verdict import HostGpus
from gpufleet.health.check import HealthReport, HealthState, check, committed_drift
from gpufleet.health.runner import rank_health
from gpufleet.remote.transport import SshTransport
from gpufleet.rollout import gpu
from gpufleet.rollout.hosts import FleetHost, Sessions
from gpufleet.rollout.ledgers import HostLedger
from gpufleet.wire.identity import Expected

# A blip or a start under way: the routers keep the replica as it is.
UNDECIDED = (HealthState.SSH_UNREACHABLE, HealthState.STARTING)


def belongs(ledger: HostLedger, state: HealthState | None, runs_committed: bool = True) -> bool | None:
    """True: in every router; False: in none; None: left as it is."""
    if ledger.error is not None:
        return None
    if ledger.committed_ref is None or ledger.pending_ref is not None:
        return False  # never committed, or a swap left unfinished
    if state is None or state in UNDECIDED:
        return None
    return state is HealthState.READY and runs_committed


def runs_committed(ledger: HostLedger, report: HealthReport) -> bool:
    c = report.container
    return c is not None and c.running and committed_drift(ledger.committed_ref, c) is None


def look(host: FleetHost, transport: SshTransport) -> HealthReport:
    """The check `gpufleet verify` runs, once, on a replica."""
    member = host.spec.group
    if member is not None and not member.is_head:
        expected = replace(Expected.from_spec(host.spec), spec_hash=host.spec.spec_hash)
        return rank_health(transport, expected, host.name, (member.group, member.rank, member.head))
    return check(transport, Expected.from_spec(host.spec), api_key=host.api_key)


def gpus_fit(gpus: HostGpus | None, used: Collection[int]) -> bool | None:
    """False when a GPU the replica uses needs an action; None: not known."""
    if gpus is None or gpus.error is not None:
        return None
    return not gpus.blocking(used)


def members(sessions: Sessions, names: Sequence[str], ledgers: Mapping[str, HostLedger]) -> dict[str, bool | None]:
    """belongs() for every named replica, False where gpus_fit() is, looked at in parallel."""

    def look_with_gpus(host: FleetHost, transport: SshTransport) -> tuple[HealthReport, HostGpus | None]:
        report = look(host, transport)
        started = report.container.started_at if report.container else None
        return report, gpu.look(host, transport, started)

    found = {}
    for name, seen in sessions.each(names, look_with_gpus).items():
        report, gpus = seen if isinstance(seen, tuple) else (None, None)
        fit = gpus_fit(gpus, sessions.hosts[name].spec.gpus)
        found[name] = (
            False
            if fit is False
            else belongs(ledgers[name], None)
            if report is None
            else belongs(ledgers[name], report.state, runs_committed(ledgers[name], report))
        )
    return found
