"""vLLM hosts resolved with their groups: a replica group's ranks built together, so each knows every rank's spec hash."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpufleet.errors import SettingError, SettingErrors
from gpufleet.vllm.group import members
from gpufleet.vllm.settings import VllmSettings, merged_settings, resolve_host
from gpufleet.vllm.spec import ServeSpec

Resolved = dict[str, tuple[ServeSpec, VllmSettings]]


def resolve_hosts(
    vllm_hosts: Sequence[tuple[str, Mapping[str, Any]]],
    orders: Mapping[str, Sequence[str]],
    behind_router: bool,
    *,
    only: Collection[str] | None = None,
) -> tuple[Resolved, list[SettingError]]:
    """{host: (spec, settings)} for `only` (default: every host) and their groups' ranks, and every problem. A
    group with a problem on any rank has no spec on any."""
    found, errors = members(vllm_hosts, orders, merged_settings)
    wanted = set(only) if only is not None else {name for name, _ in vllm_hosts}
    if only is not None:  # a wanted host's group's problems are its own
        by_name = dict(vllm_hosts)
        claimed = {merged_settings(by_name[name]).get("vllm_group") for name in wanted if name in by_name}
        wanted |= {h for group, hosts in orders.items() if group in claimed for h in hosts if h in by_name}
        errors = [e for e in errors if e.host in wanted]
    resolved: Resolved = {}
    for name, data in vllm_hosts:
        if name not in wanted:
            continue
        try:
            resolved[name] = resolve_host(name, data, behind_router=behind_router, member=found.get(name))
        except SettingErrors as exc:
            errors += exc.errors
    for member in {m.group: m for m in found.values() if m.head in wanted}.values():
        if not all(h in resolved for h in member.hosts):
            for h in member.hosts:
                resolved.pop(h, None)
            continue
        hashes = tuple(resolved[h][0].spec_hash for h in member.hosts)
        for h in member.hosts:
            spec, settings = resolved[h]
            assert spec.group is not None
            resolved[h] = (replace(spec, group=replace(spec.group, spec_hashes=hashes)), settings)
    return resolved, errors


def resolve_one(
    name: str,
    vllm_hosts: Sequence[tuple[str, Mapping[str, Any]]],
    orders: Mapping[str, Sequence[str]],
    behind_router: bool,
) -> tuple[ServeSpec, VllmSettings]:
    """One host's spec and settings; raises SettingErrors naming every problem of the host and its group."""
    resolved, errors = resolve_hosts(vllm_hosts, orders, behind_router, only=[name])
    if errors:
        raise SettingErrors(errors)
    return resolved[name]
