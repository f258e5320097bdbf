"""One operator at a time per host: a lock held for a whole run over the run's own SSH connection.

The lock is a kernel flock(2) on the host, held by a shell on one SSH channel:

    flock -n -E 75 <lockfile> bash -c '<write the holder line into the lockfile>; echo LOCKED;
                                        while read -r -t <lease> _; do :; done'

The controller sends a heartbeat line every lease/4 seconds. The loop, and with it the lock, ends when the channel
reaches EOF (release(), a closed connection, a killed controller whose socket the kernel closes) or when no heartbeat
came for `lease` seconds (a dropped link, a frozen laptop: sshd may not notice a dead TCP peer for hours). The kernel
then drops the flock, so no lock outlives its run by more than the lease, and no one has to guess whether a lock file
is stale. A run that finds the lock held is refused with one line naming the holder, or waits up to `wait_s`.

The holder line lives in the lock file itself: it is only read by a run that could not take the lock, so it always
describes the run holding it (or, for the instant between flock and the write, its predecessor).

Use with pyinfra's connection (pyinfra 3.x: host.connector.client is a paramiko SSHClient once connected):

    with lock_host(host).acquire(wait_s=0) as lock:
        ...  # the whole run; lock.check() before a restart raises LockLost if the lease ran out

This module is the lock and its SSH mechanics only. A run's locks are the run's state (gpufleet.operations.run:
take_lock, taken by each deploy's preflight, which also reads the host in the lock's shell; check_lock and
still_held_test before a write or a restart; release_locks when pyinfra disconnects from the hosts).
"""

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
from typing import Any

import paramiko
from pyinfra.api import Host

from gpufleet.defaults import LEASE_SETTING, WAIT_SETTING
from gpufleet.errors import GpufleetError, one_line
from gpufleet.remote.ssh import use_sudo

# On tmpfs (/run): a flock needs no file that outlives it, and a run that preflight refuses leaves nothing on disk.
# In a directory of root's own (0700), not in world-writable /run/lock: there any local user could hold the lock
# (every deploy refused) or write the holder line the refusal quotes.
LOCK_PATH = "/run/gpufleet/lock"
LEASE_S = 90.0
BUSY_EXIT = 75  # flock's exit status when the lock is held (EX_TEMPFAIL), distinct from the script's own
LOCKED = "LOCKED"
READ_DONE = "@@gpufleet-lock:read-done"  # ends the output of the script run under the lock (acquire's `read`)
# Beyond the wait for the lock itself: time for sudo and the shell to start on a slow host.
START_MARGIN_S = 30.0
# How long a run waits for the lock of a run of this controller that has exited: a run lets its locks go as it
# disconnects, without waiting for each host's shell to see the EOF, so its successor may find them still held for
# a moment (a round trip and a process exit on the host).
LETTING_GO_S = 5.0


def process_ended(pid: int) -> bool:
    """Has process `pid` ended, reaped or not, as /proc tells (False where there is no /proc: it cannot tell)? A run
    killed with its controller (the laptop that died mid-rollout) is reparented, and waits as a zombie until its new
    parent reaps it: signal 0 still reaches it then, /proc says it ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return Path("/proc/self").exists()  # reaped meanwhile; without /proc (not Linux) it cannot tell: alive
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]  # the state follows the command name, which may hold ")"


class HostLockError(GpufleetError):
    """The lock could not be taken for another reason than a holder (no flock, sudo refused, link lost)."""


class HostLockBusy(HostLockError):
    """Another run holds the host. str() names the holder and the fix."""

    def __init__(self, host: str, holder: Holder | None, waited_s: float):
        self.host, self.holder = host, holder
        who = holder.describe() if holder else "another run (it did not say who)"
        waited = f" after waiting {waited_s:g} s" if waited_s else ""
        super().__init__(one_line(f"{host}: locked by {who}{waited} (fix: wait for that run to end, or pass "
                                  f"--data {WAIT_SETTING}=SECONDS to wait for it)"))


class BadLockSettings(HostLockError):
    """The lock's wait or lease setting is not a number of seconds."""


def lock_timings(name: str, settings: Mapping[str, Any]) -> tuple[float, float]:
    """(wait_s, lease_s) from one host's settings. BadLockSettings names the host, both settings and the fix: a
    deploy's plan refuses them first, this is the line for a run that locks before (or without) one."""
    wait, lease = settings.get(WAIT_SETTING), settings.get(LEASE_SETTING)
    try:
        return float(wait), float(lease)  # type: ignore[arg-type]  # anything else is the error below
    except (TypeError, ValueError):
        raise BadLockSettings(one_line(f"{name}: {WAIT_SETTING} and {LEASE_SETTING} must be numbers of seconds, got "
                                       f"{wait!r} and {lease!r} (fix: set them to numbers)")) from None


class NotOverSsh(HostLockError):
    """The host is not reached over pyinfra's SSH connector (@local, a container): there is no session to hold
    a lock with."""


class LockLost(HostLockError):
    """The lease ran out (heartbeats did not reach the host) or the channel closed: another run may hold it now."""


