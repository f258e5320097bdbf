"""An inventory's routers and replicas: hosts in the `routers` group, and every other host."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pyinfra.api import Host, State
from pyinfra.context import ctx_state
from pyinfra_cli.inventory import make_inventory

from gpufleet.errors import GpufleetError, one_line
from gpufleet.router import ROUTERS_GROUP

HostData = tuple[str, dict[str, Any]]


def split(hosts: Iterable[Host]) -> tuple[list[HostData], list[HostData]]:
    """(routers, replicas) of pyinfra hosts, in inventory order, each as (name, merged host data)."""
    routers: list[HostData] = []
    replicas: list[HostData] = []
    for h in hosts:
        (routers if ROUTERS_GROUP in h.groups else replicas).append((h.name, h.data.dict()))
    return routers, replicas


def load(inventory_path: str | Path) -> tuple[list[HostData], list[HostData]]:
    """(routers, replicas) of an inventory file, read offline with pyinfra's own loader."""
    path = Path(inventory_path)
    if not path.is_file():
        raise GpufleetError(f"{inventory_path}: inventory file not found (fix: pass a path like inventories/lab.py)")
    with ctx_state.use(State()):
        try:
            inventory = make_inventory(str(path))
        except Exception as exc:  # the user's Python file: its error on one line
            cause = getattr(exc, "exception", exc)
            raise GpufleetError(one_line(f"{inventory_path}: cannot load inventory: {type(cause).__name__}: {cause}")) \
                from exc
        return split(inventory)
