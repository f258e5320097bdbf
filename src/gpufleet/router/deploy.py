"""The router deploy: vllm-router on the inventory's `routers` hosts, in front of the replicas that verify ready.

    pyinfra inventories/lab.py deploys/router.py

Before anything changes: every replica is checked as `gpufleet verify` checks it (in parallel, over SSH, once per
run); the ready ones are the workers, the others are left out with one line each; no ready replica refuses the
run. Each ready worker must answer /health from the router host itself (the path the router uses), else the run
is refused naming it, and so is a host whose Python or machine gpufleet's lock of router wheels does not cover.
Then, per router host: python3-venv, the lock's wheels (hash-checked) in a venv of their own, switched in by
one rename of the router_venv symlink; the unit (vllm-router unprivileged and sandboxed, on the loopback);
running (restarted only when its unit or its venv changed); ready; the old venvs pruned; a router that kept running
put in step with the worker set through its own worker API; and nginx on the client port
passing on the client API only (the worker management API stays on the loopback).
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

from pyinfra import host, logger
from pyinfra.api import State, deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.context import ctx_state

from gpufleet import hostlock
from gpufleet.errors import SettingError, SettingErrors
from gpufleet.health.runner import HostTarget, check_fleet
from gpufleet.inventory import ROUTERS_GROUP, split_roles
from gpufleet.operations.base import not_for_this_host
from gpufleet.router import operations, wheels
from gpufleet.router.facts import RouterHostFact
from gpufleet.router.settings import Replica, build_router_spec, replicas, router_settings
from gpufleet.vllm.settings import build_spec, merged_settings


@dataclass(frozen=True)
class Workers:
    ready: tuple[Replica, ...]
    left_out: tuple[str, ...]  # one line per replica that is not ready, and why


_WORKERS: WeakKeyDictionary[State, Workers] = WeakKeyDictionary()


def ready_workers(state: State) -> Workers:
    """The inventory's replicas, verified once per run; raises DeployError for bad settings or no ready one."""
    if state in _WORKERS:
        return _WORKERS[state]
    _, found = split_roles(state.inventory)
    try:
        candidates = replicas(found)
        targets = [HostTarget.for_spec(build_spec(r.name, r.data, behind_router=True), r.data) for r in candidates]
    except SettingErrors as error:
        raise DeployError(f"the router's replicas have invalid settings; nothing was changed:\n  {error}") from None
    if not candidates:
        raise DeployError(f"no replicas: every host is in the {ROUTERS_GROUP} group; nothing was changed "
                          "(fix: add the vLLM hosts to the inventory)")
    results = check_fleet(targets)
    ready = tuple(r for r, result in zip(candidates, results) if result.health.ready)
    left_out = tuple(f"{r.name}: {result.health.state}: {result.health.detail}"
                     for r, result in zip(candidates, results) if not result.health.ready)
    if not ready:
        raise DeployError("no replica verifies ready; nothing was changed (fix: converge them first: pyinfra "
                          "INVENTORY deploys/qwen35.py):\n  " + "\n  ".join(left_out))
    _WORKERS[state] = Workers(ready, left_out)
    return _WORKERS[state]


@deploy("Deploy vllm-router in front of the replicas")
def deploy_router() -> None:
    if ROUTERS_GROUP not in host.groups:
        not_for_this_host(name="Skip the router deploy on a replica",
                          why="a replica: deploys/qwen35.py configures it")
        return
    workers = ready_workers(ctx_state.get())
    try:
        spec = build_router_spec(host.name, host.data.dict(), [r.url for r in workers.ready])
    except SettingErrors as error:
        raise DeployError(f"invalid router settings; nothing was changed on {host.name}:\n  {error}") from None
    # One operator at a time, as on the replicas: a second run would rewrite and restart the same router.
    lock_settings = merged_settings(host.data.dict())
    try:
        hostlock.take_run_lock(host, lock_settings)
    except hostlock.HostLockError as error:
        raise DeployError(f"nothing was changed: {error}") from None
    except (TypeError, ValueError):
        raise DeployError(f"{host.name}: {hostlock.WAIT_SETTING} and {hostlock.LEASE_SETTING} must be numbers of "
                          f"seconds, got {lock_settings[hostlock.WAIT_SETTING]!r} and "
                          f"{lock_settings[hostlock.LEASE_SETTING]!r}; nothing was changed (fix: set them to numbers)"
                          ) from None
    seen = host.get_fact(RouterHostFact, spec=spec, candidates=spec.workers)
    unreachable = [f"{host.name}: worker {r.name} ({r.url}) does not answer /health from the router host "
                   f"(HTTP {seen.reach.get(r.url, '000')}) (fix: publish vllm_port where the router reaches it, or "
                   "set router_worker_address on that host)" for r in workers.ready if seen.reach.get(r.url) != "200"]
    if unreachable:
        raise DeployError("the router cannot reach its workers; nothing was changed:\n  " + "\n  ".join(unreachable))
    try:  # the lock's wheels for this host's Python and machine, or one line before anything changes
        install = wheels.locked_install(host.name, spec.version, seen.python, seen.machine)
    except SettingError as error:
        raise DeployError(f"{error}; nothing was changed") from None
    for line in workers.left_out:
        host.log(f"left out of the router's workers (not ready): {line}", log_func=logger.warning)

    operations.package(name="Install vllm-router into its venv", spec=spec, seen=seen, install=install)
    operations.members(name="Record the router's workers for its restarts", spec=spec, seen=seen)
    operations.unit(name="Install the vllm-router systemd unit", spec=spec, seen=seen)
    operations.running(name="Enable and start vllm-router", spec=spec, seen=seen, install=install)
    operations.ready(name="Wait for vllm-router to listen", spec=spec, seen=seen, install=install,
                     timeout_s=int(router_settings(host.data.dict())["router_ready_timeout"]))
    operations.old_venvs(name="Remove the router's old venvs", spec=spec, seen=seen, install=install)
    operations.workers_in_step(name="Put the running router's worker set in step", spec=spec, seen=seen,
                               install=install)
    operations.front_door(name="Serve the client API (and nothing else) on the client port with nginx", spec=spec,
                          seen=seen)
