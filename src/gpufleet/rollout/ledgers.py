"""Each host's ledger, read over SSH with the deploy's own reader and rules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpufleet.hoststate import reader, sections
from gpufleet.hoststate.ledger import CorruptLedger, Failed, Ledger, corrupt_refusal
from gpufleet.hoststate.paths import ledger_path
from gpufleet.hoststate.rules import host_ledger, taken_over
from gpufleet.remote.transport import SshTransport
from gpufleet.rollout.hosts import FleetHost, Sessions, shell


@dataclass(frozen=True)
class HostLedger:
    host: str
    path: str  # the service's ledger, or the one a renamed service takes over
    ledger: Ledger | None  # None: never converged, or unreadable (see error)
    error: str | None = None

    @property
    def committed_ref(self) -> str | None:
        c = self.ledger.committed if self.ledger else None
        return c.version.ref if c else None

    @property
    def committed_model(self) -> str | None:
        """repo@commit, when the ledger records one."""
        c = self.ledger.committed if self.ledger else None
        return c.version.model if c else None

    @property
    def pending_ref(self) -> str | None:
        p = self.ledger.pending if self.ledger else None
        return p.version.ref if p else None

    def failed_mark(self, ref: str, model: str | None = None) -> Failed | None:
        """The newest mark on `ref` that holds for `model` (None: any model)."""
        marks = self.ledger.failed if self.ledger else ()
        return next((f for f in reversed(marks) if f.ref == ref and f.holds_for(model)), None)

    def model_at(self, model_sha: str | None) -> str | None:
        """The repo@commit a rollout installs here: `model_sha` of the committed repo, else the committed one."""
        if model_sha is None or self.committed_model is None:
            return self.committed_model
        return f"{self.committed_model.rpartition('@')[0]}@{model_sha}"

    def previous_ref(self) -> str | None:
        """What `rollback` goes back to."""
        history = self.ledger.history if self.ledger else ()
        return next((c.version.ref for c in reversed(history) if c.version.ref != self.committed_ref), None)


def parse_read(host: str, service: str, port: int, rc: int, out: str, err: str) -> HostLedger:
    """Parse reader.read_command's answer for the service on `port`."""
    path = ledger_path(service)
    if rc != 0:
        return HostLedger(host, path, None, f"cannot read {path}: {(err or out).strip()[:200] or f'exit {rc}'}")
    try:
        texts = reader.read_output(out.splitlines())
    except sections.Truncated as e:
        return HostLedger(host, path, None, f"cannot read {path}: the reading's output is truncated ({e})")
    except sections.Forged as e:
        return HostLedger(host, path, None, f"cannot read {path}: the reading refused: {e}")
    if texts.own is None:
        # No file of its own: report the ledger it takes over, with that path.
        found = taken_over(texts.others, port)
        return HostLedger(host, found[0], found[1]) if found else HostLedger(host, path, None)
    try:
        return HostLedger(host, path, host_ledger(texts.own, texts.others, port))
    except CorruptLedger as e:
        return HostLedger(host, path, None, corrupt_refusal(host, path, e))


def read_one(host: FleetHost, transport: SshTransport) -> HostLedger:
    rc, out, err = shell(transport, reader.read_command(ledger_path(host.spec.service)), root=True)
    return parse_read(host.name, host.spec.service, host.spec.port, rc, out, err)


def read_ledgers(sessions: Sessions, names: Sequence[str]) -> dict[str, HostLedger]:
    """Every named host's ledger in parallel; an unreachable host's carries its error."""
    out: dict[str, HostLedger] = {}
    for name, value in sessions.each(names, read_one).items():
        if isinstance(value, HostLedger):
            out[name] = value
        else:
            out[name] = HostLedger(name, ledger_path(sessions.hosts[name].spec.service), None, value)
    return out
