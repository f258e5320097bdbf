"""A verdict per GPU from its health reading, by the host's verdict table (docs/gpu-health.md)."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from gpufleet.facts.gpu_health import Bus, GpuHealth, GpuReading, KernelEvent
from gpufleet.wire.gpu_verdicts import (
    ACTIONS,
    FALLEN_OFF,
    READ_ERROR,
    THROTTLE_BITS,
    GpuSettings,
    Verdict,
    worst,
    xid_signal,
)  # fmt: skip

RECOVERY = "gpu_recovery_action"
# Xid codes whose driver field says whether they still hold.
_UNCORRECTED_XIDS = (48, 94, 95)
_RECOVERY_XIDS = (119, 120, 154)


@dataclass(frozen=True)
class Finding:
    signal: str  # the verdict table's key
    verdict: Verdict
    evidence: str


@dataclass(frozen=True)
class GpuVerdict:
    index: int | None  # None: named by the kernel log only
    bus_id: str
    findings: tuple[Finding, ...] = ()  # worst first
    settled: tuple[str, ...] = ()  # Xid lines that no longer count, with why

    @property
    def verdict(self) -> Verdict:
        return worst(f.verdict for f in self.findings)

    @property
    def name(self) -> str:
        return (
            f"GPU {self.index}"
            if self.index is not None
            else f"the GPU at PCI {self.bus_id} (not listed by nvidia-smi)"
        )

    @property
    def evidence(self) -> str:
        return "; ".join(f.evidence for f in self.findings if f.verdict is not Verdict.OK)

    def line(self) -> str:
        return f"{self.name} ({self.bus_id}) {self.verdict.label}: {self.evidence}"

    @property
    def action(self) -> str:
        return ACTIONS[self.verdict].format(index=self.index if self.index is not None else self.bus_id)


@dataclass(frozen=True)
class HostGpus:
    gpus: tuple[GpuVerdict, ...] = ()
    lacks: tuple[str, ...] = ()
    error: str | None = None  # the health query failed: no verdict
    kernel_log_error: str | None = None

    def concern(self, used: Collection[int] | None = None) -> list[GpuVerdict]:
        """The GPUs `used` (None: all), and any only the kernel log names."""
        return [g for g in self.gpus if used is None or g.index is None or g.index in used]

    def blocking(self, used: Collection[int] | None = None) -> list[GpuVerdict]:
        return [g for g in self.concern(used) if g.verdict.blocks_start]

    def verdict(self, used: Collection[int] | None = None) -> Verdict:
        return worst(g.verdict for g in self.concern(used))

    def summary(self, used: Collection[int] | None = None) -> str:
        """The ledger's line: "ok", or the verdict and each sick GPU's signals."""
        if self.error is not None:
            return "unknown (the health query failed)"
        sick = [g for g in self.concern(used) if g.verdict is not Verdict.OK]
        if not sick:
            return "ok"
        signals = "; ".join(
            f"{g.name}: {', '.join(f.signal for f in g.findings if f.verdict is not Verdict.OK)}" for g in sick
        )
        return f"{self.verdict(used).label} ({signals})"

    def as_dict(self, used: Collection[int] | None = None) -> dict[str, Any]:
        """status/verify --json's "gpu" of a host (docs/cli.md)."""
        concern = self.concern(used)
        return {
            "verdict": None if self.error else str(self.verdict(used)),
            "summary": self.summary(used),
            "lacks": list(self.lacks),
            "error": self.error,
            "kernel_log_error": self.kernel_log_error,
            "gpus": [
                {
                    "index": g.index,
                    "bus_id": g.bus_id,
                    "verdict": str(g.verdict),
                    "used": g in concern,
                    "findings": [
                        {"signal": f.signal, "verdict": str(f.verdict), "evidence": f.evidence} for f in g.findings
                    ],
                    "settled": list(g.settled),
                }
                for g in self.gpus
            ],
        }


def judge(health: GpuHealth, settings: GpuSettings, app_started_at: float | None = None) -> HostGpus:
    """app_started_at: the service container's start, in epoch seconds."""
    events: dict[Bus | None, list[KernelEvent]] = {}
    for event in health.events:
        events.setdefault(event.bus, []).append(event)
    verdicts = []
    for reading in health.gpus:
        found = _field_findings(reading, settings)
        xids, settled = _event_findings(events.pop(reading.bus, []), reading, settings, app_started_at)
        verdicts.append(_verdict(reading.index, reading.bus_id, [*found, *xids], settled))
    for bus, unlisted in events.items():  # GPUs nvidia-smi does not list
        xids, settled = _event_findings(unlisted, None, settings, app_started_at)
        bus_id = "{:04x}:{:02x}:{:02x}".format(*bus) if bus else "?"
        verdicts.append(_verdict(None, bus_id, xids, settled))
    return HostGpus(tuple(verdicts), health.lacks, health.error, health.kernel_log_error)


