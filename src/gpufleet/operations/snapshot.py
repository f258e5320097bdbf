"""The one value operations share per host: the snapshot, and the image digest resolved while executing.

pyinfra 3.x has no fact cache: every host.get_fact() runs its command again, one SSH round trip each, and an
operation runs its generator twice (once to plan, once to execute). So the deploy reads the GpufleetHost fact once
per host (gpufleet.harness.preflight), sets it here, and every operation decides from it; both runs of an
operation then see the same snapshot, and execute the commands the plan announced. Everything else an operation
needs is an argument.

The host's ledger (gpufleet.hoststate.ledger) is read with the snapshot and kept here too: the deploy settles it before
anything runs, and the functions that begin, commit or roll back a version while executing write it and keep the
new value here, so every later step of the run decides from what is on the host now.

The digest a tag resolves to exists only once `docker pull` ran, inside the image operation's FunctionCommand.
The unit must run that digest, and the unit operation's generator runs again at execution time, after the pull:
so the image operation records the digest here (`resolved_image_ref`) and the unit operation renders from it.
Passing it as an argument cannot work: arguments are fixed when the deploy file is read, before anything executes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

from pyinfra.api import Host, State
from pyinfra.context import ctx_host

from gpufleet.hoststate.ledger import Ledger
from gpufleet.vllm.facts import HostSnapshot


@dataclass
class HostMemo:
    snapshot: HostSnapshot
    resolved_image_ref: str | None = None  # repo@sha256:..., set by gpufleet.vllm.operations.image while executing
    ledger: Ledger = field(default_factory=Ledger)  # the host's ledger as this run last read or wrote it
    # path -> sha256 of each ledger file as this run read it under the host's lock or last wrote it (None: no file):
    # a ledger write is compare-and-swap on it (gpufleet.vllm.operations.service.save_ledger). A path not listed is
    # written without the comparison.
    ledger_sha256: dict[str, str | None] = field(default_factory=dict)
    pin: str | None = None  # the digest this run installs when known before the pull (gpufleet.vllm.operations.image)
    retry_failed: bool = False  # gpufleet_retry_failed: begin() clears the target's failure marks


# Keyed by the run's State (dropped with it), then by host name.
_MEMOS: WeakKeyDictionary[State, dict[str, HostMemo]] = WeakKeyDictionary()


def remember(host: Host, snapshot: HostSnapshot) -> HostMemo:
    """Set the host's snapshot for this run (the deploy's preflight does; a test can, too)."""
    memo = _MEMOS.setdefault(host.state, {})[host.name] = HostMemo(snapshot)
    return memo


def memo(host: Host | None = None) -> HostMemo:
    host = host or ctx_host.get()
    try:
        return _MEMOS[host.state][host.name]
    except KeyError:
        raise RuntimeError(f"{host.name}: gpufleet operations decide from the host snapshot: read it first "
                           "(gpufleet.harness.preflight.preflight, or gpufleet.operations.snapshot.remember)") from None


def snapshot(host: Host | None = None) -> HostSnapshot:
    return memo(host).snapshot
