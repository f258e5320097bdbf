"""Read a pyinfra inventory offline (no SSH), with its group_data, exactly as pyinfra itself merges it.

Hosts in the `routers` group run vllm-router (gpufleet.router); every other host is a vLLM replica. The vLLM views
(render, lint, status, verify, rollout) read the replicas; the router deploy and status read both."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Importing pyinfra_cli runs gevent's monkey.patch_all(), which must happen before any thread or pyinfra State
# exists in the process ("cannot release un-acquired lock" otherwise): import it with this module, early.
from pyinfra.api import Host, Inventory, State
from pyinfra.context import ctx_state
from pyinfra_cli.inventory import make_inventory

from gpufleet.errors import GpufleetError, one_line

# Hosts in this pyinfra inventory group run the router (gpufleet.router); every other host is a vLLM replica.
ROUTERS_GROUP = "routers"

HostData = tuple[str, dict[str, Any]]


def load_pyinfra_hosts(inventory_path: str | Path) -> list[Host]:
    """Every host of the inventory, in order, as pyinfra's own loader makes them (groups and merged data)."""
    path = Path(inventory_path)
    if not path.is_file():
        raise GpufleetError(f"{inventory_path}: inventory file not found (fix: pass a path like inventories/lab.py)")
    # pyinfra's loader executes the file inside a pyinfra State context; set one up for the duration.
    with ctx_state.use(State()):
        try:
            inventory = make_inventory(str(path))
        except Exception as exc:  # the user's Python file: show its error on one line
            # pyinfra wraps an exception raised by the file in an error whose str() fails: show the original.
            cause = getattr(exc, "exception", exc)
            raise GpufleetError(one_line(f"{inventory_path}: cannot load inventory: {type(cause).__name__}: {cause}")) \
                from exc
        return list(inventory)


def split_roles(hosts: Iterable[Host]) -> tuple[list[HostData], list[HostData]]:
    """(routers, replicas) of pyinfra hosts, in inventory order, each as (name, merged host data)."""
    routers: list[HostData] = []
    replicas: list[HostData] = []
    for h in hosts:
        (routers if ROUTERS_GROUP in h.groups else replicas).append((h.name, h.data.dict()))
    return routers, replicas


def load_roles(inventory_path: str | Path) -> tuple[list[HostData], list[HostData]]:
    """(routers, replicas) of an inventory file."""
    return split_roles(load_pyinfra_hosts(inventory_path))


def group_orders(inventory: Inventory) -> dict[str, list[str]]:
    """Every inventory group's hosts in the group's order (a replica group's ranks: gpufleet.vllm.group)."""
    return {name: [h.name for h in hosts] for name, hosts in inventory.groups.items()}


def load_roles_and_groups(inventory_path: str | Path) -> tuple[list[HostData], list[HostData], dict[str, list[str]]]:
    """(routers, replicas, group_orders) of an inventory file, loaded once."""
    hosts = load_pyinfra_hosts(inventory_path)
    routers, replicas = split_roles(hosts)
    return routers, replicas, group_orders(hosts[0].inventory) if hosts else {}


def load_hosts(inventory_path: str | Path) -> list[HostData]:
    """[(host name, merged host data)] of the vLLM replicas (router hosts left out), in inventory order."""
    return load_roles(inventory_path)[1]


def behind_router(hosts: Iterable[Host]) -> bool:
    """Is there a router in front of the replicas (a host in the routers group)? Then each replica's spec takes
    gpufleet.vllm.settings.BEHIND_ROUTER_ARGS."""
    return any(ROUTERS_GROUP in h.groups for h in hosts)
