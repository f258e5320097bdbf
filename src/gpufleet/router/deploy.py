"""The router deploy: vllm-router on the inventory's `routers` hosts, in front of the replicas that verify ready.

Its steps, and what it refuses before anything changes: docs/router.md (The deploy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyinfra import host, logger
from pyinfra.api import Host, State, deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.context import ctx_state

from gpufleet.errors import SettingError, SettingErrors
from gpufleet.harness.preflight import HostRead, preflight
from gpufleet.health.runner import HostTarget, check_fleet
from gpufleet.hostlock import LockTimings, lock_timings
from gpufleet.inventory import ROUTERS_GROUP, group_orders, split_roles
from gpufleet.operations.base import not_for_this_host
from gpufleet.operations.run import run_context
from gpufleet.router import operations, wheels
from gpufleet.router.facts import RouterHost, RouterHostFact
from gpufleet.router.settings import Replica, RouterSettings, replicas, resolve_router
from gpufleet.router.spec import RouterSpec
from gpufleet.vllm.group_specs import resolve_hosts
from gpufleet.vllm.settings import merged_settings


@dataclass(frozen=True)
class Workers:
    ready: tuple[Replica, ...]
    left_out: tuple[str, ...]  # one line per replica that is not ready


def ready_workers(state: State) -> Workers:
    """The inventory's replicas, verified once per run; DeployError for bad settings or no ready one."""
    return run_context(state).slot(Workers, lambda: _verify_workers(state))


def _verify_workers(state: State) -> Workers:
    _, found = split_roles(state.inventory)
    orders = group_orders(state.inventory)
    try:
        candidates = replicas(found, orders)  # a replica group's head only
        resolved, errors = resolve_hosts(found, orders, behind_router=True)
        if errors:
            raise SettingErrors(errors)
        targets = [HostTarget.for_spec(resolved[r.name][0], r.data) for r in candidates]
    except SettingErrors as error:
        raise DeployError(f"the router's replicas have invalid settings; nothing was changed:\n  {error}") from None
    if not candidates:
        raise DeployError(
            f"no replicas: every host is in the {ROUTERS_GROUP} inventory group; nothing was changed "
            "(fix: add the vLLM hosts to the inventory)"
        )
    results = check_fleet(targets)
    ready = tuple(r for r, result in zip(candidates, results, strict=True) if result.health.ready)
    left_out = tuple(
        f"{r.name}: {result.health.state}: {result.health.detail}"
        for r, result in zip(candidates, results, strict=True)
        if not result.health.ready
    )
    if not ready:
        raise DeployError(
            "no replica verifies ready; nothing was changed (fix: converge them first: pyinfra "
            "INVENTORY deploys/qwen35.py):\n  " + "\n  ".join(left_out)
        )
    return Workers(ready, left_out)


@dataclass(frozen=True)
class RouterPlan:
    """One router host's deploy, decided before its lock is taken."""

    spec: RouterSpec
    settings: RouterSettings
    lock: LockTimings
    workers: Workers


def is_router_host(target: Host) -> bool:
    return ROUTERS_GROUP in target.groups


def plan_for(name: str, data: dict[str, Any]) -> RouterPlan:
    """Host data to RouterPlan; SettingErrors or BadLockSettings for bad settings."""
    workers = ready_workers(ctx_state.get())
    settings = resolve_router(name, data)
    spec = settings.spec(name, [r.url for r in workers.ready])
    return RouterPlan(spec, settings, lock_timings(name, merged_settings(data)), workers)


def check_host(name: str, seen: RouterHost, plan: RouterPlan) -> list[str]:
    """A router host's refusals: a worker it cannot reach, a Python or machine the lock does not cover."""
    problems = [
        f"{name}: worker {r.name} ({r.url}) does not answer /health from the router host "
        f"(HTTP {seen.reach.get(r.url, '000')}) (fix: publish vllm_port where the router reaches it, or set "
        "router_worker_address on that host)"
        for r in plan.workers.ready
        if seen.reach.get(r.url) != "200"
    ]
    try:
        wheels.locked_install(name, plan.spec.version, seen.python, seen.machine)
    except SettingError as error:
        problems.append(str(error))
    return problems


# What preflight reads on a router host, in its lock's shell.
ROUTER_READ: HostRead[RouterPlan, RouterHost] = HostRead(
    RouterHostFact, lambda plan: {"spec": plan.spec, "candidates": plan.spec.workers}, merged_settings
)


@deploy("Deploy vllm-router in front of the replicas")
def deploy_router() -> None:
    if not is_router_host(host):
        not_for_this_host(
            name="Skip the router deploy on a vLLM host", why="a vLLM host: deploys/qwen35.py configures it"
        )
        return
    workers = ready_workers(ctx_state.get())
    # Every router host is locked and read before anything changes; one refusal stops the run.
    plan, seen = preflight(plan_for, check_host, ROUTER_READ, applies=is_router_host)
    spec = plan.spec
    install = wheels.locked_install(host.name, spec.version, seen.python, seen.machine)  # check_host passed it
    for line in workers.left_out:
        host.log(f"left out of the router's workers (not ready): {line}", log_func=logger.warning)

    operations.package(name="Install vllm-router into its venv", spec=spec, seen=seen, install=install)
    operations.members(name="Record the router's workers for its restarts", spec=spec, seen=seen)
    operations.unit(name="Install the vllm-router systemd unit", spec=spec, seen=seen)
    operations.fence(name="Fence the router's port to root and nginx (nftables)", spec=spec, seen=seen, install=install)
    operations.running(name="Enable and start vllm-router", spec=spec, seen=seen, install=install)
    operations.ready(
        name="Wait for vllm-router to listen",
        spec=spec,
        seen=seen,
        install=install,
        timeout_s=plan.settings.ready_timeout,
    )
    operations.old_venvs(name="Remove the router's old venvs", spec=spec, seen=seen, install=install)
    operations.workers_in_step(
        name="Put the running router's worker set in step", spec=spec, seen=seen, install=install
    )
    operations.front_door(
        name="Serve the client API (and nothing else) on the client port with nginx", spec=spec, seen=seen
    )
