"""The test hosts' GPU health stand-ins against the recordings: nvidia-smi's health fields, --help-query-gpu and its
refusal of a field the driver lacks, each injectable fault, and the kernel log (the dmesg stand-in and the Xid lines
gpufleet.sandbox.gpu_faults writes). The health query and the kernel log's filter run in a real shell over them."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.facts.gpu_health import kernel_shell, parse_health, parse_kernel_log, query_shell
from gpufleet.facts.gpu_verdict import judge
from gpufleet.sandbox import gpu_faults, kernel_log
from gpufleet.sandbox import nvidia_smi as smi
from gpufleet.wire.gpu_verdicts import GpuSettings, Verdict

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
HEALTH = RECORDED / "h200-health"


def host(tmp_path: Path, profile: smi.Profile) -> Path:
    """A host root with the stand-ins, and a bin dir putting its nvidia-smi and dmesg first on PATH."""
    smi.write_host_files(tmp_path, profile)
    kernel_log.install(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "nvidia-smi").write_text(
        f'#!/bin/sh\necho "$1" >> {calls}\nexec {sys.executable} -I -S {tmp_path}{smi.HOST_MODULE} '
        f'{tmp_path}{smi.HOST_PROFILE} "$@"\n'
    )
    (bin_dir / "dmesg").write_text(
        (tmp_path / kernel_log.STANDIN[1:]).read_text().replace(kernel_log.LOG, f"{tmp_path}{kernel_log.LOG}")
    )
    for program in ("nvidia-smi", "dmesg"):
        (bin_dir / program).chmod(0o755)
    return tmp_path


def read(root: Path) -> tuple[list[str], list[str], list[str]]:
    """The health query and the kernel log's filter, as the host snapshot runs them; the nvidia-smi calls made."""
    (root / "calls").unlink(missing_ok=True)
    out = subprocess.run(
        ["sh", "-c", f"t=; {query_shell()}; echo @@split; {kernel_shell()}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{root}/bin:/usr/bin:/bin"},
    )
    query, kernel = out.stdout.split("@@split\n")
    return query.splitlines(), kernel.splitlines(), (root / "calls").read_text().split()


def verdicts(root: Path) -> list[Verdict]:
    query, kernel, _ = read(root)
    return [g.verdict for g in judge(parse_health(query, kernel), GpuSettings()).gpus]


def _masked(csv: str) -> str:
    """Identities and live readings differ between any two H200s and calls: uuid, temperature, power."""
    csv = re.sub(r"GPU-[0-9a-f-]+", "UUID", csv)
    return re.sub(r", \d+, [\d.]+ W$", ", TEMP, POWER W", csv, flags=re.MULTILINE)


# --- nvidia-smi ------------------------------------------------------------------------------------------------
def test_help_query_gpu_is_the_recorded_drivers_byte_for_byte(tmp_path):
    root = host(tmp_path, smi.make_profile(1, seed="h"))
    out = subprocess.run([f"{root}/bin/nvidia-smi", "--help-query-gpu"], capture_output=True, text=True)
    assert out.stdout == (HEALTH / "help-query-gpu.txt").read_text() and out.returncode == 0


def test_a_field_the_recorded_driver_lacks_fails_the_whole_query_as_recorded():
    expected, rc = smi._read(HEALTH, "query-gpu-reset-status-rejected.txt")
    answer = smi.render(
        smi.make_profile(1), ["--query-gpu=index,ecc.mode.current,reset_status.reset_required", "--format=csv"]
    )
    assert answer == smi.Result(expected, rc)


def test_a_healthy_gpu_answers_the_recorded_health_query_with_the_recorded_values():
    recorded = (HEALTH / "query-gpu-health.csv").read_text()
    fields = recorded.splitlines()[0].replace(" [W]", "").split(", ")
    profile = smi.make_profile(1, seed="h")
    answer = smi.render(profile, [f"--query-gpu={','.join(fields)}", "--format=csv"]).stdout
    assert _masked(answer) == _masked(recorded)


