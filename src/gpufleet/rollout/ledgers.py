"""Each host's ledger (gpufleet.hoststate.ledger, /var/lib/gpufleet/<service>.json), read over SSH: what is committed on
it, what a cut run left pending, which versions failed and why. The rollout decides from it; `history` shows it."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from gpufleet.hoststate.ledger import CorruptLedger, Failed, Ledger, corrupt_refusal, parse
from gpufleet.hoststate.paths import ledger_path
from gpufleet.remote.transport import SshTransport
from gpufleet.rollout.replicas import FleetHost, Sessions, run

PRESENT = "@@gpufleet-ledger"


@dataclass(frozen=True)
class HostLedger:
    host: str
    path: str
    ledger: Ledger | None  # None: no ledger file (never converged), or unreadable (error says why)
    error: str | None = None

    @property
    def committed_ref(self) -> str | None:
        c = self.ledger.committed if self.ledger else None
        return c.version.ref if c else None

    @property
    def pending_ref(self) -> str | None:
        p = self.ledger.pending if self.ledger else None
        return p.version.ref if p else None

    def failed_mark(self, ref: str) -> Failed | None:
        marks = self.ledger.failed if self.ledger else ()
        return next((f for f in reversed(marks) if f.ref == ref), None)

    def previous_ref(self) -> str | None:
        """The newest earlier committed digest other than the committed one (what `rollback` goes back to)."""
        history = self.ledger.history if self.ledger else ()
        return next((c.version.ref for c in reversed(history) if c.version.ref != self.committed_ref), None)


def parse_read(host: str, path: str, rc: int, out: str, err: str) -> HostLedger:
    """The reading command's answer: the marker line, then the file; no marker = no file."""
    if rc != 0:
        return HostLedger(host, path, None, f"cannot read {path}: {(err or out).strip()[:200] or f'exit {rc}'}")
    lines = out.splitlines()
    if not lines or lines[0] != PRESENT:
        return HostLedger(host, path, None)
    try:
        return HostLedger(host, path, parse("\n".join(lines[1:]) + "\n"))
    except CorruptLedger as e:
        return HostLedger(host, path, None, corrupt_refusal(host, path, e))


def read_one(host: FleetHost, transport: SshTransport) -> HostLedger:
    path = ledger_path(host.spec.service)
    q = shlex.quote(path)
    rc, out, err = run(transport, f"if [ -f {q} ]; then echo {PRESENT} && cat {q}; fi", root=True)
    return parse_read(host.name, path, rc, out, err)


def read_ledgers(sessions: Sessions, names: Sequence[str]) -> dict[str, HostLedger]:
    """Every named host's ledger at once; a host that cannot be reached is a HostLedger with its error."""
    out: dict[str, HostLedger] = {}
    for name, value in sessions.each(names, read_one).items():
        if isinstance(value, HostLedger):
            out[name] = value
        else:
            out[name] = HostLedger(name, ledger_path(sessions.hosts[name].spec.service), None, value)
    return out
