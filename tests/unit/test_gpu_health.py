"""GPU health: the parsers on the recorded healthy H200 and on built fault lines (tests/fixtures/gpu-health/README.md
says which are built), the shell that reads them run in a real shell, and the verdict table."""

from __future__ import annotations

import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from gpufleet.facts.gpu_health import (
    HEALTH_FIELDS,
    QUERY_HEALTH,
    GpuHealth,
    GpuReading,
    KernelEvent,
    kernel_shell,
    parse_health,
    parse_kernel_log,
    parse_query,
)  # fmt: skip
from gpufleet.facts.gpu_verdict import HostGpus, judge
from gpufleet.wire.gpu_verdicts import DEFAULT_TABLE, GpuSettings, Verdict, cleared_at, verdict_table

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RECORDED = FIXTURES / "nvidia-smi" / "h200-health"
BUILT = FIXTURES / "gpu-health"
BUSES = {0: "00000000:00:06.0", 1: "00000000:00:07.0", 2: "00000000:00:08.0"}


def lines(path: Path) -> list[str]:
    """A recording's lines, its `rc=N` as the snapshot's `@@rc N`."""
    out = []
    for line in path.read_text().splitlines():
        out.append(f"@@rc {line[3:]}" if line.startswith("rc=") else line)
    return out


