"""What a router is doing, for `gpufleet status`: its workers, which are healthy, and its routing metrics."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gpufleet.health.api import fetch
from gpufleet.remote.ssh import open_ssh
from gpufleet.remote.transport import Transport, Unreachable
from gpufleet.router.api import Router, RouterError
from gpufleet.router.settings import RouterSettings, router_settings
from gpufleet.router.spec import members_path
from gpufleet.vllm.spec import reach_address
from gpufleet.wire.evidence import excerpt


@dataclass(frozen=True)
class WorkerRow:
    url: str
    healthy: bool
    load: int | None
    routed: int  # requests the policy sent there
    running: int | None  # in flight there now


@dataclass(frozen=True)
class RouterStatus:
    name: str
    state: str  # ready, not-ready, unreachable (SSH), down
    detail: str = ""
    policy: str | None = None
    workers: tuple[WorkerRow, ...] = ()
    requests: int | None = None  # received, all routes
    prefix_outcomes: dict[str, int] = field(default_factory=dict)  # cache_aware's
    # The client port's /health status, or why nothing answered; "" when not looked at.
    front_door: str = ""
    fenced: bool | None = None  # None when not known

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read(router: Router, policy: str | None = None) -> RouterStatus:
    """One look at a router; never raises."""
    try:
        listed = router.get_json("/workers").get("workers", [])
    except (RouterError, OSError) as error:
        return RouterStatus(router.name, "down", excerpt(str(error), 160), policy)
    try:
        samples = router.metrics()
    except (RouterError, OSError):
        samples = []  # the worker list stands without them
    routed: dict[str, int] = {}
    running: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    requests = None
    for name, labels, value in samples:
        if name == "vllm_router_policy_decisions_total" and "worker" in labels:
            routed[labels["worker"]] = routed.get(labels["worker"], 0) + int(value)
            policy = labels.get("policy") or policy  # the running router's, over the inventory's
        elif name == "vllm_router_running_requests" and "worker" in labels:
            running[labels["worker"]] = int(value)
        elif name == "vllm_router_prefix_routing_decisions_total" and "outcome" in labels:
            outcomes[labels["outcome"]] = outcomes.get(labels["outcome"], 0) + int(value)
        elif name == "vllm_router_requests_total":
            requests = (requests or 0) + int(value)
    rows = tuple(
        WorkerRow(
            url=str(w.get("url")),
            healthy=bool(w.get("is_healthy")),
            load=w.get("load") if isinstance(w.get("load"), int) else None,
            routed=routed.get(str(w.get("url")), 0),
            running=running.get(str(w.get("url"))),
        )
        for w in listed
        if isinstance(w, dict)
    )
    ready = bool(rows) and any(r.healthy for r in rows)
    detail = "" if ready else ("no workers" if not rows else "no healthy worker")
    try:
        fenced: bool | None = router.fenced()
    except RouterError:
        fenced = None
    return RouterStatus(
        router.name, "ready" if ready else "not-ready", detail, policy, rows, requests, outcomes, fenced=fenced
    )


def front_door(transport: Transport, settings: RouterSettings) -> str:
    """GET /health on the client port, from the router host itself."""
    try:
        address = reach_address(settings.address)
        return str(fetch(transport, settings.port, "/health", timeout=5, address=address).status)
    except Exception as error:  # the row says so
        return excerpt(f"{type(error).__name__}: {error}", 120)


def connect(name: str, data: Mapping[str, Any]) -> Router:
    """A Router over the host's SSH connection; the caller closes router.transport.client."""
    s = router_settings(data)
    return Router(
        name,
        open_ssh(name, data),
        int(s["router_internal_port"]),
        int(s["router_metrics_port"]),
        members_path(str(s["router_service"])),
    )


def read_host(name: str, data: Mapping[str, Any], settings: RouterSettings) -> RouterStatus:
    """A router row for `gpufleet status`."""
    policy = settings.policy
    try:
        router = connect(name, data)
    except Unreachable as error:
        return RouterStatus(name, "unreachable", excerpt(str(error), 160), policy)
    try:
        return replace(read(router, policy), front_door=front_door(router.transport, settings))
    finally:
        client = getattr(router.transport, "client", None)
        if client is not None:
            client.close()
