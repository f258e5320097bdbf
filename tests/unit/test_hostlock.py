"""The per-host lock against a real sshd on 127.0.0.1 (tests/sshd.py): real channels, a real flock on the host side.

The lock file lives in the test's temp dir; the session is the local user's, so no sudo. The process runs under
gevent's patch_all (tests/conftest.py imports gpufleet.inventory first), as the CLI does: the heartbeat is a greenlet.
The holders that get killed run in a subprocess of their own, started and ended by PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.hostlock import (
    BadLockSettings,
    Holder,
    HostLock,
    HostLockBusy,
    HostLockError,
    LockLost,
    LockTimings,
    lock_timings,
)
from tests.sshd import Sshd

REPO = Path(__file__).resolve().parents[2]
ALICE = Holder(user="alice", controller="laptop", pid=4242, since="2026-12-01T03:00:00Z")
LEASE_S = 3.0


@pytest.fixture
def lock_file(tmp_path: Path) -> str:
    return str(tmp_path / "locks" / "host.lock")


def lock(server: Sshd, path: str, holder: Holder | None = None, lease_s: float = LEASE_S) -> HostLock:
    return HostLock(server.client(), "gft-a", path=path, lease_s=lease_s, holder=holder)


def test_a_second_run_is_refused_with_the_holder_and_the_fix(sshd, lock_file):
    with lock(sshd, lock_file, ALICE).acquire(), pytest.raises(HostLockBusy) as refused:
        lock(sshd, lock_file).acquire()
    assert str(refused.value) == (
        "gft-a: locked by alice@laptop pid 4242 since 2026-12-01T03:00:00Z (fix: wait for that run to end, or pass "
        "--data gpufleet_lock_wait_s=SECONDS to wait for it)"
    )
    assert refused.value.holder == ALICE
    # Released: the next run gets it at once.
    with lock(sshd, lock_file).acquire() as again:
        again.check()


def test_a_refusal_after_waiting_says_how_long(sshd, lock_file):
    with lock(sshd, lock_file, ALICE).acquire():
        started = time.monotonic()
        with pytest.raises(HostLockBusy, match=r"^gft-a: locked by alice@laptop pid 4242 .* after waiting 1 s \(fix"):
            lock(sshd, lock_file).acquire(wait_s=1)
        assert 0.9 < time.monotonic() - started < 5


def test_a_waiting_run_gets_the_lock_when_the_holder_releases(sshd, lock_file):
    first = lock(sshd, lock_file).acquire()
    threading.Timer(1.0, first.release).start()
    started = time.monotonic()
    second = lock(sshd, lock_file).acquire(wait_s=20)
    waited = time.monotonic() - started
    try:
        assert 0.9 < waited < 5, waited
        assert second.held and not first.held
    finally:
        second.release()


def exited_pid() -> int:
    """The PID of a process of ours that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_lock_of_an_exited_run_of_this_controller_is_waited_for(sshd, lock_file):
    # A run lets its locks go as it disconnects, without waiting for the host's side: the next run of the same
    # controller may find the lock still held by it for a moment, and waits rather than refusing.
    predecessor = Holder.this_process()
    predecessor = Holder(predecessor.user, predecessor.controller, exited_pid(), predecessor.since)
    assert predecessor.exited_here()
    first = lock(sshd, lock_file, predecessor).acquire()
    threading.Timer(1.0, first.release, kwargs={"wait": False}).start()
    started = time.monotonic()
    second = lock(sshd, lock_file).acquire(wait_s=0)
    try:
        assert 0.9 < time.monotonic() - started < 5
        assert second.held
    finally:
        second.release()


