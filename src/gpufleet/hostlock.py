"""One run at a time per host: a flock held on the run's SSH channel (docs/crash-safety.md)."""

from __future__ import annotations

import getpass
import math
import os
import shlex
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import paramiko
from pyinfra.api import Host

from gpufleet.defaults import LEASE_SETTING, WAIT_SETTING
from gpufleet.errors import GpufleetError, one_line
from gpufleet.remote.ssh import use_sudo

# Root's own 0700 directory: no local user can hold the lock or forge its holder.
LOCK_PATH = "/run/gpufleet/lock"
LEASE_S = 90.0
BUSY_EXIT = 75  # EX_TEMPFAIL, distinct from the script's own exit status
LOCKED = "LOCKED"
READ_DONE = "@@gpufleet-lock:read-done"  # ends what acquire's `read` prints
START_MARGIN_S = 30.0  # for sudo and a shell to start on a slow host
LETTING_GO_S = 5.0  # for the host's side of an exited run of this controller to let go


def process_ended(pid: int) -> bool:
    """Has `pid` ended? A zombie has, though signal 0 still reaches it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return Path("/proc/self").exists()  # reaped meanwhile
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]  # the command name before it may hold ")"


class HostLockError(GpufleetError):
    """The lock failed, not for a holder."""


class HostLockBusy(HostLockError):
    """Another run holds the host."""

    def __init__(self, host: str, holder: Holder | None, waited_s: float):
        self.host, self.holder = host, holder
        who = holder.describe() if holder else "another run (it did not say who)"
        waited = f" after waiting {waited_s:g} s" if waited_s else ""
        super().__init__(
            one_line(
                f"{host}: locked by {who}{waited} (fix: wait for that run to end, or pass "
                f"--data {WAIT_SETTING}=SECONDS to wait for it)"
            )
        )


class BadLockSettings(HostLockError):
    pass


class LockTimings(NamedTuple):
    """How long a run waits for a host's lock, and the lease it holds it on."""

    wait_s: float
    lease_s: float


def lock_timings(name: str, settings: Mapping[str, Any]) -> LockTimings:
    """One host's LockTimings from its merged settings; BadLockSettings when they are not numbers."""
    wait, lease = settings.get(WAIT_SETTING), settings.get(LEASE_SETTING)
    try:
        return LockTimings(float(wait), float(lease))  # type: ignore[arg-type]  # anything else is the error below
    except (TypeError, ValueError):
        raise BadLockSettings(
            one_line(
                f"{name}: {WAIT_SETTING} and {LEASE_SETTING} must be numbers of seconds, got "
                f"{wait!r} and {lease!r} (fix: set them to numbers)"
            )
        ) from None


class NotOverSsh(HostLockError):
    """No SSH session to hold a lock with."""


class LockLost(HostLockError):
    """Another run may hold the host now."""


@dataclass(frozen=True)
class Holder:
    user: str
    controller: str
    pid: int
    since: str

    @classmethod
    def this_process(cls) -> Holder:
        return cls(
            user=getpass.getuser(),
            controller=socket.gethostname(),
            pid=os.getpid(),
            since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )

    def operator(self) -> str:
        """The ledger's `operator` field for a pending change."""
        return f"{self.user}@{self.controller} pid {self.pid}"

    def describe(self) -> str:
        return f"{self.operator()} since {self.since}"

    def exited_here(self) -> bool:
        """Is this an ended run of this user on this controller?"""
        if (self.user, self.controller) != (getpass.getuser(), socket.gethostname()) or self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, another user's
        return process_ended(self.pid)

    def line(self) -> str:
        return one_line(f"user={self.user} controller={self.controller} pid={self.pid} since={self.since}")

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder line() wrote, or None."""
        fields = dict(word.partition("=")[::2] for word in text.split())
        try:
            return cls(
                user=fields["user"], controller=fields["controller"], pid=int(fields["pid"]), since=fields["since"]
            )
        except (KeyError, ValueError):
            return None


def whole_seconds(seconds: float) -> str:
    """Seconds for `read -t` and `flock -w`, rounded up: `{:g}` writes 1e+06, which `read -t` rejects."""
    return str(math.ceil(seconds))


def lock_command(path: str, holder: Holder, lease_s: float, wait_s: float, sudo: bool, read: str = "") -> str:
    """The remote command: LOCKED, `read`'s output, READ_DONE, then held while heartbeats come; or BUSY, holder."""
    q = shlex.quote
    hold = (
        'printf "%s\\n" "$1" > "$2"; echo ' + LOCKED + "; "
        'if [ -n "$4" ]; then sh -c "$4" </dev/null 2>/dev/null; echo ' + READ_DONE + "; fi; "
        'while read -r -t "$3" _; do :; done'
    )
    wait = "-n" if wait_s <= 0 else f"-w {whole_seconds(wait_s)}"
    flock = (
        f"flock {wait} -E {BUSY_EXIT} {q(path)} bash -c {q(hold)} hold {q(holder.line())} {q(path)} "
        f"{whole_seconds(lease_s)} {q(read)}"
    )
    directory = q(os.path.dirname(path) or ".")
    script = (
        f"{{ [ -d {directory} ] || mkdir -p -m 0700 {directory}; }} && {flock}; rc=$?; "
        f"if [ $rc -eq {BUSY_EXIT} ]; then echo BUSY; cat {q(path)} 2>/dev/null; fi; exit $rc"
    )
    command = f"bash -c {q(script)}"
    return f"sudo -n {command}" if sudo else command


