"""Preflight: plan, lock, read and check every host in parallel before any operation runs; one refusal stops the
run on every host (docs/deploy.md)."""

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

READ_TIMEOUT_S = 60.0
# So that a host whose read timed out reports pyinfra's own error.
JOIN_MARGIN_S = 10.0


class Planned(Protocol):
    @property
    def lock(self) -> hostlock.LockTimings: ...


P = TypeVar("P", bound=Planned)
S = TypeVar("S")  # what is read on a host
PlanFor = Callable[[str, dict[str, Any]], P]
CheckHost = Callable[[str, S, P], list[str]]
# Which hosts a deploy is for.
Applies = Callable[[Host], bool]
# host name -> more refusal lines, once every host was read.
CheckFleet = Callable[[Mapping[str, "Reading[Any, Any]"]], Mapping[str, list[str]]]


def check_ssh_and_sudo(plan: Any, error: Exception) -> str:
    return "check SSH and sudo"


@dataclass(frozen=True)
class HostRead(Generic[P, S]):
    """What preflight reads on each host: `fact` with `arguments` from its plan, in the lock's own shell.
    `merged`: the deploy's merge of raw host data, for the lock wait before planning."""

    fact: type[FactBase[S]]
    arguments: Callable[[P], Mapping[str, Any]]
    merged: Callable[[Mapping[str, Any]], Mapping[str, Any]]
    fix: Callable[[P, Exception], str] = check_ssh_and_sudo
    timeout_s: float = READ_TIMEOUT_S
    answering: str = "SSH and sudo"  # a timed-out host's fix


@dataclass(frozen=True)
class Reading(Generic[P, S]):
    """One host as preflight saw it (None where it did not get that far)."""

    plan: P | None
    snapshot: S | None
    problems: list[str]


def read_host(
    state: State,
    target: Host,
    plan_for: PlanFor[P],
    check_host: CheckHost[S, P],
    reads: HostRead[P, S],
    *,
    lock_path: str = hostlock.LOCK_PATH,
) -> Reading[P, S]:
    """Plan, lock, read and check one host; bad settings are refused without touching it."""
    with ctx_config.use(state.config.copy()), ctx_host.use(target):
        try:
            plan = plan_for(target.name, target.data.dict())
        except SettingErrors as errors:
            return Reading(None, None, [str(e) for e in errors.errors])
        except hostlock.BadLockSettings as error:
            return Reading(None, None, [str(error)])
        fact, arguments = reads.fact(), dict(reads.arguments(plan))
        command = fact.command(**arguments)
        read = command if isinstance(command, str) else command.get_raw_value()
        refused, output = _lock(target, plan.lock, lock_path, read, reads.timeout_s)
        if refused:
            return Reading(plan, None, [refused])
        try:
            if output is None:  # not over SSH: no lock to read in
                seen = target.get_fact(reads.fact, **arguments, _sudo=use_sudo(target), _timeout=reads.timeout_s)
            else:
                seen = fact.process(output)
        except Exception as error:  # any failure to read is a refusal
            return Reading(
                plan, None, [f"{target.name}: could not read the host: {error} (fix: {reads.fix(plan, error)})"]
            )
        return Reading(plan, seen, check_host(target.name, seen, plan))


def _lock(
    target: Host, timings: hostlock.LockTimings, lock_path: str, read: str, read_timeout_s: float
) -> tuple[str | None, list[str] | None]:
    """Take the run's lock and run `read` in its shell: (refusal, read's lines); (None, None) off SSH."""
    try:
        return None, take_lock(target, timings, lock_path, read=read, read_timeout_s=read_timeout_s)
    except hostlock.HostLockError as error:  # a holder
        return str(error), None


def _lock_wait(data: Mapping[str, Any], reads: HostRead[Any, Any]) -> float:
    """A host's gpufleet_lock_wait_s, 0 when invalid (plan_for refuses it then)."""
    try:
        wait = float(reads.merged(data)[WAIT_SETTING])
    except (TypeError, ValueError):
        return 0.0
    return wait if 0 <= wait < float("inf") else 0.0


def read_fleet(
    state: State,
    plan_for: PlanFor[P],
    check_host: CheckHost[S, P],
    reads: HostRead[P, S],
    *,
    timeout_s: float | None = None,
    lock_path: str = hostlock.LOCK_PATH,
    applies: Applies | None = None,
) -> dict[str, Reading[P, S]]:
    """read_host for every host the deploy applies to, at once; one line for a host not done within timeout_s."""
    hosts = [h for h in state.inventory.get_active_hosts() if applies is None or applies(h)]
    if timeout_s is None:
        longest_wait = max((_lock_wait(h.data.dict(), reads) for h in hosts), default=0.0)
        timeout_s = reads.timeout_s + JOIN_MARGIN_S + longest_wait + hostlock.START_MARGIN_S
    # Not state.pool: this runs inside one of its greenlets.
    jobs = {h.name: gevent.spawn(read_host, state, h, plan_for, check_host, reads, lock_path=lock_path) for h in hosts}
    gevent.joinall(list(jobs.values()), timeout=timeout_s)
    readings: dict[str, Reading[P, S]] = {}
    for name, job in jobs.items():
        if job.ready():
            readings[name] = job.get()
        else:
            job.kill(block=False)
            readings[name] = Reading(
                None,
                None,
                [
                    f"{name}: the host did not answer preflight's read within {timeout_s:g} s (fix: check that "
                    f"{reads.answering} answer on it, or leave it out with --limit)"
                ],
            )
    return readings


class _Preflights(dict[Callable[..., Any], "AsyncResult[dict[str, Any]]"]):
    """One fleet reading per plan function, which every host's deploy call waits on."""


def preflight(
    plan_for: PlanFor[P],
    check_host: CheckHost[S, P],
    reads: HostRead[P, S],
    *,
    applies: Applies | None = None,
    check_fleet: CheckFleet | None = None,
) -> tuple[P, S]:
    """This host's plan and reading once every host passed; DeployError lists every failing host's problems."""
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
    problems = list(dict.fromkeys(line for reading in readings.values() for line in reading.problems))
    if problems:
        release_locks(state)  # another run may have the hosts now
        for name, reading in readings.items():
            for line in reading.problems:
                report(state, name, line)
        failing = sorted(name for name, reading in readings.items() if reading.problems)
        raise DeployError(
            f"preflight refused {len(failing)} of {len(readings)} host(s); nothing was changed "
            "on any host:\n  " + "\n  ".join(problems)
        )
    reading = readings[host.name]
    assert reading.plan is not None and reading.snapshot is not None
    return reading.plan, reading.snapshot


def fleet_readings(plan_for: PlanFor[P]) -> Mapping[str, Reading[P, Any]]:
    """Every host's reading, once this run's preflight() for plan_for passed."""
    return run_context(ctx_state.get()).slot(_Preflights, _Preflights)[plan_for].get() or {}