def test_the_health_query_on_the_recorded_driver_is_one_call_and_reads_healthy(tmp_path):
    root = host(tmp_path, smi.make_profile(3, seed="h"))
    query, kernel, calls = read(root)
    assert len(calls) == 1 and calls[0].startswith("--query-gpu=index,pci.bus_id,")
    health = parse_health(query, kernel)
    assert health.error is None and health.lacks == () and health.events == () and health.kernel_log_error is None
    assert [g.bus_id for g in health.gpus] == ["00000000:00:06.0", "00000000:00:07.0", "00000000:00:08.0"]
    assert verdicts(root) == [Verdict.OK] * 3


def test_an_older_driver_is_asked_the_fields_its_help_lists_and_what_it_lacks_is_named(tmp_path):
    # An older driver (built: its help is the recorded one without the newer names, with reset_status.*): the first
    # query is refused, the shell learns the fields from --help-query-gpu and asks those.
    newer = {"gpu_recovery_action", "clocks_event_reasons.active", "pcie.link.gen.gpucurrent"}
    profile = smi.make_profile(2, seed="h")
    profile.valid_fields = [f for f in profile.valid_fields if f not in newer] + [
        "reset_status.reset_required",
        "reset_status.drain_and_reset_recommended",
    ]
    root = host(tmp_path, profile)
    gpu_faults.set_fields(root, 1, {"reset_status.reset_required": "Yes", "clocks_throttle_reasons.active": "0x40"})
    query, kernel, calls = read(root)
    assert calls[1] == "--help-query-gpu" and len(calls) == 3
    assert "clocks_throttle_reasons.active" in calls[2] and "reset_status.reset_required" in calls[2]
    assert not newer & set(calls[2].split("=", 1)[1].split(","))
    health = parse_health(query, kernel)
    assert health.error is None and health.lacks == ("gpu_recovery_action",)
    assert health.gpus[1].reset_required is True and health.gpus[1].clocks_event_reasons == 0x40
    assert verdicts(root) == [Verdict.OK, Verdict.RESET_GPU]


@pytest.mark.parametrize(("fault", "verdict"), [
    ("remap-pending", Verdict.RESET_GPU), ("reset-required", Verdict.RESET_GPU), ("reboot-required", Verdict.REBOOT),
    ("remap-failure", Verdict.SERVICE), ("thermal", Verdict.DEGRADED), ("power-brake", Verdict.DEGRADED),
    ("ecc-uncorrected", Verdict.DEGRADED), ("ecc-corrected", Verdict.DEGRADED), ("unreadable", Verdict.DEGRADED),
])  # fmt: skip
def test_each_injected_fault_is_the_verdict_of_that_gpu_only(tmp_path, fault, verdict):
    root = host(tmp_path, smi.make_profile(3, seed="h"))
    gpu_faults.inject(root, 1, fault)
    assert verdicts(root) == [Verdict.OK, verdict, Verdict.OK]
    gpu_faults.clear(root)
    assert verdicts(root) == [Verdict.OK] * 3


def test_old_profiles_without_fields_still_answer():
    # A profile written before the health fields (no "fields" key) answers them healthy.
    profile = smi.host_profile(smi.make_profile(1).to_json().replace('"fields": {}', '"x": 0'))
    assert (
        "No, No, None"
        in smi.render(
            profile,
            ["--query-gpu=remapped_rows.pending,remapped_rows.failure,gpu_recovery_action", "--format=csv,noheader"],
        ).stdout
    )