def at(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def filtered(dmesg: str, tmp_path: Path) -> list[str]:
    """kernel_shell's output in a real shell, with a dmesg that prints `dmesg` (as `dmesg --time-format iso`)."""
    fake = tmp_path / "dmesg"
    (tmp_path / "log").write_text(dmesg)
    fake.write_text(f'#!/bin/sh\n[ "$*" = "--time-format iso" ] || exit 9\ncat {tmp_path}/log\n')
    fake.chmod(0o755)
    out = subprocess.run(
        ["sh", "-c", f"t=; {kernel_shell()}"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def events_by_code(tmp_path: Path) -> dict[int | None, KernelEvent]:
    events, error = parse_kernel_log(filtered((BUILT / "dmesg-xid.txt").read_text(), tmp_path))
    assert error is None
    return {e.code: e for e in events}


# --- the health query ------------------------------------------------------------------------------------------
def test_the_recorded_healthy_h200_reads_healthy_and_its_verdict_is_ok():
    gpus, lacks, error = parse_query(lines(RECORDED / "query-gpu-health.csv"))
    assert error is None
    (g,) = gpus
    assert (g.index, g.bus_id, g.bus, g.ecc_mode) == (0, "00000000:00:06.0", (0, 0, 6), "Enabled")
    assert (g.uncorrected_volatile, g.corrected_volatile, g.remap_pending, g.remap_failure) == (0, 0, False, False)
    assert g.retired_pending is None  # [N/A]: Hopper remaps rows instead of retiring pages
    assert (g.clocks_event_reasons, g.temperature_c, g.power_w) == (0x1, 33, 76.57)  # idle
    # That recording asked other fields than gpufleet's query: the ones it did not are "lacking" there.
    assert "gpu_recovery_action" in lacks
    host = judge(GpuHealth(gpus=gpus), GpuSettings())
    assert host.verdict() is Verdict.OK and host.summary() == "ok"


def test_the_query_asks_the_fields_the_recorded_580_driver_offers_and_names_each_once():
    offered = (FIXTURES / "nvidia-smi" / "h200-2gpu" / "help-query-gpu.txt").read_text()
    asked = QUERY_HEALTH.split("=", 1)[1].split()[0].split(",")
    assert asked == [names[0] for names in HEALTH_FIELDS]
    assert all(f'"{name}"' in offered for name in asked), [n for n in asked if f'"{n}"' not in offered]
    assert '"reset_status.reset_required"' not in offered  # the field 580 refuses (recorded) is not asked


def test_built_fault_rows_read_each_value_and_what_nvidia_smi_could_not_read():
    gpus, lacks, error = parse_query(lines(BUILT / "query-gpu-health.csv"))
    assert error is None and lacks == ()
    healthy, pending, hot, failed, unknown = gpus
    assert healthy.recovery_action == "None" and healthy.pcie == "gen 5 x16 (max gen 5 x16)"
    assert (pending.remap_pending, pending.recovery_action, pending.uncorrected_volatile) == (True, "Reset", 2)
    assert (hot.clocks_event_reasons, hot.temperature_c, hot.power_w, hot.unreadable) == (
        0x44,
        91,
        None,
        ("power.draw",),
    )
    assert failed.remap_failure is True and failed.pcie == "gen 5 x8 (max gen 5 x16)"
    assert unknown == GpuReading(index=4, bus_id="00000000:00:0A.0", temperature_c=35)  # [N/A]: not known


def test_the_verdict_of_each_built_row():
    host = judge(parse_health(lines(BUILT / "query-gpu-health.csv"), []), GpuSettings())
    assert [g.verdict for g in host.gpus] == [
        Verdict.OK,
        Verdict.RESET_GPU,
        Verdict.DEGRADED,
        Verdict.SERVICE,
        Verdict.OK,
    ]
    pending, hot, failed = host.gpus[1], host.gpus[2], host.gpus[3]
    assert [f.signal for f in pending.findings] == [
        "gpu_recovery_action=Reset",
        "remapped_rows.pending=Yes",
        "ecc.errors.uncorrected.volatile.total>0",
    ]
    assert pending.line() == (
        "GPU 1 (00000000:00:07.0) needs GPU reset: gpu_recovery_action=Reset; "
        "remapped_rows.pending=Yes; ecc.errors.uncorrected.volatile.total=2"
    )
    assert pending.action.startswith("stop the service and reset the GPU (`nvidia-smi -r -i 1`)")
    assert {f.signal for f in hot.findings} == {
        "clocks_event_reasons.sw_power_cap",
        "clocks_event_reasons.hw_thermal_slowdown",
        "ERR!",
        "ecc.errors.corrected.volatile.total>0",
    }
    assert "clocks_event_reasons.hw_thermal_slowdown (0x44) at 91 C" in hot.evidence
    assert "sw_power_cap" not in hot.evidence  # at its power cap under load: ok by default
    assert failed.findings[0].signal == "remapped_rows.failure=Yes" and "CONTACT_SUPPORT" in failed.action


def test_an_older_drivers_learned_fields_read_under_their_newer_names():
    gpus, lacks, error = parse_query(lines(BUILT / "query-gpu-health-old-driver.csv"))
    assert error is None and lacks == ("gpu_recovery_action",)
    assert gpus[0].clocks_event_reasons == 0x1 and gpus[0].pcie == "gen 4 x16 (max gen 4 x16)"
    host = judge(GpuHealth(gpus=gpus, lacks=lacks), GpuSettings())
    assert [g.verdict for g in host.gpus] == [Verdict.OK, Verdict.RESET_GPU]
    assert host.gpus[1].findings[0].signal == "reset_status.reset_required=Yes"


def test_a_driver_that_refuses_a_field_is_an_error_naming_it_not_a_crash():
    gpus, _, error = parse_query(lines(RECORDED / "query-gpu-reset-status-rejected.txt"))
    assert gpus == () and error == (
        'nvidia-smi exited 2: Field "reset_status.reset_required" is not a valid field to query.'
    )
    host = judge(parse_health(lines(RECORDED / "query-gpu-reset-status-rejected.txt"), []), GpuSettings())
    assert host.error and host.blocking() == [] and host.summary() == "unknown (the health query failed)"


@pytest.mark.parametrize(("answer", "says"), [
    (["@@rc 124"], "did not answer within its bound"),
    (["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "@@rc 9"], "exited 9"),
    (["index, pci.bus_id", "0, 00000000:00:06.0, extra", "@@rc 0"], "a row of 3 fields under a header of 2"),
])  # fmt: skip
def test_an_unusable_answer_is_one_line(answer, says):
    assert says in parse_query(answer)[2]


def test_a_gpu_nvidia_smi_cannot_reach_needs_a_reboot():
    # nvidia-smi's words for a GPU off the bus (NVML's "GPU is lost"), in place of its row: built, not recorded.
    answer = [
        "index, pci.bus_id, remapped_rows.pending",
        "0, 00000000:00:06.0, No",
        "Unable to determine the device handle for GPU0000:00:07.0: GPU is lost. Reboot the system to recover this GPU",
        "@@rc 15",
    ]
    gpus, _, error = parse_query(answer)
    assert error is None and gpus[1] == GpuReading(index=1, bus_id="0000:00:07.0", lost=True)
    assert judge(GpuHealth(gpus=gpus), GpuSettings()).gpus[1].verdict is Verdict.REBOOT


# --- the kernel log --------------------------------------------------------------------------------------------
def test_the_kernel_logs_filter_keeps_the_last_line_of_each_gpu_and_code_with_its_count(tmp_path):
    out = filtered((BUILT / "dmesg-xid.txt").read_text(), tmp_path)
    assert all("NVRM: Xid" in line or "fallen off the bus" in line for line in out), out
    assert len(out) == 15  # 17 NVRM lines: Xid 119 twice, 79 with its fallen-off-the-bus line
    assert out[9].startswith("2 2026-12-03T09:24:30,000000+00:00 NVRM: Xid (PCI:0000:00:07): 119,")


def test_every_xid_class_is_parsed_to_its_gpu_code_and_time(tmp_path):
    events = events_by_code(tmp_path)
    assert set(events) == {13, 31, 43, 45, 94, 48, 63, 64, 95, 119, 154, 79, None, 74, 157}
    assert events[13] == KernelEvent(
        bus=(0, 0, 6),
        code=13,
        at=at("2026-12-03T09:10:00+00:00"),
        text="Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    )
    assert events[119].count == 2 and events[119].text.startswith("Timeout after 6s")  # the pid and name dropped
    assert events[154].text == "GPU recovery action changed from 0x0 (None) to 0x1 (Reset)."
    assert events[None].bus == events[79].bus == (0, 0, 8) and events[None].text == "GPU has fallen off the bus"
    assert events[74].bus == (0, 0, 8)  # the older form, without "PCI:"


@pytest.mark.parametrize(("codes", "verdict"), [
    ((13, 31, 43, 45, 94), Verdict.RESTART_APP),
    ((48, 63, 64, 74, 95, 119, 154), Verdict.RESET_GPU),
    ((79, None), Verdict.REBOOT),
    ((157,), Verdict.DEGRADED),  # an Xid the table has no row for: "xid other"
])  # fmt: skip
def test_each_xid_class_gets_nvidias_action(tmp_path, codes, verdict):
    events = events_by_code(tmp_path)
    for code in codes:
        event = events[code]
        reading = GpuReading(index=event.bus[2] - 6, bus_id=BUSES[event.bus[2] - 6])
        (gpu,) = judge(GpuHealth(gpus=(reading,), events=(event,)), GpuSettings()).gpus
        assert gpu.verdict is verdict, (code, gpu)
        assert ("GPU has fallen off the bus" if code is None else f"Xid {code} at 2026-12-03T") in gpu.evidence


def test_what_dmesg_says_instead_of_a_log_is_the_kernel_logs_error(tmp_path):
    out = filtered("dmesg: read kernel buffer failed: Operation not permitted\n", tmp_path)
    assert parse_kernel_log(out) == ((), "dmesg: read kernel buffer failed: Operation not permitted")


# --- how a verdict clears -----------------------------------------------------------------------------------------
def judged_xid(
    code: int, reading: GpuReading, settings: GpuSettings | None = None, started: float | None = None, text: str = ""
) -> HostGpus:
    event = KernelEvent(bus=(0, 0, 6), code=code, text=text, at=at("2026-12-03T09:00:00+00:00"))
    return judge(GpuHealth(gpus=(reading,), events=(event,)), settings or GpuSettings(), app_started_at=started)


@pytest.mark.parametrize(("code", "now", "settled"), [
    (48, {"uncorrected_volatile": 0}, "no uncorrected ECC error since its last load or GPU reset"),
    (95, {"uncorrected_volatile": 0}, "no uncorrected ECC error"),
    (63, {"remap_pending": False}, "remapped_rows.pending=No: the remap is applied"),
    (64, {"remap_pending": False, "remap_failure": False}, "remapped_rows.failure=No"),
    (119, {"recovery_action": "None"}, "gpu_recovery_action=None now"),
    (154, {"recovery_action": "None"}, "gpu_recovery_action=None now"),
    (119, {"reset_required": False}, "reset_status.reset_required=No now"),
])  # fmt: skip
def test_a_reset_class_xid_is_settled_by_the_drivers_own_field_reading_clear_now(code, now, settled):
    clear = judged_xid(code, GpuReading(0, BUSES[0], **now))
    assert clear.verdict() is Verdict.OK and settled in clear.gpus[0].settled[0]
    # Without the field (a driver that lacks it) the line stands: nothing says the reset happened.
    assert judged_xid(code, GpuReading(0, BUSES[0])).verdict() is Verdict.RESET_GPU


def test_an_xid_the_driver_has_no_field_for_stands_until_a_reboot_or_the_operators_clear():
    assert judged_xid(79, GpuReading(0, BUSES[0])).verdict() is Verdict.REBOOT
    after = GpuSettings(cleared_at=at("2026-12-03T09:05:00+00:00"))
    cleared = judged_xid(79, GpuReading(0, BUSES[0]), after)
    assert cleared.verdict() is Verdict.OK and cleared.gpus[0].settled == (
        "Xid 79 at 2026-12-03T09:00:00Z: before gpufleet_gpu_cleared_at",
    )
    before = GpuSettings(cleared_at=at("2026-12-03T08:55:00+00:00"))  # a later Xid counts again
    assert judged_xid(79, GpuReading(0, BUSES[0]), before).verdict() is Verdict.REBOOT


def test_an_app_restart_xid_is_settled_once_the_service_started_after_it():
    reading = GpuReading(0, BUSES[0])
    assert judged_xid(13, reading, started=at("2026-12-03T08:00:00+00:00")).verdict() is Verdict.RESTART_APP
    assert judged_xid(13, reading, started=at("2026-12-03T09:30:00+00:00")).verdict() is Verdict.OK
    # A reset-class Xid is not settled by a restart of the service alone.
    assert judged_xid(48, reading, started=at("2026-12-03T09:30:00+00:00")).verdict() is Verdict.RESET_GPU


def test_xid_154_is_judged_as_the_recovery_action_it_names():
    reboot = judged_xid(
        154, GpuReading(0, BUSES[0]), text="GPU recovery action changed from 0x1 (Reset) to 0x2 (Reboot)."
    )
    assert reboot.verdict() is Verdict.REBOOT and reboot.gpus[0].findings[0].signal == "gpu_recovery_action=Reboot"


def test_an_xid_on_a_gpu_nvidia_smi_does_not_list_concerns_every_service_on_the_host():
    event = KernelEvent(bus=(0, 0x3B, 0), code=79, text="GPU has fallen off the bus.", at=None)
    host = judge(GpuHealth(gpus=(GpuReading(0, BUSES[0]),), events=(event,)), GpuSettings())
    (lost,) = host.blocking([0])
    assert lost.index is None and lost.name == "the GPU at PCI 0000:3b:00 (not listed by nvidia-smi)"
    assert "at an unknown time" in lost.evidence


# --- the table, its overrides and the used GPUs ------------------------------------------------------------------
def test_only_reset_reboot_and_service_refuse_a_start():
    assert [v for v in Verdict if v.blocks_start] == [Verdict.RESET_GPU, Verdict.REBOOT, Verdict.SERVICE]
    assert {DEFAULT_TABLE[f"xid {c}"] for c in (13, 31, 43, 45, 94)} == {Verdict.RESTART_APP}
    assert {DEFAULT_TABLE[f"xid {c}"] for c in (48, 63, 64, 95, 119)} == {Verdict.RESET_GPU}
    assert DEFAULT_TABLE["xid 79"] is DEFAULT_TABLE["fallen off the bus"] is Verdict.REBOOT
    assert DEFAULT_TABLE["remapped_rows.failure=Yes"] is Verdict.SERVICE


def test_a_host_or_group_overrides_rows_of_the_table():
    table = verdict_table({"xid 43": "ok", "xid 200": "reboot", "clocks_event_reasons.sw_power_cap": "degraded"})
    assert (table["xid 43"], table["xid 200"], table["xid 13"]) == (Verdict.OK, Verdict.REBOOT, Verdict.RESTART_APP)
    event = KernelEvent(bus=(0, 0, 6), code=200, text="", at=None)
    host = judge(GpuHealth(gpus=(GpuReading(0, BUSES[0]),), events=(event,)), GpuSettings(table=table))
    assert host.verdict() is Verdict.REBOOT
    assert (
        judge(GpuHealth(gpus=(GpuReading(0, BUSES[0]),), events=(event,)), GpuSettings()).verdict() is Verdict.DEGRADED
    )  # "xid other"


@pytest.mark.parametrize(("overrides", "says"), [
    ({"xid thirteen": "ok"}, "is not a signal of the verdict table"),
    ({"xid 13": "fine"}, "'xid 13': 'fine' is not a verdict"),
    (["xid 13"], "is not a map of signal to verdict"),
])  # fmt: skip
def test_a_bad_override_is_refused_naming_it(overrides, says):
    with pytest.raises(ValueError, match=says):
        verdict_table(overrides)


def test_cleared_at_wants_a_zone():
    assert cleared_at("2026-12-03T09:05:00Z") == at("2026-12-03T09:05:00+00:00") and cleared_at(None) is None
    for bad in ("2026-12-03T09:05:00", "yesterday", 5):
        with pytest.raises(ValueError, match=r"^is not an ISO 8601 time with its zone$"):
            cleared_at(bad)


def test_a_sick_gpu_the_service_does_not_use_concerns_it_not():
    health = parse_health(lines(BUILT / "query-gpu-health.csv"), [])
    host = judge(health, GpuSettings())
    assert host.blocking([0, 4]) == [] and host.verdict([0, 4]) is Verdict.OK and host.summary([0]) == "ok"
    assert [g.index for g in host.blocking()] == [1, 3]
    assert host.summary([0, 1, 2]) == (
        "needs GPU reset (GPU 1: gpu_recovery_action=Reset, remapped_rows.pending=Yes, "
        "ecc.errors.uncorrected.volatile.total>0; GPU 2: ecc.errors.corrected.volatile.total>0, "
        "clocks_event_reasons.hw_thermal_slowdown, ERR!)"
    )


def test_the_fallen_off_the_bus_line_beside_an_xid_79_is_one_finding_and_alone_counts_the_same(tmp_path):
    events = events_by_code(tmp_path)
    reading = GpuReading(2, BUSES[2])
    both = judge(GpuHealth(gpus=(reading,), events=(events[79], events[None])), GpuSettings())
    assert [f.signal for f in both.gpus[0].findings] == ["xid 79"]
    alone = judge(GpuHealth(gpus=(reading,), events=(events[None],)), GpuSettings())  # the Xid line rate-limited away
    assert [f.signal for f in alone.gpus[0].findings] == ["fallen off the bus"] and alone.verdict() is Verdict.REBOOT