def test_a_run_that_ended_but_was_not_reaped_yet_has_exited():
    # A run killed with its controller is reparented and stays a zombie until its new parent reaps it: signal 0
    # still reaches it, yet it holds nothing any more (its sockets are closed), so its lock is waited for too.
    # The zombie is the child of a helper process that never reaps it (this process's own children are reaped by
    # gevent's child watcher at once).
    me = Holder.this_process()
    parent = subprocess.Popen([sys.executable, "-c", ZOMBIE_PARENT], stdout=subprocess.PIPE, text=True)
    try:
        zombie = int(parent.stdout.readline())  # type: ignore[union-attr]
        for _ in range(100):
            if Path(f"/proc/{zombie}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                break
            time.sleep(0.05)
        os.kill(zombie, 0)  # signal 0 still reaches it
        assert Holder(me.user, me.controller, zombie, me.since).exited_here()
        assert not Holder(me.user, me.controller, parent.pid, me.since).exited_here()  # its parent runs
    finally:
        parent.kill()
        parent.wait()


ZOMBIE_PARENT = """
import os, sys, time
pid = os.fork()
if pid == 0:
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


def test_only_an_exited_run_of_this_controller_is_waited_for(sshd, lock_file):
    me = Holder.this_process()
    alive_here = Holder(me.user, me.controller, os.getppid(), me.since)
    elsewhere = Holder(me.user, "another-laptop", exited_pid(), me.since)
    for holder in (ALICE, alive_here, elsewhere, me):
        assert not holder.exited_here()
    with lock(sshd, lock_file, elsewhere).acquire():
        started = time.monotonic()
        with pytest.raises(HostLockBusy, match=r"locked by .*another-laptop"):
            lock(sshd, lock_file).acquire()
        assert time.monotonic() - started < 3  # refused at once, not after LETTING_GO_S


def test_a_read_runs_under_the_lock_and_its_output_comes_back(sshd, lock_file):
    # What preflight reads (the host snapshot) runs in the lock's shell: only while the lock is held.
    read = f"echo first; printf 'no final newline'; echo; cat {lock_file}"
    with lock(sshd, lock_file, ALICE).acquire(read=read) as held:
        assert held.read_lines == ["first", "no final newline", ALICE.line()]
        held.check()


def test_a_read_that_does_not_finish_in_time_lets_the_lock_go(sshd, lock_file):
    slow = lock(sshd, lock_file)
    with pytest.raises(HostLockError, match=r"^gft-a: the host did not finish reading its state within 1 s"):
        slow.acquire(read="sleep 3", read_timeout_s=1)
    assert not slow.held
    # The host's side lets go when the read ends (its programs are bounded: the snapshot's each run under
    # `timeout`), as its shell then finds the channel closed; not after the lease.
    started = time.monotonic()
    with lock(sshd, lock_file).acquire(wait_s=LEASE_S * 3) as next_run:
        next_run.check()
    assert time.monotonic() - started < LEASE_S * 2


# Heartbeats keep a 1 s lease past its lease; a 1,000,000 s lease holds with no heartbeat in this test's time (rendered
# as 1e+06, `read -t` refused it and the lock dropped at once).
@pytest.mark.parametrize(("lease_s", "held_s"), [(1.0, 2.5), (1_000_000, 1.5)], ids=["heartbeats", "a-million-seconds"])
def test_a_held_lock_stays_held(sshd, lock_file, lease_s, held_s):
    with lock(sshd, lock_file, ALICE, lease_s=lease_s).acquire() as held:
        time.sleep(held_s)
        held.check()
        with pytest.raises(HostLockBusy):
            lock(sshd, lock_file).acquire()


def test_the_lock_directory_is_made_for_its_owner_alone(sshd, lock_file):
    with lock(sshd, lock_file).acquire():
        assert Path(lock_file).parent.stat().st_mode & 0o777 == 0o700


def test_closing_the_connection_frees_the_lock_at_once(sshd, lock_file):
    first = lock(sshd, lock_file, ALICE)
    first.acquire()
    first.client.close()
    started = time.monotonic()
    second = lock(sshd, lock_file).acquire(wait_s=LEASE_S * 3)
    try:
        # Well under the lease: the closed channel freed it, not the lease running out (a loaded machine may take
        # a second or more to run the remote flock, so no tighter bound).
        assert time.monotonic() - started < LEASE_S * 2 / 3
        with pytest.raises(LockLost, match=r"^gft-a: lost the lock .* lease of 3 s ran out\)"):
            first.check()
    finally:
        second.release()


def test_a_host_that_cannot_take_the_lock_says_why_in_its_own_words(sshd, tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    with pytest.raises(HostLockError) as err:
        lock(sshd, str(tmp_path / "not-a-dir" / "host.lock")).acquire()
    assert not isinstance(err.value, HostLockBusy)
    assert str(err.value).startswith(f"gft-a: cannot take the lock {tmp_path}/not-a-dir/host.lock: mkdir: ")
    assert "\n" not in str(err.value)


HOLDER_SCRIPT = textwrap.dedent("""
    import sys, time
    import gpufleet.inventory  # gevent's patch_all first, as in the CLI
    import paramiko
    from gpufleet.hostlock import HostLock
    port, user, key, known_hosts, path, lease = sys.argv[1:]
    client = paramiko.SSHClient()
    client.load_host_keys(known_hosts)
    client.connect("127.0.0.1", port=int(port), username=user, key_filename=key, look_for_keys=False,
                   allow_agent=False, timeout=10)
    HostLock(client, "gft-a", path=path, lease_s=float(lease)).acquire()
    print("HELD", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def holder_process(sshd, lock_file, tmp_path) -> Iterator[subprocess.Popen[str]]:
    """A controller holding the lock in a process of its own (ended by PID, whatever the test did to it)."""
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(sshd.known_hosts_line())
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, str(sshd.port), sshd.user, str(sshd.client_key), str(known_hosts),
         lock_file, str(LEASE_S)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD"
        with pytest.raises(HostLockBusy, match=rf"locked by \S+ pid {proc.pid} since "):
            lock(sshd, lock_file).acquire()
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_killed_controller_frees_the_lock_within_the_lease(sshd, lock_file, holder_process):
    os.kill(holder_process.pid, signal.SIGKILL)
    holder_process.wait()
    started = time.monotonic()
    taken = lock(sshd, lock_file).acquire(wait_s=LEASE_S * 3)
    try:
        # The kernel closed the dead controller's socket: sshd saw EOF, no need to wait for the lease.
        assert time.monotonic() - started < LEASE_S
    finally:
        taken.release()


def test_a_frozen_controller_loses_the_lock_when_its_lease_runs_out(sshd, lock_file, holder_process):
    # SIGSTOP: the TCP connection stays open but no heartbeat comes, as with a dropped link or a closed laptop lid.
    os.kill(holder_process.pid, signal.SIGSTOP)
    started = time.monotonic()
    taken = lock(sshd, lock_file).acquire(wait_s=LEASE_S * 3)
    waited = time.monotonic() - started
    try:
        # Freed by the lease (the last heartbeat came at most lease/4 before the stop), not before and not much later.
        assert LEASE_S * 0.6 < waited < LEASE_S + 1.5, waited
    finally:
        taken.release()


# --- the run's locks, as the deploy keeps them per host (gpufleet.operations.run) ----------------------------------
def test_a_run_checks_and_releases_the_locks_it_keeps_and_a_host_not_over_ssh_has_none(sshd, lock_file, tmp_path):
    from pyinfra.api import Config, Inventory, State

    from gpufleet.hostlock import NotOverSsh, lock_host
    from gpufleet.operations.run import check_lock, keep_lock, release_locks, take_lock

    ssh = {
        "ssh_hostname": "127.0.0.1",
        "ssh_port": sshd.port,
        "ssh_user": sshd.user,
        "ssh_key": str(sshd.client_key),
        "ssh_known_hosts_file": str(tmp_path / "known_hosts"),
    }
    inventory = Inventory(([("gft-a", ssh), ("@local", {})], {}))
    state = State(inventory, Config())
    remote, local = inventory.get_host("gft-a"), inventory.get_host("@local")
    for target in (remote, local):
        target.connect(raise_exceptions=True)
    try:
        with pytest.raises(NotOverSsh, match=r"^@local: not connected over SSH \(LocalConnector\)"):
            lock_host(local)
        check_lock(local)  # no lock taken: nothing to lose
        assert take_lock(local, LockTimings(0, LEASE_S)) is None
        keep_lock(remote, lock_host(remote, path=lock_file, lease_s=LEASE_S).acquire())
        check_lock(remote)
        with pytest.raises(HostLockBusy):
            lock(sshd, lock_file).acquire()
        release_locks(state)
        check_lock(remote)  # released and forgotten: the run no longer claims the host
        with lock(sshd, lock_file).acquire():  # and another run gets it at once
            pass
    finally:
        release_locks(state)
        remote.disconnect()
        remote.connector.client.close()


def test_lock_settings_that_are_not_numbers_are_one_line_naming_the_host_both_settings_and_the_fix():
    assert lock_timings("gft-a", {"gpufleet_lock_wait_s": 0, "gpufleet_lock_lease_s": "90"}) == (0.0, 90.0)
    for wait, lease in (("soon", 90), (0, None), ([], {})):
        with pytest.raises(BadLockSettings) as refused:
            lock_timings("router gft-r", {"gpufleet_lock_wait_s": wait, "gpufleet_lock_lease_s": lease})
        assert str(refused.value) == (
            f"router gft-r: gpufleet_lock_wait_s and gpufleet_lock_lease_s must be numbers "
            f"of seconds, got {wait!r} and {lease!r} (fix: set them to numbers)"
        )
    with pytest.raises(BadLockSettings, match=r"^gft-a: .* got None and None "):
        lock_timings("gft-a", {})
