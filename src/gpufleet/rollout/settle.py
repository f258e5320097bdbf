"""`gpufleet status --fix`: the routers' reconcile a rollout runs at its start and end, without a rollout."""

from __future__ import annotations

from gpufleet.inventory import load_roles
from gpufleet.rollout.hosts import Sessions, load_fleet
from gpufleet.rollout.ledgers import read_ledgers
from gpufleet.rollout.membership import members
from gpufleet.rollout.routers import Routers


def settle_routers(inventory: str) -> dict[str, str]:
    """Host or router -> what changed or failed there; raises GpufleetError for a router it cannot lock."""
    router_hosts = load_roles(inventory)[0]
    if not router_hosts:
        return {}
    hosts = load_fleet(inventory)
    names = [h.name for h in hosts]
    with Sessions(hosts) as sessions, Routers.connect(router_hosts, [(h.name, dict(h.data)) for h in hosts]) as routers:
        return routers.reconcile(members(sessions, names, read_ledgers(sessions, names)))
