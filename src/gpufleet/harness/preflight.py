"""Preflight: read every active host once, in parallel and bounded in time, check it, and hand each host's typed
plan to the deploy, before any operation executes.

    plan = preflight(plan_for, check_host)   # inside a @deploy function; the same call for every host

plan_for(name, host data) builds a deploy's plan (raising SettingErrors for bad settings) and check_host(name,
snapshot, plan) lists its refusals, so a second deploy reuses the harness with its own plan. Every problem on any
host is one line naming the host, what is wrong and the fix, e.g.
    gpu2: vllm_gpus [0, 1, 2] needs GPU index 2, the host has 1 GPU(s) (...) (fix: list GPU indexes below 1 ...)
and one refusal stops the whole run: nothing changes on any host. Each host is locked for the run before it is read
(gpufleet.hostlock): a host another run holds is refused with one line naming that run, or waited for up to
gpufleet_lock_wait_s; the lock goes when pyinfra disconnects from the host, or at once when preflight refuses.
The checks of a vLLM host are the vLLM slice's (gpufleet.vllm.checks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar
from weakref import WeakKeyDictionary

import gevent
from gevent.event import AsyncResult
from pyinfra.api import Host, State
from pyinfra.api.exceptions import DeployError
from pyinfra.context import ctx_config, ctx_host, ctx_state

from gpufleet import hostlock
from gpufleet.errors import SettingErrors
from gpufleet.operations.base import report
from gpufleet.operations.snapshot import remember
from gpufleet.remote.ssh import use_sudo
from gpufleet.vllm.facts import COMMAND_TIMEOUT_S, SNAPSHOT_REFUSED, GpufleetHost, HostSnapshot, Paths
from gpufleet.vllm.settings import merged_settings

# How long preflight waits for all hosts' snapshots. A host's snapshot bounds each program in it (a wedged
# nvidia-smi costs COMMAND_TIMEOUT_S, then the other GPU queries are skipped); this bounds the rest: SSH, sudo,
# a host that stops answering mid-read.
READ_TIMEOUT_S = 3 * COMMAND_TIMEOUT_S
# The join waits a little longer, so a host whose SSH command timed out reports pyinfra's own error.
JOIN_TIMEOUT_S = READ_TIMEOUT_S + 10


class Planned(Protocol):
    @property
    def paths(self) -> Paths: ...

    @property
    def settings(self) -> Mapping[str, Any]: ...


P = TypeVar("P", bound=Planned)
PlanFor = Callable[[str, dict[str, Any]], P]
CheckHost = Callable[[str, HostSnapshot, P], list[str]]
# Which hosts a deploy is for (others are neither planned, locked nor read: another deploy configures them).
Applies = Callable[[Host], bool]


@dataclass(frozen=True)
class Reading(Generic[P]):
    """One host as preflight saw it: its plan and snapshot (None when not that far), and its refusal lines."""

    plan: P | None
    snapshot: HostSnapshot | None
    problems: list[str]


def read_host(state: State, target: Host, plan_for: PlanFor[P], check_host: CheckHost[P],
              lock_path: str = hostlock.LOCK_PATH) -> Reading[P]:
    """Plan, lock, read and check one host. Bad settings are reported without touching the host, a host another
    run holds without reading it."""
    with ctx_config.use(state.config.copy()), ctx_host.use(target):
        try:
            plan = plan_for(target.name, target.data.dict())
        except SettingErrors as errors:
            return Reading(None, None, [str(e) for e in errors.errors])
        snapshot = GpufleetHost()
        refused, output = _lock(target, plan.settings, lock_path, read=snapshot.command(plan.paths))
        if refused:
            return Reading(plan, None, [refused])
        try:
            if output is None:  # no lock (not over SSH): the snapshot is a command of its own
                snap = target.get_fact(GpufleetHost, paths=plan.paths, _sudo=use_sudo(target),
                                       _timeout=READ_TIMEOUT_S)
            else:
                snap = snapshot.process(output)
        except Exception as error:  # noqa: BLE001 - any failure to read the host is a preflight refusal
            port = plan.paths.port
            fix = (f"something on the host answers in gpufleet's own words: `ss -ltnp 'sport = :{port}'` shows what "
                   f"listens on port {port}; stop it" if SNAPSHOT_REFUSED in str(error) else "check SSH and sudo")
            return Reading(plan, None, [f"{target.name}: could not read the host: {error} (fix: {fix})"])
        return Reading(plan, snap, check_host(target.name, snap, plan))


def _lock(target: Host, settings: Mapping[str, Any], lock_path: str,
          read: str) -> tuple[str | None, list[str] | None]:
    """Take the run's lock on the host and run `read` under it, in the lock's own shell (one sudo and one round
    trip less per host than a fact of its own): (the refusal line when another run holds it, read's output).
    (None, None) for a host not reached over SSH: no lock, nothing read."""
    try:
        return None, hostlock.take_run_lock(target, settings, lock_path, read=read, read_timeout_s=READ_TIMEOUT_S)
    except hostlock.HostLockError as error:
        return str(error), None


def _lock_wait(data: Mapping[str, Any]) -> float:
    """A host's gpufleet_lock_wait_s, 0 when it is not a valid number (plan_for refuses it then, without locking)."""
    try:
        wait = float(merged_settings(data)[hostlock.WAIT_SETTING])
    except (TypeError, ValueError):
        return 0.0
    return wait if 0 <= wait < float("inf") else 0.0


def read_fleet(state: State, plan_for: PlanFor[P], check_host: CheckHost[P], timeout_s: float | None = None,
               lock_path: str = hostlock.LOCK_PATH, applies: Applies | None = None) -> dict[str, Reading[P]]:
    """read_host for every active host the deploy applies to, at once; a host not done within timeout_s gets one
    line. By default the bound is JOIN_TIMEOUT_S plus the longest any host may wait for its lock."""
    hosts = [h for h in state.inventory.get_active_hosts() if applies is None or applies(h)]
    if timeout_s is None:
        longest_wait = max((_lock_wait(h.data.dict()) for h in hosts), default=0.0)
        timeout_s = JOIN_TIMEOUT_S + longest_wait + hostlock.START_MARGIN_S
    # Plain greenlets, not state.pool: this runs inside one of the pool's own greenlets.
    jobs = {h.name: gevent.spawn(read_host, state, h, plan_for, check_host, lock_path) for h in hosts}
    gevent.joinall(list(jobs.values()), timeout=timeout_s)
    readings: dict[str, Reading[P]] = {}
    for name, job in jobs.items():
        if job.ready():
            readings[name] = job.get()
        else:
            job.kill(block=False)
            readings[name] = Reading(None, None, [
                f"{name}: the host did not answer preflight's read within {timeout_s:g} s (fix: check that SSH, "
                "sudo, nvidia-smi, docker and systemctl answer on it, or leave it out with --limit)"])
    return readings


# One preflight per run and plan function: every host's deploy call waits on the first one's reading of the fleet.
_RUNS: WeakKeyDictionary[State, dict[Callable[..., Any], AsyncResult[dict[str, Any]]]] = WeakKeyDictionary()


def preflight(plan_for: PlanFor[P], check_host: CheckHost[P], applies: Applies | None = None) -> P:
    """This host's plan, once every active host the deploy applies to passed preflight; sets its snapshot for the
    operations (gpufleet.operations.snapshot). Raises DeployError listing every failing host's problems."""
    state, host = ctx_state.get(), ctx_host.get()
    runs = _RUNS.setdefault(state, {})
    if plan_for not in runs:
        result: AsyncResult[dict[str, Any]] = AsyncResult()
        runs[plan_for] = result
        try:
            result.set(read_fleet(state, plan_for, check_host, applies=applies))
        except BaseException as error:
            result.set_exception(error)
            raise
    readings: dict[str, Reading[P]] = runs[plan_for].get() or {}
    problems = [line for reading in readings.values() for line in reading.problems]
    if problems:
        hostlock.release_run_locks(state)  # nothing will run: another run may have the hosts now
        for name, reading in readings.items():  # each refusal is its host's problem in the run's result
            for line in reading.problems:
                report(state, name, line)
        failing = sorted(name for name, reading in readings.items() if reading.problems)
        raise DeployError(f"preflight refused {len(failing)} of {len(readings)} host(s); nothing was changed "
                          "on any host:\n  " + "\n  ".join(problems))
    reading = readings[host.name]
    assert reading.plan is not None and reading.snapshot is not None  # no problems: planned and read
    remember(host, reading.snapshot)
    return reading.plan