class HostLock:
    def __init__(
        self,
        client: paramiko.SSHClient,
        host: str,
        path: str = LOCK_PATH,
        lease_s: float = LEASE_S,
        sudo: bool = False,
        holder: Holder | None = None,
    ):
        self.client, self.host, self.path, self.lease_s, self.sudo = client, host, path, lease_s, sudo
        self.holder = holder or Holder.this_process()
        self._channel: paramiko.Channel | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.read_lines: list[str] = []  # what acquire's `read` printed

    @property
    def held(self) -> bool:
        return self._channel is not None and not self._channel.exit_status_ready() and not self._channel.closed

    def acquire(self, wait_s: float = 0, read: str = "", read_timeout_s: float = START_MARGIN_S) -> HostLock:
        """Take the lock, waiting up to wait_s; the read-only sh script `read` runs under it into read_lines."""
        try:
            return self._acquire(wait_s, read, read_timeout_s)
        except HostLockBusy as busy:
            if wait_s >= LETTING_GO_S or busy.holder is None or not busy.holder.exited_here():
                raise
        return self._acquire(LETTING_GO_S, read, read_timeout_s)

    def _acquire(self, wait_s: float, read: str, read_timeout_s: float) -> HostLock:
        if self._channel is not None:
            raise HostLockError(f"{self.host}: the lock is already held by this run")
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise HostLockError(f"{self.host}: no SSH connection to take the lock over")
        try:
            channel = transport.open_session()
            channel.settimeout(max(wait_s, 0) + START_MARGIN_S)
            channel.exec_command(lock_command(self.path, self.holder, self.lease_s, wait_s, self.sudo, read))
        except (OSError, EOFError, paramiko.SSHException) as error:
            raise HostLockError(one_line(f"{self.host}: cannot start the lock command: {error}")) from None
        stdout = channel.makefile("r")
        try:
            first = stdout.readline().strip()
        except TimeoutError:
            channel.close()
            raise HostLockError(
                f"{self.host}: no answer from the lock command within {max(wait_s, 0) + START_MARGIN_S:g} s"
            ) from None
        if first == LOCKED:
            self.read_lines = self._read_output(channel, stdout, read_timeout_s) if read else []
            channel.settimeout(None)
            self._channel = channel
            self._stop.clear()
            self._heartbeat = threading.Thread(target=self._beat, name=f"hostlock-{self.host}", daemon=True)
            self._heartbeat.start()
            return self
        rest = stdout.read().decode(errors="replace") if first == "BUSY" else ""
        status = channel.recv_exit_status()
        errors = channel.makefile_stderr("r").read().decode(errors="replace").strip()
        channel.close()
        if first == "BUSY":
            raise HostLockBusy(self.host, Holder.parse(rest), wait_s)
        detail = errors.splitlines()[-1] if errors else f"exit status {status}"
        raise HostLockError(one_line(f"{self.host}: cannot take the lock {self.path}: {detail}"))

    def _read_output(self, channel: paramiko.Channel, stdout: paramiko.ChannelFile, timeout_s: float) -> list[str]:
        channel.settimeout(timeout_s)
        lines: list[str] = []
        try:
            for raw in stdout:
                line = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                line = line.rstrip("\n")
                if line == READ_DONE:
                    return lines
                lines.append(line)
        except TimeoutError:
            channel.close()
            raise HostLockError(
                f"{self.host}: the host did not finish reading its state within {timeout_s:g} s under the lock"
            ) from None
        channel.close()
        raise HostLockError(f"{self.host}: the lock's shell ended while reading the host's state")

    def check(self) -> None:
        """Raise LockLost unless the lock is still held."""
        if not self.held:
            raise LockLost(
                f"{self.host}: lost the lock {self.path} (its SSH channel closed or its lease of "
                f"{self.lease_s:g} s ran out): another run may be changing the host, re-run to check"
            )

    def release(self, wait: bool = True) -> None:
        """Let the lock go; `wait` for the host's side to end."""
        channel, self._channel = self._channel, None
        self._stop.set()
        if channel is None:
            return
        try:
            channel.shutdown_write()
            deadline = time.monotonic() + (5 if wait else 0)
            while not channel.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.02)
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the host's side ends at EOF or with the lease
        finally:
            channel.close()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            self._heartbeat = None

    def _beat(self) -> None:
        channel = self._channel
        while channel is not None and not self._stop.wait(self.lease_s / 4):
            try:
                channel.sendall(b".\n")
            except (OSError, EOFError, paramiko.SSHException):
                return  # check() reports the loss

    def __enter__(self) -> HostLock:
        if self._channel is None:
            self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()


def lock_host(host: Host, path: str = LOCK_PATH, lease_s: float = LEASE_S) -> HostLock:
    """The lock over the host's operations' connection."""
    client = getattr(host.connector, "client", None)
    if not isinstance(client, paramiko.SSHClient):
        raise NotOverSsh(
            f"{host.name}: not connected over SSH ({type(host.connector).__name__}): a host lock needs "
            "pyinfra's SSH connector"
        )
    return HostLock(client, host.name, path=path, lease_s=lease_s, sudo=use_sudo(host))
