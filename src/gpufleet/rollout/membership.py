"""Who belongs in the routers' worker sets: a replica whose ledger has a committed version and nothing pending, and
that answers ready now (the check `gpufleet verify` runs) from that committed digest. The rollout reconciles every router with this at its
start and its end, so a controller killed between a replica's leave and its rejoin strands nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpufleet.health.check import HealthReport, HealthState, check, committed_drift
from gpufleet.remote.transport import SshTransport
from gpufleet.rollout.ledgers import HostLedger
from gpufleet.rollout.replicas import FleetHost, Sessions
from gpufleet.wire.identity import Expected

# States that say nothing for or against a replica (a blip, a start still under way): the routers keep it as it is.
UNDECIDED = (HealthState.SSH_UNREACHABLE, HealthState.STARTING)


def belongs(ledger: HostLedger, state: HealthState | None, runs_committed: bool = True) -> bool | None:
    """True: in every router; False: in none; None: not known (left as it is). runs_committed: what answers is the
    committed digest."""
    if ledger.error is not None:
        return None
    if ledger.committed_ref is None or ledger.pending_ref is not None:
        return False  # never committed, or a swap that ended neither committed nor rolled back
    if state is None or state in UNDECIDED:
        return None
    return state is HealthState.READY and runs_committed


def runs_committed(ledger: HostLedger, report: HealthReport) -> bool:
    """Is the container that answers started from the digest the ledger has committed?"""
    c = report.container
    return c is not None and c.running and committed_drift(ledger.committed_ref, c) is None


def look(host: FleetHost, transport: SshTransport) -> HealthReport:
    """The check `gpufleet verify` runs, once, on a replica."""
    return check(transport, Expected.from_spec(host.spec), api_key=host.api_key)


def members(sessions: Sessions, names: Sequence[str], ledgers: Mapping[str, HostLedger]) -> dict[str, bool | None]:
    """belongs() for every named replica, each looked at once over its own session, all at once."""
    looks = sessions.each(names, look)
    return {name: belongs(ledgers[name], seen.state, runs_committed(ledgers[name], seen))
            if isinstance(seen, HealthReport) else belongs(ledgers[name], None) for name, seen in looks.items()}
