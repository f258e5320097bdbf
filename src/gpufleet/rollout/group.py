"""A replica group as one replica of a rollout (docs/multi-node.md)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from gpufleet.rollout.hosts import FleetHost
from gpufleet.vllm.group import Member


def _member(hosts: Mapping[str, FleetHost], name: str) -> Member | None:
    found = hosts.get(name)
    return found.spec.group if found is not None else None


def in_group(hosts: Mapping[str, FleetHost], name: str) -> bool:
    return _member(hosts, name) is not None


def ranks(hosts: Mapping[str, FleetHost], name: str) -> tuple[str, ...]:
    """The host's group in rank order, or the host alone."""
    member = _member(hosts, name)
    return member.hosts if member is not None else (name,)


def is_worker(hosts: Mapping[str, FleetHost], name: str) -> bool:
    """What a router routes to: a lone replica or a group's head."""
    member = _member(hosts, name)
    return member is None or member.is_head


def workers(hosts: Iterable[FleetHost]) -> list[FleetHost]:
    return [h for h in hosts if h.spec.group is None or h.spec.group.is_head]


def done(on_target: Collection[str], hosts: Mapping[str, FleetHost]) -> set[str]:
    """A group's hosts are done only when every rank is."""
    return {h for h in on_target if all(r in on_target for r in ranks(hosts, h))}


def skipped(sick: Mapping[str, str], hosts: Mapping[str, FleetHost]) -> dict[str, str]:
    """Skip every rank of a group one of whose hosts is skipped."""
    out = dict(sick)
    for name in sick:
        for rank in ranks(hosts, name):
            out.setdefault(rank, f"not swapped: {name}, a rank of its group, is skipped for its GPUs")
    return out


def units(order: Sequence[str], hosts: Mapping[str, FleetHost]) -> list[list[str]]:
    """`order` as replicas: each group once, at its first host, head first."""
    seen: set[str] = set()
    out: list[list[str]] = []
    for name in order:
        if name not in seen:
            unit = list(ranks(hosts, name))
            seen.update(unit)
            out.append(unit)
    return out


def expand(order: Sequence[str], hosts: Mapping[str, FleetHost]) -> list[str]:
    return [name for unit in units(order, hosts) for name in unit]


def canaries(order: Sequence[str], hosts: Mapping[str, FleetHost], canary: int) -> set[str]:
    return {name for unit in units(order, hosts)[:canary] for name in unit}
