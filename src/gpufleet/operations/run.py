"""One pyinfra run's state, per host and run-wide (docs/architecture.md, "Operations take arguments")."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar
from weakref import WeakKeyDictionary

from pyinfra import logger
from pyinfra.api import Host, State
from pyinfra.api.state import BaseStateCallback
from pyinfra.context import ctx_host, ctx_state

from gpufleet.errors import one_line
from gpufleet.hostlock import LOCK_PATH, START_MARGIN_S, HostLock, LockLost, LockTimings, NotOverSsh, lock_host
from gpufleet.hoststate.ledger import Ledger

T = TypeVar("T")


class HostFiles(Protocol):
    """What the file operations read of a host snapshot."""

    @property
    def file_sha256(self) -> Mapping[str, str | None]: ...
    @property
    def dirs(self) -> Mapping[str, tuple[str, str, str] | None]: ...
    def installed(self, package: str) -> bool: ...


@dataclass(slots=True, eq=False)
class HostRun:
    snapshot: HostFiles | None = None  # read once by preflight
    resolved_ref: str | None = None  # the image's digest ref, set while the image operation executes
    resolved_model: str | None = None
    ledger: Ledger = field(default_factory=Ledger)  # as this run last read or wrote it
    ledger_sha256: dict[str, str | None] = field(
        default_factory=dict
    )  # path -> sha256 a ledger write expects; None: no file
    lock: HostLock | None = None
    problems: list[str] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class RunContext:
    hosts: dict[str, HostRun] = field(default_factory=dict)
    slots: dict[type, object] = field(default_factory=dict)

    def host(self, name: str) -> HostRun:
        return self.hosts.setdefault(name, HostRun())

    def slot(self, kind: type[T], make: Callable[[], T]) -> T:
        """The run's `kind` record, made on first use."""
        if kind not in self.slots:
            self.slots[kind] = make()
        found = self.slots[kind]
        assert isinstance(found, kind)
        return found


# Weak, so a run's record dies with its State.
_RUNS: WeakKeyDictionary[State, RunContext] = WeakKeyDictionary()


def run_context(state: State | None = None) -> RunContext:
    state = state if state is not None else ctx_state.get()
    if state is None:
        raise RuntimeError("gpufleet's run state belongs to a pyinfra run, and none is current (ctx_state unset)")
    found = _RUNS.get(state)
    if found is None:
        found = _RUNS[state] = RunContext()
    return found


def host_run(host: Host | None = None) -> HostRun:
    host = host if host is not None else ctx_host.get()
    return run_context(host.state).host(host.name)


def remember(host: Host, snapshot: HostFiles) -> HostRun:
    held = host_run(host)
    held.snapshot = snapshot
    return held


def snapshot(host: Host | None = None) -> HostFiles:
    host = host if host is not None else ctx_host.get()
    found = host_run(host).snapshot
    if found is None:
        raise RuntimeError(
            f"{host.name}: gpufleet operations decide from the host snapshot: read it first "
            "(gpufleet.harness.preflight, then gpufleet.operations.run.remember)"
        )
    return found


def report(state: State, host: str, message: str) -> None:
    """Keep `message`, as one line, for the run's result."""
    found, message = run_context(state).host(host).problems, one_line(message)
    if message not in found:
        found.append(message)


def reported(state: State) -> dict[str, list[str]]:
    """Host name -> the problems report() kept for it."""
    context = _RUNS.get(state)
    hosts = context.hosts.items() if context is not None else ()
    return {name: list(held.problems) for name, held in hosts if held.problems}


def take_lock(
    host: Host,
    timings: LockTimings,
    path: str = LOCK_PATH,
    *,
    read: str = "",
    read_timeout_s: float = START_MARGIN_S,
) -> list[str] | None:
    """Take the host's lock; what `read` printed under it, or None off SSH. Raises HostLockError."""
    wait_s, lease_s = timings
    try:
        lock = lock_host(host, path=path, lease_s=lease_s)
    except NotOverSsh as why:
        logger.warning(f"{why}; running without the host lock")
        return None
    keep_lock(host, lock)
    lock.acquire(wait_s=wait_s, read=read, read_timeout_s=read_timeout_s)
    return lock.read_lines


def keep_lock(host: Host, lock: HostLock) -> None:
    """Hold `lock` for the run; pyinfra's disconnect lets it go."""
    host_run(host).lock = lock
    if not any(isinstance(h, _ReleaseOnDisconnect) for h in host.state.callback_handlers):
        host.state.add_callback_handler(_ReleaseOnDisconnect())


class _ReleaseOnDisconnect(BaseStateCallback):
    @staticmethod
    def host_disconnect(state: State, host: Host) -> None:
        release_locks(state, [host.name], wait=False)


def check_lock(host: Host) -> None:
    """Raise LockLost when this run lost the host's lock."""
    lock = host_run(host).lock
    if lock is not None:
        lock.check()


def still_locked(state: State, host: Host) -> bool:
    """For a FunctionCommand: stop the host when its lock was lost."""
    try:
        check_lock(host)
    except LockLost as lost:
        host.log_styled(str(lost), fg="red")
        return False
    return True


def still_held_test(host: Host) -> str | None:
    """A shell test: the lock file names this run. None without a lock."""
    lock = host_run(host).lock
    if lock is None:
        return None
    return f'[ "$(cat {shlex.quote(lock.path)} 2>/dev/null)" = {shlex.quote(lock.holder.line())} ]'


def while_held(host: Host, command: str, refusal: str) -> str:
    """`command` while the lock file names this run, else `refusal` and exit 1."""
    held = still_held_test(host)
    if held is None:
        return command
    return f"if {held}; then {command}; else echo {shlex.quote(refusal)} >&2; exit 1; fi"


def release_locks(state: State, names: Iterable[str] | None = None, wait: bool = True) -> None:
    context = _RUNS.get(state)
    if context is None:
        return
    for name in list(context.hosts) if names is None else names:
        held = context.hosts.get(name)
        if held is None or held.lock is None:
            continue
        lock, held.lock = held.lock, None
        lock.release(wait=wait)
