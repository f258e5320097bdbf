"""Every vLLM host's validated spec, read offline from an inventory file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpufleet.errors import GpufleetError, SettingErrors, one_line
from gpufleet.inventory import load_roles_and_groups
from gpufleet.vllm.group_specs import resolve_hosts
from gpufleet.vllm.spec import ServeSpec


def load_host_specs(inventory_path: str | Path, only_host: str | None = None) -> list[tuple[ServeSpec, dict[str, Any]]]:
    """[(validated spec, host data)] for every host, or one; raises SettingErrors listing every invalid setting."""
    routers, hosts, groups = load_roles_and_groups(inventory_path)
    if only_host is not None and only_host not in dict(hosts):
        raise GpufleetError(one_line(f"{only_host}: no such host in {inventory_path} (fix: check --host)"))
    resolved, errors = resolve_hosts(hosts, groups, bool(routers), only=None if only_host is None else [only_host])
    if errors:
        raise SettingErrors(errors)
    return [
        (resolved[name][0], data)
        for name, data in hosts
        if name in resolved and (only_host is None or name == only_host)
    ]


def load_specs(inventory_path: str | Path, only_host: str | None = None) -> list[ServeSpec]:
    """Validated specs for every host, or one; raises SettingErrors."""
    return [spec for spec, _ in load_host_specs(inventory_path, only_host)]
