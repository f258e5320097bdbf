"""The routers put in step without a rollout (`gpufleet status --fix`): the reconcile a rollout runs at its start and
its end, under each router host's lock. A worker that is no replica of the inventory goes, a replica that belongs
(gpufleet.rollout.membership) comes back, one that does not goes."""

from __future__ import annotations

from gpufleet.inventory import load_roles
from gpufleet.rollout.ledgers import read_ledgers
from gpufleet.rollout.membership import members
from gpufleet.rollout.replicas import Sessions, load_fleet
from gpufleet.rollout.routers import Routers


def settle_routers(inventory: str) -> dict[str, str]:
    """Host (or router) -> one line of what changed or failed there; {} when there is no router or nothing to do.
    Raises GpufleetError with one line when a router cannot be reached or locked (a rollout holds it)."""
    router_hosts = load_roles(inventory)[0]
    if not router_hosts:
        return {}
    hosts = load_fleet(inventory)
    names = [h.name for h in hosts]
    with Sessions(hosts) as sessions, Routers.connect(router_hosts, [(h.name, dict(h.data)) for h in hosts]) as routers:
        return routers.reconcile(members(sessions, names, read_ledgers(sessions, names)))
