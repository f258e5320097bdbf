"""Which ledger a service goes by, and the refusals other ledgers call for."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import replace

from gpufleet.hoststate.ledger import CorruptLedger, Ledger, parse


def host_ledger(own: str | None, others: Mapping[str, str], port: int) -> Ledger:
    """Its own ledger, else the one it takes over, else an empty one; only its own raises CorruptLedger."""
    if own is not None:
        return parse(own)
    found = taken_over(others, port)
    return found[1] if found else Ledger()


def taken_over(others: Mapping[str, str], port: int) -> tuple[str, Ledger] | None:
    """The one other ledger committed on `port` with nothing pending, if exactly one."""
    found = []
    for path, text in others.items():
        try:
            other = parse(text)
        except CorruptLedger:
            continue  # its own deploy refuses it
        committed = other.committed
        if committed is not None and other.pending is None and committed.version.port == port:
            # A migrated ledger names no service; its file does.
            service = committed.version.service or _service_of(path)
            found.append(
                (
                    path,
                    replace(other, committed=replace(committed, version=replace(committed.version, service=service))),
                )
            )
    return found[0] if len(found) == 1 else None


def replaced_service(ledger: Ledger, service: str) -> str | None:
    """The service a renamed `service` replaces."""
    committed = ledger.committed.version.service if ledger.committed else None
    return committed if committed and committed != service else None


def cut_rename_away(name: str, others: Mapping[str, str], service: str) -> str | None:
    """The refusal when a run renaming `service` away was cut."""
    for path, text in sorted(others.items()):
        try:
            other = parse(text)
        except CorruptLedger:
            continue
        if other.pending is None or other.committed is None or other.committed.version.service != service:
            continue
        renamed_to = other.pending.version.service or _service_of(path)
        return (
            f"{name}: a run renaming vllm_service {service!r} to {renamed_to!r} was cut before it finished "
            f"({renamed_to} has {other.pending.version.ref} pending): converging {service!r} now would start a "
            f"second vLLM on the same GPUs (fix: converge once with vllm_service={renamed_to!r}: it finishes the "
            f"rename, or rolls it back to {service!r}; then converge with the name you want)"
        )
    return None


def changed_since_read(name: str, ledger: Ledger, expected: Mapping[str, str | None] | None) -> str | None:
    """The refusal when the committed version changed since the rollout read it; call it under the lock."""
    if expected is None or name not in expected:
        return None
    have = ledger.committed.version.ref if ledger.committed else None
    if have == expected[name]:
        return None
    return (
        f"{name}: its ledger has {have or 'no version'} committed, the rollout read {expected[name] or 'none'} "
        "when it started: another run changed the host since (fix: run the rollout again: it reads every host "
        "anew)"
    )


def _service_of(path: str) -> str:
    return posixpath.basename(path).removesuffix(".json")
