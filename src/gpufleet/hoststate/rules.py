"""Which ledger a service goes by, and the refusals the state dir's ledgers call for: pure functions over the texts
gpufleet.hoststate.reader brings back (the service's ledger, the other ledgers by path), the service's name and
port. The deploy (gpufleet.vllm.deploy) and the rollout (gpufleet.rollout.ledgers) apply the same ones, so both
see the same ledger on every host.

A renamed vllm_service has no ledger of its own yet: it takes over the one other service's ledger on its port, whose
committed version stays the rollback target (docs/crash-safety.md, "Service rename").
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import replace

from gpufleet.hoststate.ledger import CorruptLedger, Ledger, parse


def host_ledger(own: str | None, others: Mapping[str, str], port: int) -> Ledger:
    """The ledger the service goes by: its own file's (own: its text, None for no file), else the one it takes over
    on `port` (taken_over), else an empty one. Raises CorruptLedger for the service's own file only."""
    if own is not None:
        return parse(own)
    found = taken_over(others, port)
    return found[1] if found else Ledger()


def taken_over(others: Mapping[str, str], port: int) -> tuple[str, Ledger] | None:
    """The one other ledger (path, ledger) that a service with none of its own takes over: committed on `port`,
    nothing pending; its committed version names its service. None when no other ledger is, or more than one."""
    found = []
    for path, text in others.items():
        try:
            other = parse(text)
        except CorruptLedger:
            continue  # another service's problem: its own deploy refuses it
        committed = other.committed
        if committed is not None and other.pending is None and committed.version.port == port:
            # A ledger migrated from the old format does not name its service: its file does.
            service = committed.version.service or _service_of(path)
            found.append((path, replace(other, committed=replace(committed, version=replace(committed.version,
                                                                                            service=service)))))
    return found[0] if len(found) == 1 else None


def replaced_service(ledger: Ledger, service: str) -> str | None:
    """The service a renamed `service` replaces: the committed version's, when it is another."""
    committed = ledger.committed.version.service if ledger.committed else None
    return committed if committed and committed != service else None


def cut_rename_away(name: str, others: Mapping[str, str], service: str) -> str | None:
    """The refusal for a host where a run renaming `service` to another name was cut before it finished: the other
    service's ledger holds this service's version committed (it took this ledger over) and its own version pending,
    its unit is installed and maybe running. Converging `service` now would start a second vLLM on the same GPUs
    with nothing to roll back to; converging the other name settles the rename (finished, or rolled back to this
    service)."""
    for path, text in sorted(others.items()):
        try:
            other = parse(text)
        except CorruptLedger:
            continue  # another service's problem: its own deploy refuses it
        if other.pending is None or other.committed is None or other.committed.version.service != service:
            continue
        renamed_to = other.pending.version.service or _service_of(path)
        return (f"{name}: a run renaming vllm_service {service!r} to {renamed_to!r} was cut before it finished "
                f"({renamed_to} has {other.pending.version.ref} pending): converging {service!r} now would start a "
                f"second vLLM on the same GPUs (fix: converge once with vllm_service={renamed_to!r}: it finishes the "
                f"rename, or rolls it back to {service!r}; then converge with the name you want)")
    return None


def changed_since_read(name: str, ledger: Ledger, expected: Mapping[str, str | None] | None) -> str | None:
    """The refusal for a host whose committed version is not the one a rollout read when it started (None: no
    expectation for this host, or it holds). `ledger`: the one the service goes by (host_ledger), as the rollout
    read it. Checked under the run's lock: nothing can change it before the swap."""
    if expected is None or name not in expected:
        return None
    have = ledger.committed.version.ref if ledger.committed else None
    if have == expected[name]:
        return None
    return (f"{name}: its ledger has {have or 'no version'} committed, the rollout read {expected[name] or 'none'} "
            "when it started: another run changed the host since (fix: run the rollout again: it reads every host "
            "anew)")


def _service_of(path: str) -> str:
    """The service a ledger file is named after (<state dir>/<service>.json)."""
    return posixpath.basename(path).removesuffix(".json")
