"""Every vLLM replica's validated spec, read from an inventory file offline (gpufleet.inventory splits the routers
from the replicas; a replica behind a router takes the router's flags): what `gpufleet render`, `status`, `verify`
and the rollout start from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpufleet.errors import GpufleetError, SettingErrors, one_line
from gpufleet.inventory import load_roles
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.spec import ServeSpec


def load_host_specs(inventory_path: str | Path, only_host: str | None = None) -> list[tuple[ServeSpec, dict[str, Any]]]:
    """[(validated spec, host data)] for every host (or one); raises SettingErrors listing every invalid setting."""
    routers, hosts = load_roles(inventory_path)
    if only_host is not None:
        hosts = [(name, data) for name, data in hosts if name == only_host]
        if not hosts:
            raise GpufleetError(one_line(f"{only_host}: no such host in {inventory_path} (fix: check --host)"))
    specs, errors = [], []
    for name, data in hosts:
        try:
            specs.append((build_spec(name, data, behind_router=bool(routers)), data))
        except SettingErrors as exc:
            errors += exc.errors
    if errors:
        raise SettingErrors(errors)
    return specs


def load_specs(inventory_path: str | Path, only_host: str | None = None) -> list[ServeSpec]:
    """Validated specs for every host (or one); raises SettingErrors listing every invalid setting."""
    return [spec for spec, _ in load_host_specs(inventory_path, only_host)]