# --- the kernel log -------------------------------------------------------------------------------------------------
def test_an_injected_xid_is_read_back_on_its_gpu_at_its_time(tmp_path):
    root = host(tmp_path, smi.make_profile(3, seed="h"))
    when = time.time() - 3600
    lines = gpu_faults.log_xid(root, 2, 79, at=when)
    gpu_faults.log_xid(root, 0, 13)
    assert lines[0].endswith("NVRM: Xid (PCI:0000:00:08): 79, GPU has fallen off the bus.")
    assert lines[1].endswith("NVRM: GPU 0000:00:08.0: GPU has fallen off the bus.")
    query, kernel, _ = read(root)
    events = {e.code: e for e in parse_health(query, kernel).events}
    assert events[79].bus == events[None].bus == (0, 0, 8) and abs(events[79].at - when) < 0.001
    assert events[13].bus == (0, 0, 6) and events[13].text.startswith("Graphics SM Warp Exception")
    assert verdicts(root) == [Verdict.RESTART_APP, Verdict.OK, Verdict.REBOOT]
    gpu_faults.clear(root)  # a reboot: an empty kernel log
    assert verdicts(root) == [Verdict.OK] * 3


def test_the_dmesg_stand_in_prints_only_what_gpufleet_asks_and_only_to_root(tmp_path):
    root = host(tmp_path, smi.make_profile(1, seed="h"))
    kernel_log.append(root, [kernel_log.line(0, "NVRM: Xid (PCI:0000:00:06): 13, x")])
    dmesg = f"{root}/bin/dmesg"
    run = subprocess.run([dmesg, "--time-format", "iso"], capture_output=True, text=True)
    assert run.stdout == "1970-01-01T00:00:00,000000+00:00 NVRM: Xid (PCI:0000:00:06): 13, x\n"
    assert subprocess.run([dmesg], capture_output=True, text=True).returncode == 1
    script = Path(dmesg).read_text()  # run by its text: the test's directory is root's alone
    user = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            script,
            "dmesg",
            "--time-format",
            "iso",
        ],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert user.returncode == 1 and user.stderr == "dmesg: read kernel buffer failed: Operation not permitted\n"
    assert parse_kernel_log([f"@@error {user.stderr.strip()}"])[1] == user.stderr.strip()


def test_the_installed_stand_in_is_found_before_the_real_dmesg():
    # Root's and sudo's PATH (Debian's secure_path) put /usr/local/bin before /usr/bin and /bin.
    secure_path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".split(":")
    assert secure_path.index(str(Path(kernel_log.STANDIN).parent)) < secure_path.index("/usr/bin")


def test_gpu_less_hosts_get_no_kernel_log_stand_in(tmp_path):
    from gpufleet.sandbox.config import NO_GPU

    assert NO_GPU.profile("h") is None  # hosts.py installs the dmesg stand-in beside a profile only
    assert dataclasses.fields(smi.Gpu)[-1].name == "fields"


def test_the_evidence_tool_runs_the_reading_gpufleet_runs_and_says_what_gpufleet_makes_of_it(tmp_path):
    # bench/gpu_health.py, for recording a real GPU host's answer as a fixture (docs/gpu-health.md).
    from gpufleet.health.gpu import COMMAND

    root = host(tmp_path / "host", smi.make_profile(2, seed="h"))
    gpu_faults.inject(root, 1, "remap-pending")
    gpu_faults.log_xid(root, 0, 13)
    bench = Path(__file__).resolve().parents[2] / "bench" / "gpu_health.py"
    out = subprocess.run(
        [sys.executable, str(bench), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": f"{root}/bin:/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "GPU 0: needs app restart: Xid 13 at " in out.stdout
    assert "GPU 1: needs GPU reset: remapped_rows.pending=Yes" in out.stdout
    assert (tmp_path / "out" / "command.sh").read_text() == COMMAND + "\n"
    assert (tmp_path / "out" / "help-query-gpu.txt").read_text() == (HEALTH / "help-query-gpu.txt").read_text()
    assert (tmp_path / "out" / "gpu_health.txt").read_text().startswith("index, pci.bus_id, ecc.mode.current, ")