def _verdict(index: int | None, bus_id: str, findings: list[Finding], settled: list[str]) -> GpuVerdict:
    ranked = sorted(findings, key=lambda f: f.verdict.rank, reverse=True)
    return GpuVerdict(index, bus_id, tuple(ranked), tuple(settled))


def _field_findings(g: GpuReading, settings: GpuSettings) -> list[Finding]:
    signals: list[tuple[str, str]] = []  # (signal, evidence)
    if g.lost:
        signals.append((FALLEN_OFF, "nvidia-smi: GPU is lost"))
    if g.recovery_action is not None and g.recovery_action.lower() != "none":
        signals.append((recovery_signal(g.recovery_action, settings), f"{RECOVERY}={g.recovery_action}"))
    for flag, field in (
        (g.reset_required, "reset_status.reset_required"),
        (g.drain_and_reset, "reset_status.drain_and_reset_recommended"),
        (g.remap_pending, "remapped_rows.pending"),
        (g.remap_failure, "remapped_rows.failure"),
        (g.retired_pending, "retired_pages.pending"),
    ):
        if flag:
            signals.append((f"{field}=Yes", f"{field}=Yes"))
    for count, field in (
        (g.uncorrected_volatile, "ecc.errors.uncorrected.volatile.total"),
        (g.corrected_volatile, "ecc.errors.corrected.volatile.total"),
    ):
        if count:
            signals.append((f"{field}>0", f"{field}={count}"))
    for bit, name in THROTTLE_BITS.items():
        if g.clocks_event_reasons is not None and g.clocks_event_reasons & bit:
            key = f"clocks_event_reasons.{name}"
            heat = f" at {g.temperature_c} C" if "thermal" in name and g.temperature_c is not None else ""
            signals.append((key, f"{key} (0x{g.clocks_event_reasons:x}){heat}"))
    if g.unreadable:
        signals.append((READ_ERROR, f"nvidia-smi could not read {', '.join(g.unreadable)}"))
    return [Finding(key, settings.table[key], evidence) for key, evidence in signals]


def recovery_signal(action: str, settings: GpuSettings) -> str:
    key = next((k for k in settings.table if k.lower() == f"{RECOVERY}={action}".lower()), None)
    return key or f"{RECOVERY}=other"


def _event_findings(
    events: list[KernelEvent], g: GpuReading | None, settings: GpuSettings, app_started_at: float | None
) -> tuple[list[Finding], list[str]]:
    findings, settled = [], []
    xid79 = any(event.code == 79 for event in events)
    for event in events:
        if event.code is None and xid79:
            continue  # logged beside its Xid 79: one finding, not two
        what = "GPU has fallen off the bus" if event.code is None else f"Xid {event.code}"
        times = f", {event.count} times" if event.count > 1 else ""
        evidence = f"{what} {event.when} ({event.text}{times})" if event.code is not None else f"{what} {event.when}"
        key = _event_signal(event, settings)
        verdict = settings.table[key]
        why = _settled_by(event, verdict, g, settings, app_started_at)
        if why:
            settled.append(f"{what} {event.when}: {why}")
        else:
            findings.append(Finding(key, verdict, evidence))
    return findings, settled


def _event_signal(event: KernelEvent, settings: GpuSettings) -> str:
    if event.code is None:
        return FALLEN_OFF
    if event.code == 154:  # judged as the recovery action its text names
        m = re.search(r"to 0x[0-9a-fA-F]+ \(([^)]+)\)", event.text)
        return recovery_signal(m[1] if m else "other", settings)
    return xid_signal(event.code, settings.table)


def _settled_by(
    event: KernelEvent, verdict: Verdict, g: GpuReading | None, settings: GpuSettings, app_started_at: float | None
) -> str | None:
    """Why an Xid line no longer counts, or None."""
    if settings.cleared_at is not None and event.at is not None and event.at < settings.cleared_at:
        return "before gpufleet_gpu_cleared_at"
    if event.code == 154 and re.search(r"to 0x0+ \(None\)", event.text):
        return "the driver set its recovery action back to None"
    if (
        verdict is Verdict.RESTART_APP
        and app_started_at is not None
        and event.at is not None
        and app_started_at > event.at
    ):
        return "the service started after it"
    if g is None or event.code is None:
        return None
    if event.code in _UNCORRECTED_XIDS and g.uncorrected_volatile == 0:
        return "the driver counts no uncorrected ECC error since its last load or GPU reset"
    if event.code == 63 and g.remap_pending is False:
        return "remapped_rows.pending=No: the remap is applied"
    if event.code == 64 and g.remap_pending is False and g.remap_failure is False:
        return "remapped_rows.pending=No and remapped_rows.failure=No"
    if event.code in _RECOVERY_XIDS and (g.recovery_action or "").lower() == "none":
        return f"{RECOVERY}=None now"
    if event.code in _RECOVERY_XIDS and g.reset_required is False and g.recovery_action is None:
        return "reset_status.reset_required=No now"
    return None
