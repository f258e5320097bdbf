"""Preflight: read every active host once, in parallel and bounded in time, check it, and hand each host's typed
plan and reading to the deploy, before any operation executes.

    plan, seen = preflight(plan_for, check_host, reads)   # inside a @deploy function; the same call for every host

plan_for(name, host data) builds a deploy's plan (raising SettingErrors for bad settings), `reads` says what to read
on the host under its lock (a pyinfra fact, its arguments from the plan; HostRead), and check_host(name, reading,
plan) lists its refusals: each deploy (the vLLM slice's, the router's) passes its own three. Every problem on any
host is one line naming the host, what is wrong and the fix, e.g.
    gpu2: vllm_gpus [0, 1, 2] needs GPU index 2, the host has 1 GPU(s) (...) (fix: list GPU indexes below 1 ...)
and one refusal stops the whole run: nothing changes on any host. Each host is locked for the run before it is read
(gpufleet.hostlock, held in the run's state: gpufleet.operations.run): a host another run holds is refused with one
line naming that run, or waited for up to gpufleet_lock_wait_s; the lock goes when pyinfra disconnects from the
host, or at once when preflight refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

import gevent
from gevent.event import AsyncResult
from pyinfra.api import FactBase, Host, State
from pyinfra.api.exceptions import DeployError
from pyinfra.context import ctx_config, ctx_host, ctx_state

from gpufleet import hostlock
from gpufleet.defaults import WAIT_SETTING
from gpufleet.errors import SettingErrors
from gpufleet.operations.run import release_locks, report, run_context, take_lock
from gpufleet.remote.ssh import use_sudo

# How long a host's read may take once its lock is taken, unless the deploy's HostRead says: SSH, sudo, and the
# fact's command (which bounds its own programs).
READ_TIMEOUT_S = 60.0
# The join waits a little longer than the reads, so a host whose SSH command timed out reports pyinfra's own error.
JOIN_MARGIN_S = 10.0


class Planned(Protocol):
    @property
    def settings(self) -> Mapping[str, Any]: ...  # the lock's wait and lease among them


P = TypeVar("P", bound=Planned)
S = TypeVar("S")  # what a deploy reads on a host (the vLLM HostSnapshot, the router's RouterHost)
PlanFor = Callable[[str, dict[str, Any]], P]
CheckHost = Callable[[str, S, P], list[str]]
# Which hosts a deploy is for (others are neither planned, locked nor read: another deploy configures them).
Applies = Callable[[Host], bool]
# Checks across hosts, once every host was read: host name -> more refusal lines (a replica group's ranks must agree).
CheckFleet = Callable[[Mapping[str, "Reading[Any, Any]"]], Mapping[str, list[str]]]


def check_ssh_and_sudo(plan: Any, error: Exception) -> str:
    return "check SSH and sudo"


@dataclass(frozen=True)
class HostRead(Generic[P, S]):
    """What a deploy's preflight reads on each of its hosts: `fact` (a pyinfra fact: its command, run in the host
    lock's own shell right after the lock is taken, and its parser) with the keyword arguments `arguments` takes
    from the host's plan. `merged`: the deploy's merge of a host's data into its settings, which tells how long the
    host may wait for its lock before it is planned (the join's bound). `fix`: the fix named when the read fails."""

    fact: type[FactBase[S]]
    arguments: Callable[[P], Mapping[str, Any]]
    merged: Callable[[Mapping[str, Any]], Mapping[str, Any]]
    fix: Callable[[P, Exception], str] = check_ssh_and_sudo
    timeout_s: float = READ_TIMEOUT_S
    answering: str = "SSH and sudo"  # what must answer on the host for the read to finish (a timed-out host's fix)


@dataclass(frozen=True)
class Reading(Generic[P, S]):
    """One host as preflight saw it: its plan and what was read (None when not that far), and its refusal lines."""

    plan: P | None
    snapshot: S | None
    problems: list[str]


def read_host(state: State, target: Host, plan_for: PlanFor[P], check_host: CheckHost[S, P],
              reads: HostRead[P, S], lock_path: str = hostlock.LOCK_PATH) -> Reading[P, S]:
    """Plan, lock, read and check one host. Bad settings are reported without touching the host, a host another
    run holds without reading it."""
    with ctx_config.use(state.config.copy()), ctx_host.use(target):
        try:
            plan = plan_for(target.name, target.data.dict())
        except SettingErrors as errors:
            return Reading(None, None, [str(e) for e in errors.errors])
        fact, arguments = reads.fact(), dict(reads.arguments(plan))
        command = fact.command(**arguments)
        read = command if isinstance(command, str) else command.get_raw_value()
        refused, output = _lock(target, plan.settings, lock_path, read, reads.timeout_s)
        if refused:
            return Reading(plan, None, [refused])
        try:
            if output is None:  # no lock (not over SSH): the read is a command of its own
                seen = target.get_fact(reads.fact, **arguments, _sudo=use_sudo(target), _timeout=reads.timeout_s)
            else:
                seen = fact.process(output)
        except Exception as error:  # any failure to read the host is a preflight refusal
            return Reading(plan, None, [f"{target.name}: could not read the host: {error} "
                                        f"(fix: {reads.fix(plan, error)})"])
        return Reading(plan, seen, check_host(target.name, seen, plan))


def _lock(target: Host, settings: Mapping[str, Any], lock_path: str, read: str,
          read_timeout_s: float) -> tuple[str | None, list[str] | None]:
    """Take the run's lock on the host and run `read` under it, in the lock's own shell (one sudo and one round
    trip less per host than a fact of its own): (the refusal line when another run holds it, read's output).
    (None, None) for a host not reached over SSH: no lock, nothing read."""
    try:
        return None, take_lock(target, settings, lock_path, read=read, read_timeout_s=read_timeout_s)
    except hostlock.HostLockError as error:  # a holder, or lock settings a deploy's plan_for does not check
        return str(error), None


def _lock_wait(data: Mapping[str, Any], reads: HostRead[Any, Any]) -> float:
    """A host's gpufleet_lock_wait_s, 0 when it is not a valid number (plan_for refuses it then, without locking)."""
    try:
        wait = float(reads.merged(data)[WAIT_SETTING])
    except (TypeError, ValueError):
        return 0.0
    return wait if 0 <= wait < float("inf") else 0.0


def read_fleet(state: State, plan_for: PlanFor[P], check_host: CheckHost[S, P], reads: HostRead[P, S],
               timeout_s: float | None = None, lock_path: str = hostlock.LOCK_PATH,
               applies: Applies | None = None) -> dict[str, Reading[P, S]]:
    """read_host for every active host the deploy applies to, at once; a host not done within timeout_s gets one
    line. By default the bound is the read's timeout and a margin, plus the longest any host may wait for its lock."""
    hosts = [h for h in state.inventory.get_active_hosts() if applies is None or applies(h)]
    if timeout_s is None:
        longest_wait = max((_lock_wait(h.data.dict(), reads) for h in hosts), default=0.0)
        timeout_s = reads.timeout_s + JOIN_MARGIN_S + longest_wait + hostlock.START_MARGIN_S
    # Plain greenlets, not state.pool: this runs inside one of the pool's own greenlets.
    jobs = {h.name: gevent.spawn(read_host, state, h, plan_for, check_host, reads, lock_path) for h in hosts}
    gevent.joinall(list(jobs.values()), timeout=timeout_s)
    readings: dict[str, Reading[P, S]] = {}
    for name, job in jobs.items():
        if job.ready():
            readings[name] = job.get()
        else:
            job.kill(block=False)
            readings[name] = Reading(None, None, [
                f"{name}: the host did not answer preflight's read within {timeout_s:g} s (fix: check that "
                f"{reads.answering} answer on it, or leave it out with --limit)"])
    return readings


class _Preflights(dict[Callable[..., Any], "AsyncResult[dict[str, Any]]"]):
    """The run's preflights, one per plan function: every host's deploy call waits on the first one's reading of
    the fleet (a slot of the run's context, gpufleet.operations.run)."""


def preflight(plan_for: PlanFor[P], check_host: CheckHost[S, P], reads: HostRead[P, S],
              applies: Applies | None = None, check_fleet: CheckFleet | None = None) -> tuple[P, S]:
    """This host's plan and what was read on it, once every active host the deploy applies to passed preflight (the
    host's lock is held for the run from then on). Raises DeployError listing every failing host's problems."""
    state, host = ctx_state.get(), ctx_host.get()
    runs = run_context(state).slot(_Preflights, _Preflights)
    if plan_for not in runs:
        result: AsyncResult[dict[str, Any]] = AsyncResult()
        runs[plan_for] = result
        try:
            found = read_fleet(state, plan_for, check_host, reads, applies=applies)
            for name, lines in (check_fleet(found) if check_fleet else {}).items():
                found[name] = replace(found[name], problems=[*found[name].problems, *lines])
            result.set(found)
        except BaseException as error:
            result.set_exception(error)
            raise
    readings: dict[str, Reading[P, S]] = runs[plan_for].get() or {}
    # A problem of several hosts (a replica group's) is reported on each of them, and listed once.
    problems = list(dict.fromkeys(line for reading in readings.values() for line in reading.problems))
    if problems:
        release_locks(state)  # nothing will run: another run may have the hosts now
        for name, reading in readings.items():  # each refusal is its host's problem in the run's result
            for line in reading.problems:
                report(state, name, line)
        failing = sorted(name for name, reading in readings.items() if reading.problems)
        raise DeployError(f"preflight refused {len(failing)} of {len(readings)} host(s); nothing was changed "
                          "on any host:\n  " + "\n  ".join(problems))
    reading = readings[host.name]
    assert reading.plan is not None and reading.snapshot is not None  # no problems: planned and read
    return reading.plan, reading.snapshot


def fleet_readings(plan_for: PlanFor[P]) -> Mapping[str, Reading[P, Any]]:
    """Every host's reading, once this run's preflight() for plan_for passed (a rank reads its group's)."""
    return run_context(ctx_state.get()).slot(_Preflights, _Preflights)[plan_for].get() or {}
