"""Ledger writes are compare-and-swap, checked on the host in the write's own command: the lock file still names this
run, and the ledger is still what this run read or last wrote. The composed shell commands run here for real (sh,
sha256sum, a real lock file), through a stand-in for pyinfra's Host that runs them locally."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet import hostlock
from gpufleet.operations import files
from gpufleet.operations.files import sha256, write_file
from gpufleet.operations.run import host_run, still_held_test
from gpufleet.vllm.operations.service import _unchanged_test


@dataclass
class Output:
    stdout_lines: list[str]
    stderr_lines: list[str]


class LocalHost:
    """What write_file uses of pyinfra's Host, run on this machine (no sudo: the files are the test's)."""

    name = "local"

    def __init__(self) -> None:
        self.state = type("RunState", (), {})()
        self.data: dict[str, Any] = {}

    def run_shell_command(self, command: str, _sudo: bool = False) -> tuple[bool, Output]:
        proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30)
        return proc.returncode == 0, Output(proc.stdout.splitlines(), proc.stderr.splitlines())

    def put_file(self, io: Any, path: str, _sudo: bool = False) -> bool:
        Path(path).write_bytes(io.read())
        return True


@dataclass
class Lock:
    path: str
    holder: hostlock.Holder = field(default_factory=hostlock.Holder.this_process)


def write(host: LocalHost, path: Path, content: str, guards: list[str | None]) -> bool | None:
    tests = [g for g in guards if g is not None]
    return write_file(host, str(path), content, only_if=" && ".join(tests) or None)  # type: ignore[arg-type]


def test_the_write_happens_only_while_the_ledger_is_what_this_run_read(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "use_sudo", lambda host: False)
    monkeypatch.setattr(files, "atomic_write_command", _no_chown(files.atomic_write_command))
    host, ledger = LocalHost(), tmp_path / "vllm.json"
    ledger.write_text("read\n")
    read = {str(ledger): sha256("read\n")}
    assert write(host, ledger, "mine\n", [_unchanged_test(str(ledger), read)]) is True
    assert ledger.read_text() == "mine\n"
    # Another run wrote it meanwhile: refused (None, not False), the file and the upload as they were left.
    ledger.write_text("theirs\n")
    assert write(host, ledger, "mine again\n", [_unchanged_test(str(ledger), read)]) is None
    assert ledger.read_text() == "theirs\n" and not list(tmp_path.glob(".vllm.json*"))
    # No file when read: only while there is still none.
    new = tmp_path / "new.json"
    assert write(host, new, "first\n", [_unchanged_test(str(new), {str(new): None})]) is True
    assert write(host, new, "second\n", [_unchanged_test(str(new), {str(new): None})]) is None
    assert new.read_text() == "first\n"
    # A path this run never read is written without the comparison.
    assert _unchanged_test(str(new), {}) is None


def test_the_write_happens_only_while_the_lock_file_names_this_run(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "use_sudo", lambda host: False)
    monkeypatch.setattr(files, "atomic_write_command", _no_chown(files.atomic_write_command))
    host, ledger, lock_file = LocalHost(), tmp_path / "vllm.json", tmp_path / "lock"
    lock = Lock(str(lock_file))
    host_run(host).lock = lock  # type: ignore[assignment]  # what still_held_test reads of a HostLock
    assert still_held_test(LocalHost()) is None  # another run's state: no lock taken there
    lock_file.write_text(lock.holder.line() + "\n")  # as the lock's holder script writes it
    assert write(host, ledger, "mine\n", [still_held_test(host)]) is True
    # The lease ran out and another run took the lock: its holder line is the file's now.
    other = hostlock.Holder("alice", "laptop", 4242, "2026-12-02T03:00:00Z")
    lock_file.write_text(other.line() + "\n")
    assert write(host, ledger, "stale\n", [still_held_test(host)]) is None
    assert ledger.read_text() == "mine\n"


def _no_chown(atomic):
    # The test's files belong to the test's user: the write's `chown root:root` would need root.
    return lambda path, **kw: atomic(path, **kw).replace("chown root:root", "true")
