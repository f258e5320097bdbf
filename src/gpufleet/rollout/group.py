"""A rollout's replica groups (docs/multi-node.md): a group is one replica of the rollout. Its ranks swap in one
deploy run, which restarts them, verifies through the head and commits or rolls back every rank; the head alone is
the routers' worker and the one drained and watched; the group is done only when every rank committed the target,
so a controller killed between the ranks' commits swaps the whole group again."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from gpufleet.rollout.replicas import FleetHost
from gpufleet.vllm.group import Member


def _member(hosts: Mapping[str, FleetHost], name: str) -> Member | None:
    found = hosts.get(name)
    return found.spec.group if found is not None else None


def in_group(hosts: Mapping[str, FleetHost], name: str) -> bool:
    return _member(hosts, name) is not None


def ranks(hosts: Mapping[str, FleetHost], name: str) -> tuple[str, ...]:
    """The host's group's hosts in rank order (the host alone when it is a replica of its own)."""
    member = _member(hosts, name)
    return member.hosts if member is not None else (name,)


def is_worker(hosts: Mapping[str, FleetHost], name: str) -> bool:
    """Does a router route to it: a replica of its own, or a group's head (the other ranks serve no API)."""
    member = _member(hosts, name)
    return member is None or member.is_head


def workers(hosts: Iterable[FleetHost]) -> list[FleetHost]:
    return [h for h in hosts if h.spec.group is None or h.spec.group.is_head]


def done(on_target: Collection[str], hosts: Mapping[str, FleetHost]) -> set[str]:
    """The hosts on their target that are done: a group's only when every rank is."""
    return {h for h in on_target if all(r in on_target for r in ranks(hosts, h))}


def skipped(sick: Mapping[str, str], hosts: Mapping[str, FleetHost]) -> dict[str, str]:
    """The hosts a rollout skips for their GPUs (host -> why): a group's every rank when one is, since its swap
    restarts them all."""
    out = dict(sick)
    for name in sick:
        for rank in ranks(hosts, name):
            out.setdefault(rank, f"not swapped: {name}, a rank of its group, is skipped for its GPUs")
    return out


def units(order: Sequence[str], hosts: Mapping[str, FleetHost]) -> list[list[str]]:
    """`order` as the rollout's replicas: each group once, where its first host comes, with every rank (head first)."""
    seen: set[str] = set()
    out: list[list[str]] = []
    for name in order:
        if name not in seen:
            unit = list(ranks(hosts, name))
            seen.update(unit)
            out.append(unit)
    return out


def expand(order: Sequence[str], hosts: Mapping[str, FleetHost]) -> list[str]:
    """`order` with each group's ranks together, head first."""
    return [name for unit in units(order, hosts) for name in unit]


def canaries(order: Sequence[str], hosts: Mapping[str, FleetHost], canary: int) -> set[str]:
    """Every host of the first `canary` replicas."""
    return {name for unit in units(order, hosts)[:canary] for name in unit}
