"""Read a pyinfra inventory offline, its data merged as pyinfra merges it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

# pyinfra_cli runs gevent's patch_all(), which must precede any thread: import this module early.
from pyinfra.api import Host, Inventory, State
from pyinfra.context import ctx_state
from pyinfra_cli.inventory import make_inventory

from gpufleet.errors import GpufleetError, one_line

ROUTERS_GROUP = "routers"  # every other host is a vLLM host

HostData = tuple[str, dict[str, Any]]


def load_pyinfra_hosts(inventory_path: str | Path) -> list[Host]:
    """The inventory's hosts, in order, as pyinfra loads them."""
    path = Path(inventory_path)
    if not path.is_file():
        raise GpufleetError(f"{inventory_path}: inventory file not found (fix: pass a path like inventories/lab.py)")
    with ctx_state.use(State()):
        try:
            inventory = make_inventory(str(path))
        except Exception as exc:
            # pyinfra's wrapper fails str(); name its cause.
            cause = getattr(exc, "exception", exc)
            raise GpufleetError(
                one_line(f"{inventory_path}: cannot load inventory: {type(cause).__name__}: {cause}")
            ) from exc
        return list(inventory)


def split_roles(hosts: Iterable[Host]) -> tuple[list[HostData], list[HostData]]:
    """(routers, vLLM hosts) of pyinfra hosts, in inventory order."""
    routers: list[HostData] = []
    vllm_hosts: list[HostData] = []
    for h in hosts:
        (routers if ROUTERS_GROUP in h.groups else vllm_hosts).append((h.name, h.data.dict()))
    return routers, vllm_hosts


def load_roles(inventory_path: str | Path) -> tuple[list[HostData], list[HostData]]:
    return split_roles(load_pyinfra_hosts(inventory_path))


def group_orders(inventory: Inventory) -> dict[str, list[str]]:
    """Every group's hosts in order: a replica group's ranks."""
    return {name: [h.name for h in hosts] for name, hosts in inventory.groups.items()}


def load_roles_and_groups(inventory_path: str | Path) -> tuple[list[HostData], list[HostData], dict[str, list[str]]]:
    hosts = load_pyinfra_hosts(inventory_path)
    routers, vllm_hosts = split_roles(hosts)
    return routers, vllm_hosts, group_orders(hosts[0].inventory) if hosts else {}


def load_vllm_hosts(inventory_path: str | Path) -> list[HostData]:
    """The vLLM hosts, in inventory order."""
    return load_roles(inventory_path)[1]


def behind_router(hosts: Iterable[Host]) -> bool:
    return any(ROUTERS_GROUP in h.groups for h in hosts)
