"""The vLLM restart, a unit's rename into place and the env file's check the run's lock on the host, in the same
shell as the step itself (as the ledger writes and the router's restart do): a run stalled past its lease, whose lock
another run holds now, restarts and writes nothing. The commands run here for real (sh, a real lock file; systemctl
stands in as a script that records its arguments)."""

from __future__ import annotations

import os
import shlex
import subprocess
from io import BytesIO
from types import SimpleNamespace

import pytest
from pyinfra.api import Config, Inventory, State, StringCommand
from pyinfra.context import ctx_host, ctx_state

from gpufleet import hostlock
from gpufleet.operations import files
from gpufleet.operations.files import AtomicUpload
from gpufleet.operations.run import host_run, remember
from gpufleet.operations.secret import Hidden
from gpufleet.vllm.facts import HostSnapshot, RunningService
from gpufleet.vllm.operations import service
from gpufleet.vllm.settings import build_spec
from tests.unit.test_ledger_cas import Lock, _no_chown
from tests.unit.test_private_upload import RecordingHost

SPEC = build_spec("gpu1", {"vllm_image": "reg:5000/vllm/vllm-openai:good"})
OTHER = hostlock.Holder("alice", "laptop", 4242, "2026-12-02T03:00:00Z")


@pytest.fixture
def lock(tmp_path):
    """This run's lock, its file naming this run; .lose() hands it to another run, as a lease that ran out does."""
    lock_file = tmp_path / "lock"
    held = Lock(str(lock_file))
    lock_file.write_text(held.holder.line() + "\n")
    return SimpleNamespace(lock=held, lose=lambda: lock_file.write_text(OTHER.line() + "\n"))


def restart_command(lock: Lock) -> str:
    """The shell the vLLM service's restart runs, planned for an inactive unit under `lock`."""
    inventory = Inventory(([("gpu1", {})], {}))
    target = inventory.get_host("gpu1")
    state = State(inventory, Config())
    held = remember(target, HostSnapshot(units={}, running=RunningService("inactive", "dead", False, None, None, ())))
    held.lock = lock  # type: ignore[assignment]  # what still_held_test reads of a HostLock
    with ctx_state.use(state), ctx_host.use(target):
        commands = list(
            service.running._inner(
                spec=SPEC, ledger_path="/var/lib/gpufleet/v.json", changes=[], pin=None, retry_failed=False
            )
        )
    [shell] = [c.get_raw_value() for c in commands if isinstance(c, StringCommand) and "start" in c.get_raw_value()]
    return shell


def test_the_vllm_restart_runs_only_while_the_lock_file_names_this_run(lock, tmp_path):
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "systemctl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    shell = restart_command(lock.lock)
    assert subprocess.run(["sh", "-c", shell], env=env).returncode == 0
    assert calls.read_text() == f"start {SPEC.service}.service\n"
    lock.lose()
    refused = subprocess.run(["sh", "-c", shell], env=env, capture_output=True, text=True)
    assert refused.returncode == 1 and "no longer holds the host's lock" in refused.stderr
    assert calls.read_text() == f"start {SPEC.service}.service\n"  # not started again


def test_a_unit_is_renamed_into_place_only_while_the_lock_file_names_this_run(lock, tmp_path, monkeypatch):
    monkeypatch.setattr(files, "atomic_write_command", _no_chown(files.atomic_write_command))
    unit = tmp_path / "vllm-qwen35.service"
    state = SimpleNamespace(print_output=False, print_input=False)
    host = RecordingHost()
    host_run(host).lock = lock.lock  # type: ignore[assignment]
    assert AtomicUpload(BytesIO(b"[Unit]\n"), str(unit), "644").execute(state, host, {}) is True  # type: ignore[arg-type]
    lock.lose()
    host.log_styled = lambda *a, **k: None  # type: ignore[attr-defined]
    assert AtomicUpload(BytesIO(b"stale\n"), str(unit), "644").execute(state, host, {}) is False  # type: ignore[arg-type]
    assert unit.read_text() == "[Unit]\n"


def test_the_env_file_is_replaced_only_while_the_lock_file_names_this_run(lock, tmp_path, monkeypatch):
    monkeypatch.setattr(files, "atomic_write_command", _no_chown(files.atomic_write_command))
    monkeypatch.setattr(files, "use_sudo", lambda host: False)
    env = tmp_path / "gpufleet" / "vllm-qwen35.env"
    env.parent.mkdir()
    host = RecordingHost()
    host.run_shell_command = _without_install_d(host.run_shell_command)  # type: ignore[method-assign]
    host.log_styled = lambda *a, **k: None  # type: ignore[attr-defined]
    host_run(host).lock = lock.lock  # type: ignore[assignment]
    assert files._install_secret(None, host, str(env), Hidden("VLLM_API_KEY=sk-1\n")) is True  # type: ignore[arg-type]
    lock.lose()
    assert files._install_secret(None, host, str(env), Hidden("VLLM_API_KEY=sk-2\n")) is False  # type: ignore[arg-type]
    assert env.read_text() == "VLLM_API_KEY=sk-1\n"


def _without_install_d(run):
    # `install -d -o root` needs root here; the directory exists.
    return lambda command, **kw: run("true" if command.startswith("install -d") else command, **kw)


def test_without_a_lock_the_restart_is_the_plain_command():
    assert shlex.split(restart_command(None))[-1] == f"systemctl start {SPEC.service}.service"  # type: ignore[arg-type]
