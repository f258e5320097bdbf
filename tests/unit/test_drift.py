"""What really runs against what the unit says: the snapshot's reading, the deploy's restart on drift, `verify`'s
label check, and the atomic replacement of the files the deploy writes (run here, in a real shell)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from pyinfra.api import FunctionCommand, StringCommand

from gpufleet.cli import verify as verify_cli
from gpufleet.cli.health_tables import spec_cell
from gpufleet.health import HealthReport, HealthState
from gpufleet.health.check import check, spec_drift
from gpufleet.health.runner import HostResult, HostTarget
from gpufleet.hoststate.paths import ledger_path
from gpufleet.operations.files import replace_command, temp_path
from gpufleet.remote.transport import ContainerInfo
from gpufleet.units import unit_name
from gpufleet.vllm.facts import HostSnapshot, RunningService, parse_snapshot
from gpufleet.vllm.host_command import snapshot_command
from gpufleet.vllm.operations import nvidia, service
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.unit import render_unit
from gpufleet.wire.identity import Expected
from tests.loopback import LoopbackTransport
from tests.ports import free_port
from tests.unit.test_health_cli import inventory  # noqa: F401  (fixture)
from tests.unit.test_operations_alone import PINNED, TAG, run_alone
from tests.unit.test_vllm_facts import PATHS, healthy

SPEC = build_spec("gpu1", {"vllm_image": TAG})
UNIT = unit_name(SPEC.service)
STATE_FILE = ledger_path(SPEC.service)
HEADER = render_unit(SPEC, PINNED).splitlines()[1]
STANDIN = Path(__file__).resolve().parents[2] / "src" / "gpufleet" / "sandbox" / "standin"


def running(*containers: tuple[str, str], reload: str = "no", active: str = "active") -> list[str]:
    return [
        f"ActiveState={active}",
        "SubState=running",
        f"NeedDaemonReload={reload}",
        f"Header={HEADER}",
        *(f"Container={label}|{image}" for label, image in containers),
    ]


# --- the snapshot ------------------------------------------------------------------------------------------------
def test_the_unit_header_gives_the_spec_and_digest_it_pins():
    snap = parse_snapshot(healthy(running=running((SPEC.spec_hash, PINNED))))
    assert snap.running == RunningService(
        "active", "running", False, SPEC.spec_hash, PINNED, ((SPEC.spec_hash, PINNED),)
    )
    assert snap.running.drift() == []


def test_each_kind_of_drift_is_named():
    other = PINNED.replace("1" * 64, "3" * 64)
    assert parse_snapshot(healthy(running=running((SPEC.spec_hash, PINNED), reload="yes"))).running.drift() == [
        "systemd has not loaded the unit file on disk (NeedDaemonReload=yes)"
    ]
    assert parse_snapshot(healthy(running=running(("0badc0de", PINNED)))).running.drift() == [
        f"the container runs spec 0badc0de, the unit spec {SPEC.spec_hash}"
    ]
    assert parse_snapshot(healthy(running=running((SPEC.spec_hash, other)))).running.drift() == [
        f"the container runs {other}, the unit pins {PINNED}"
    ]
    two = parse_snapshot(healthy(running=running((SPEC.spec_hash, PINNED), (SPEC.spec_hash, PINNED)))).running
    assert two.drift() == ["2 containers carry the service's label"]


def test_a_stopped_service_or_a_foreign_unit_is_no_drift():
    assert parse_snapshot(healthy(running=running(active="failed"))).running.drift() == []
    foreign = ["ActiveState=active", "NeedDaemonReload=no", "Header=[Unit]", "Container=|other:1"]
    assert parse_snapshot(healthy(running=foreign)).running.drift() == []
    assert parse_snapshot(healthy(units=[])).running == RunningService()  # nothing read: nothing runs
    # systemd's state of the unit comes from the one `systemctl show` of the units section (its second block)
    assert parse_snapshot(healthy()).running == RunningService(active_state="active")


def test_one_systemctl_call_gives_the_units_the_service_unit_and_its_state():
    units = [
        "Id=docker.service",
        "LoadState=loaded",
        "ActiveState=active",
        "SubState=running",
        "FragmentPath=/lib/systemd/system/docker.service",
        "UnitFileState=enabled",
        "NeedDaemonReload=no",
        "NRestarts=0",
        "",
        "Id=vllm-qwen35.service",
        "LoadState=loaded",
        "ActiveState=activating",
        "SubState=auto-restart",
        "FragmentPath=/etc/systemd/system/vllm-qwen35.service",
        "UnitFileState=enabled",
        "NeedDaemonReload=yes",
        "NRestarts=4",
    ]
    snap = parse_snapshot(
        healthy(
            units=units,
            service_unit=["FirstLine=# Managed by gpufleet"],
            running=[f"Header={HEADER}", f"Container={SPEC.spec_hash}|{PINNED}"],
        )
    )
    assert snap.units == {"docker.service": ("active", "enabled"), UNIT: ("activating", "enabled")}
    assert snap.service_unit is not None and snap.service_unit.fragment_path == f"/etc/systemd/system/{UNIT}"
    assert snap.service_unit.first_line == "# Managed by gpufleet" and snap.service_unit.exists
    assert (snap.running.active_state, snap.running.sub_state, snap.running.restarts) == (
        "activating",
        "auto-restart",
        4,
    )
    assert snap.running.need_daemon_reload and snap.running.unit_spec_hash == SPEC.spec_hash


def test_what_runs_is_read_under_timeout():
    command = snapshot_command(PATHS)
    for program in ("systemctl show", "docker ps"):
        lines = [line for line in command.splitlines() if program in line]
        assert len(lines) == 1 and f"$t {program}" in lines[0], lines


# --- the deploy: drift is a change -------------------------------------------------------------------------------
def described(command: StringCommand | FunctionCommand) -> str:
    return command.get_raw_value() if isinstance(command, StringCommand) else command.function.__name__


def converged(run: RunningService) -> HostSnapshot:
    snap = HostSnapshot(
        units={UNIT: ("active", "enabled")},
        health_code="200",
        served_models=[(SPEC.served_model_name, SPEC.max_model_len)],
        running=run,
    )
    return snap


def test_a_unit_written_but_never_loaded_is_reloaded_restarted_and_verified_with_the_soak():
    snap = converged(RunningService("active", "running", True, SPEC.spec_hash, PINNED, (("old", PINNED),)))
    commands = [
        described(c)
        for c in run_alone(
            service.running, snap, spec=SPEC, ledger_path=STATE_FILE, changes=[], pin=PINNED, retry_failed=False
        )
    ]
    assert commands == ["systemctl daemon-reload", "still_locked", "_begin", f"sh -c 'systemctl restart {UNIT}'"]
    verify, roll_back = run_alone(
        service.ready, snap, spec=SPEC, verify=lambda *a: True, roll_back=lambda *a: True, changes=[], soak_s=20.0
    )
    assert isinstance(verify, FunctionCommand) and verify.args == (20.0,)  # verified with the soak
    assert isinstance(roll_back, FunctionCommand) and roll_back.args == ()  # then rolled back at once if it failed


def test_a_container_from_another_spec_is_restarted():
    snap = converged(RunningService("active", "running", False, SPEC.spec_hash, PINNED, (("handmade", PINNED),)))
    commands = run_alone(
        service.running, snap, spec=SPEC, ledger_path=STATE_FILE, changes=[], pin=PINNED, retry_failed=False
    )
    # The restart comes right after the check that this run still holds the host's lock, and the ledger's pending
    # record (a no-op when what restarts is the committed version).
    assert [described(c) for c in commands] == ["still_locked", "_begin", f"sh -c 'systemctl restart {UNIT}'"]


def test_what_the_unit_says_running_is_left_alone():
    snap = converged(RunningService("active", "running", False, SPEC.spec_hash, PINNED, ((SPEC.spec_hash, PINNED),)))
    assert (
        run_alone(service.running, snap, spec=SPEC, ledger_path=STATE_FILE, changes=[], pin=PINNED, retry_failed=False)
        == []
    )
    assert (
        run_alone(
            service.ready, snap, spec=SPEC, verify=lambda *a: True, roll_back=lambda *a: True, changes=[], soak_s=20.0
        )
        == []
    )


# --- verify and status: the label against the inventory's spec ---------------------------------------------------
class Labelled(LoopbackTransport):
    def __init__(self, label: str | None):
        super().__init__()
        self.label = label

    def container(self, service: str) -> ContainerInfo | None:
        return ContainerInfo(id="c0ffee", state="running", spec_hash=self.label)


def test_check_names_the_drift_and_keeps_what_the_server_said():
    expected = Expected(service="v", port=free_port(), served_model_name="m", spec_hash="abc")
    report = check(Labelled("old"), expected)
    assert report.state is HealthState.STARTING  # nothing listens: the server's own state is kept
    assert report.detail.startswith(
        "drift: container c0ffee runs spec old, the inventory's spec is abc (fix: converge the host); container running"
    )
    assert spec_drift(expected, ContainerInfo(id="c", state="running", spec_hash="abc")) is None
    assert (
        spec_drift(Expected(service="v", port=1, served_model_name="m"), ContainerInfo(id="c", state="running")) is None
    )


def test_a_ready_server_from_another_spec_fails_verify(monkeypatch, inventory):
    def results(targets, **_):
        for t in targets:
            assert t.expected.spec_hash  # verify holds each host to its inventory spec
        c = ContainerInfo(id="c0ffee", state="running", spec_hash="old")
        drift = spec_drift(targets[0].expected, c)
        return [
            HostResult(t, HealthReport(HealthState.MISCONFIGURED, f"{drift}; /health 200", host=t.name, container=c))
            for t in targets
        ]

    monkeypatch.setattr(verify_cli, "check_fleet", results)
    out = CliRunner().invoke(verify_cli.verify, [str(inventory)], terminal_width=200)
    assert out.exit_code == 1 and "box-a: misconfigured: drift: container c0ffee runs spec old" in out.output
    table = CliRunner().invoke(verify_cli.status, [str(inventory)], terminal_width=200)
    assert "old (drift)" in table.output and "spec" in table.output


def test_ready_is_still_ready_when_the_label_matches():
    target = HostTarget("h", {}, Expected(service="v", port=1, served_model_name="m", spec_hash="abc"))
    ok = HostResult(
        target, HealthReport(HealthState.READY, "", container=ContainerInfo("c", "running", spec_hash="abc"))
    )
    assert spec_cell(ok).plain == "abc" and ok.ok


# --- atomic replacement ------------------------------------------------------------------------------------------
def test_replace_renames_a_flushed_temp_file_over_the_target(tmp_path):
    target = tmp_path / "vllm.service"
    target.write_text("old\n")
    tmp = Path(temp_path(str(target)))
    assert tmp.parent == tmp_path and tmp.name == ".vllm.service.gpufleet-tmp"
    tmp.write_text("new\n")
    inode = tmp.stat().st_ino
    subprocess.run(["sh", "-c", replace_command(str(tmp), str(target))], check=True)
    assert target.read_text() == "new\n" and target.stat().st_ino == inode and not tmp.exists()


def test_daemon_json_is_merged_beside_it_and_renamed_over(tmp_path):
    # The real command, with the stand-in nvidia-ctk (the same merge as NVIDIA's) on PATH.
    daemon = tmp_path / "docker" / "daemon.json"
    daemon.parent.mkdir()
    daemon.write_text('{"log-opts": {"max-size": "10m"}}')
    os.chmod(daemon, 0o640)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ctk = bin_dir / "nvidia-ctk"
    ctk.write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN / "nvidia_ctk.py"} "$@"\n')
    ctk.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    before = daemon.stat().st_ino
    subprocess.run(
        ["sh", "-c", nvidia.configure_runtime_command(str(daemon))], check=True, env=env, capture_output=True
    )
    text = daemon.read_text()
    assert '"max-size": "10m"' in text and '"nvidia"' in text
    assert daemon.stat().st_ino != before and stat.S_IMODE(daemon.stat().st_mode) == 0o640  # renamed, mode kept
    assert sorted(p.name for p in daemon.parent.iterdir()) == ["daemon.json"]
