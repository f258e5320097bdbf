"""One pyinfra run's own state, in one typed place: per host, what the run read there and holds there; run-wide,
what a deploy computed once for every host.

    run_context(state).host("gpu1").ledger          # the host's ledger as this run last read or wrote it
    host_run(host).snapshot                        # the host snapshot the operations decide from
    run_context(state).slot(Workers, verify_them)  # a deploy's own run-wide record, made once per run

Why a run needs state besides operation arguments: pyinfra 3.x has no fact cache (every host.get_fact() runs its
command again, one SSH round trip each) and runs an operation's generator twice (once to plan, once to execute). So
the deploy reads each host once (gpufleet.harness.preflight), keeps the snapshot here, and every operation decides
from it; both runs of an operation see the same snapshot and execute the commands the plan announced. Everything
else an operation needs is an argument (the pin this run installs, whether to retry a failed version, ...).

What cannot be an argument, because it exists only once something executed:
- The digest a tag resolves to, known once `docker pull` ran inside the image operation's FunctionCommand. The unit
  must run that digest, and the unit operation's generator runs again at execution time, after the pull: so the
  image operation records it here (`resolved_image_ref`) and the unit, the flag check and the model download read
  it. Arguments are fixed when the deploy file is read, before anything executes.
- The host's ledger as the functions that begin, commit or roll back a version while executing last wrote it (and
  the sha256 a write compares the file with), so every later step decides from what is on the host now.
- The host's lock, taken by preflight and checked before every write and restart; and the one-line problems kept
  for the run's result (gpufleet.harness.result).

A slice's run-wide record (the router's verified workers, preflight's readings) is a typed slot keyed by its class:
this base names no slice above it (docs/architecture.md's layers).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from weakref import WeakKeyDictionary

from pyinfra import logger
from pyinfra.api import Host, State
from pyinfra.api.state import BaseStateCallback
from pyinfra.context import ctx_host, ctx_state

from gpufleet.errors import one_line
from gpufleet.hostlock import LOCK_PATH, START_MARGIN_S, HostLock, LockLost, NotOverSsh, lock_host, lock_timings
from gpufleet.hoststate.ledger import Ledger

T = TypeVar("T")


class HostFiles(Protocol):
    """What the shared file operations (gpufleet.operations.files) read of a host's snapshot; the snapshot itself is
    a slice's (gpufleet.vllm.facts.HostSnapshot, read through gpufleet.vllm.snapshot), so the base names no slice."""

    @property
    def file_sha256(self) -> Mapping[str, str | None]: ...
    @property
    def dirs(self) -> Mapping[str, tuple[str, str, str] | None]: ...
    def installed(self, package: str) -> bool: ...


@dataclass(slots=True, eq=False)
class HostRun:
    """What one run knows of one host and holds there."""

    snapshot: HostFiles | None = None  # read once by preflight; None for a host whose deploy reads no snapshot
    resolved_image_ref: str | None = None  # repo@sha256:..., set by gpufleet.vllm.operations.image while executing
    resolved_model: str | None = None  # org/name@commit, set by gpufleet.vllm.operations.model once checked
    ledger: Ledger = field(default_factory=Ledger)  # the host's ledger as this run last read or wrote it
    # path -> sha256 of each ledger file as this run read it under the host's lock or last wrote it (None: no file):
    # a ledger write is compare-and-swap on it (gpufleet.vllm.operations.service.save_ledger). A path not listed is
    # written without the comparison.
    ledger_sha256: dict[str, str | None] = field(default_factory=dict)
    lock: HostLock | None = None  # the host's lock, held for the run; None: not taken (not over SSH, refused)
    problems: list[str] = field(default_factory=list)  # one line each, in order: the host's part of the run's result


@dataclass(slots=True, eq=False)
class RunContext:
    """One pyinfra run: a HostRun per host name, and the deploys' run-wide records by their type."""

    hosts: dict[str, HostRun] = field(default_factory=dict)
    slots: dict[type, object] = field(default_factory=dict)

    def host(self, name: str) -> HostRun:
        return self.hosts.setdefault(name, HostRun())

    def slot(self, kind: type[T], make: Callable[[], T]) -> T:
        """The run's one `kind` record, made by make() the first time it is asked for (not kept when make raises)."""
        if kind not in self.slots:
            self.slots[kind] = make()
        found = self.slots[kind]
        assert isinstance(found, kind)
        return found


# The one registry of run state, keyed by pyinfra's State: that is what one run is (a CLI run, or each run a program
# makes through pyinfra's API in one process), and what every operation and callback can reach (host.state). Weak,
# so a run's state goes with its State, the lock objects included.
_RUNS: WeakKeyDictionary[State, RunContext] = WeakKeyDictionary()


def run_context(state: State | None = None) -> RunContext:
    """The run's context (the current run's by default: pyinfra's ctx_state)."""
    state = state if state is not None else ctx_state.get()
    if state is None:
        raise RuntimeError("gpufleet's run state belongs to a pyinfra run, and none is current (ctx_state unset)")
    found = _RUNS.get(state)
    if found is None:
        found = _RUNS[state] = RunContext()
    return found