@dataclass(frozen=True)
class Holder:
    user: str
    controller: str
    pid: int
    since: str

    @classmethod
    def this_process(cls) -> Holder:
        return cls(user=getpass.getuser(), controller=socket.gethostname(), pid=os.getpid(),
                   since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def operator(self) -> str:
        """The ledger's `operator` field for a pending change."""
        return f"{self.user}@{self.controller} pid {self.pid}"

    def describe(self) -> str:
        return f"{self.operator()} since {self.since}"

    def exited_here(self) -> bool:
        """Is this an earlier run of this user on this controller whose process has ended?"""
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
        """The holder written by line(), or None for anything else (an empty file, a foreign writer)."""
        fields = dict(word.partition("=")[::2] for word in text.split())
        try:
            return cls(user=fields["user"], controller=fields["controller"], pid=int(fields["pid"]),
                       since=fields["since"])
        except (KeyError, ValueError):
            return None


def whole_seconds(seconds: float) -> str:
    """Seconds as `read -t` and `flock -w` take them: a whole number, rounded up (Python's `{:g}` writes 1000000 as
    1e+06, which `read -t` rejects: the lock would drop at once)."""
    return str(math.ceil(seconds))


def lock_command(path: str, holder: Holder, lease_s: float, wait_s: float, sudo: bool, read: str = "") -> str:
    """The remote command: take the lock (or wait up to wait_s), announce it, run `read` (a read-only sh script:
    its stdout follows the announcement, then READ_DONE), hold the lock while heartbeats come; when busy, print
    the holder line after the exit status code BUSY_EXIT's marker."""
    q = shlex.quote
    hold = ('printf "%s\\n" "$1" > "$2"; echo ' + LOCKED + '; '
            'if [ -n "$4" ]; then sh -c "$4" </dev/null 2>/dev/null; echo ' + READ_DONE + '; fi; '
            'while read -r -t "$3" _; do :; done')
    wait = "-n" if wait_s <= 0 else f"-w {whole_seconds(wait_s)}"
    flock = (f"flock {wait} -E {BUSY_EXIT} {q(path)} bash -c {q(hold)} hold {q(holder.line())} {q(path)} "
             f"{whole_seconds(lease_s)} {q(read)}")
    directory = q(os.path.dirname(path) or ".")
    script = (f"{{ [ -d {directory} ] || mkdir -p -m 0700 {directory}; }} && {flock}; rc=$?; "
              f"if [ $rc -eq {BUSY_EXIT} ]; then echo BUSY; cat {q(path)} 2>/dev/null; fi; exit $rc")
    command = f"bash -c {q(script)}"
    return f"sudo -n {command}" if sudo else command


class HostLock:
    """The run's lock on one host. acquire() returns self, so `with lock.acquire(wait_s): ...` holds it for a block."""

    def __init__(self, client: paramiko.SSHClient, host: str, path: str = LOCK_PATH, lease_s: float = LEASE_S,
                 sudo: bool = False, holder: Holder | None = None):
        self.client, self.host, self.path, self.lease_s, self.sudo = client, host, path, lease_s, sudo
        self.holder = holder or Holder.this_process()
        self._channel: paramiko.Channel | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.read_lines: list[str] = []  # the output of acquire's `read` script

    @property
    def held(self) -> bool:
        return self._channel is not None and not self._channel.exit_status_ready() and not self._channel.closed

    def acquire(self, wait_s: float = 0, read: str = "", read_timeout_s: float = START_MARGIN_S) -> HostLock:
        """Take the lock, waiting up to wait_s seconds for a holder to finish (at least LETTING_GO_S for an exited
        run of this controller). Raises HostLockBusy naming the holder, or HostLockError with the host's own words.

        read: a read-only sh script the host runs as soon as the lock is taken, in the lock's own shell (one sudo
        and one round trip less than a command of its own); its stdout lines land in `read_lines`, within
        read_timeout_s."""
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
            raise HostLockError(f"{self.host}: no answer from the lock command within "
                                f"{max(wait_s, 0) + START_MARGIN_S:g} s") from None
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
        """The read script's stdout lines, up to READ_DONE (the lock is let go when they do not come)."""
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
            raise HostLockError(f"{self.host}: the host did not finish reading its state within {timeout_s:g} s "
                                "under the lock") from None
        channel.close()
        raise HostLockError(f"{self.host}: the lock's shell ended while reading the host's state")

    def check(self) -> None:
        """Raise LockLost unless the lock is still held: call it before each step that must not interleave
        with another run (a restart)."""
        if not self.held:
            raise LockLost(f"{self.host}: lost the lock {self.path} (its SSH channel closed or its lease of "
                           f"{self.lease_s:g} s ran out): another run may be changing the host, re-run to check")

    def release(self, wait: bool = True) -> None:
        """Let the lock go: EOF on the channel ends the remote loop and the kernel drops the flock. wait: until the
        host's side has ended, so the next lock taken in this process finds it free; a run that is disconnecting
        need not wait (a later run of this controller waits for an exited one's lock: LETTING_GO_S)."""
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
            pass  # the link is gone: the remote side ends by EOF or by the lease
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
                return  # check() reports the loss: the channel is closed or exited

    def __enter__(self) -> HostLock:
        if self._channel is None:
            self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def lock_host(host: Host, path: str = LOCK_PATH, lease_s: float = LEASE_S) -> HostLock:
    """The lock for a connected pyinfra host, over the connection its operations use (sudo unless root's)."""
    client = getattr(host.connector, "client", None)
    if not isinstance(client, paramiko.SSHClient):
        raise NotOverSsh(f"{host.name}: not connected over SSH ({type(host.connector).__name__}): a host lock needs "
                         "pyinfra's SSH connector")
    return HostLock(client, host.name, path=path, lease_s=lease_s, sudo=use_sudo(host))