def host_run(host: Host | None = None) -> HostRun:
    """The host's record in its run (the current host's by default: pyinfra's ctx_host)."""
    host = host if host is not None else ctx_host.get()
    return run_context(host.state).host(host.name)


def remember(host: Host, snapshot: HostFiles) -> HostRun:
    """Set the host's snapshot for this run (the deploy does, with what preflight read; a test can, too)."""
    held = host_run(host)
    held.snapshot = snapshot
    return held


def snapshot(host: Host | None = None) -> HostFiles:
    host = host if host is not None else ctx_host.get()
    found = host_run(host).snapshot
    if found is None:
        raise RuntimeError(f"{host.name}: gpufleet operations decide from the host snapshot: read it first "
                           "(gpufleet.harness.preflight, then gpufleet.operations.run.remember)")
    return found


# --- the run's result: each host's one-line problems --------------------------------------------------------------
def report(state: State, host: str, message: str) -> None:
    """Keep a one-line problem of `host` for the run's result (gpufleet.harness.result writes it at exit)."""
    found, message = run_context(state).host(host).problems, one_line(message)
    if message not in found:
        found.append(message)


def reported(state: State) -> dict[str, list[str]]:
    """What report() kept for this run: host name -> its problems."""
    context = _RUNS.get(state)
    hosts = context.hosts.items() if context is not None else ()
    return {name: list(held.problems) for name, held in hosts if held.problems}


# --- the run's host locks (gpufleet.hostlock: the lock itself) -----------------------------------------------------
def take_lock(host: Host, settings: Mapping[str, Any], path: str = LOCK_PATH, read: str = "",
              read_timeout_s: float = START_MARGIN_S) -> list[str] | None:
    """Take the host's lock for the whole run (let go when pyinfra disconnects from the host), waiting as long as
    its wait setting says, and run `read` under it (HostLock.acquire): read's output lines. None for a host not
    reached over SSH: no lock, nothing read. Raises HostLockError when refused (HostLockBusy naming the holder,
    BadLockSettings when the lock settings are not numbers)."""
    wait_s, lease_s = lock_timings(host.name, settings)
    try:
        lock = lock_host(host, path=path, lease_s=lease_s)
    except NotOverSsh as why:
        # @local and other connectors: no SSH session to hold the lock with (nor a second operator's run to meet).
        logger.warning(f"{why}; running without the host lock")
        return None
    keep_lock(host, lock)
    lock.acquire(wait_s=wait_s, read=read, read_timeout_s=read_timeout_s)
    return lock.read_lines


def keep_lock(host: Host, lock: HostLock) -> None:
    """Hold `lock` as the run's lock on the host: checked before its writes and restarts, let go on disconnect."""
    host_run(host).lock = lock
    if not any(isinstance(h, _ReleaseOnDisconnect) for h in host.state.callback_handlers):
        host.state.add_callback_handler(_ReleaseOnDisconnect())


class _ReleaseOnDisconnect(BaseStateCallback):
    @staticmethod
    def host_disconnect(state: State, host: Host) -> None:
        # The run is ending: no lock of this process follows, so no need to wait for the host to let go.
        release_locks(state, [host.name], wait=False)


def check_lock(host: Host) -> None:
    """Raise LockLost when this run took the host's lock and no longer holds it (no lock taken: nothing to check,
    as for a host not reached over SSH)."""
    lock = host_run(host).lock
    if lock is not None:
        lock.check()


def still_locked(state: State, host: Host) -> bool:
    """A FunctionCommand's check, at execution time, before a write or a (re)start that must not interleave with
    another run's: stops this host when its lock was lost (the lease ran out while this run was stalled, and another
    run may hold the host now)."""
    try:
        check_lock(host)
    except LockLost as lost:
        host.log_styled(str(lost), fg="red")
        return False
    return True


def still_held_test(host: Host) -> str | None:
    """A shell test that is true on the host while this run's holder line is still the lock file's, or None when
    this run took no lock there. Run in the same shell as a write or a restart, it refuses, at execution time and on
    the host itself, the step of a run that was stalled past its lease and whose lock another run has taken since."""
    lock = host_run(host).lock
    if lock is None:
        return None
    return f'[ "$(cat {shlex.quote(lock.path)} 2>/dev/null)" = {shlex.quote(lock.holder.line())} ]'


def while_held(host: Host, command: str, refusal: str) -> str:
    """Shell: `command`, only while the lock file still names this run (checked on the host, in the same shell);
    else `refusal` on stderr and exit 1. No lock taken: `command` as it is."""
    held = still_held_test(host)
    if held is None:
        return command
    return f"if {held}; then {command}; else echo {shlex.quote(refusal)} >&2; exit 1; fi"


def release_locks(state: State, names: Iterable[str] | None = None, wait: bool = True) -> None:
    """Let the run's host locks go: all of them, or those of the hosts named (HostLock.release's wait)."""
    context = _RUNS.get(state)
    if context is None:
        return
    for name in list(context.hosts) if names is None else names:
        held = context.hosts.get(name)
        if held is None or held.lock is None:
            continue
        lock, held.lock = held.lock, None
        lock.release(wait=wait)
