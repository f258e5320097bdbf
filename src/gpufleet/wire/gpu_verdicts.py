"""The GPU verdict table, NVIDIA's action per verdict, and the two settings over them (docs/gpu-health.md)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from gpufleet.defaults import DEFAULTS, GPU_CLEARED_SETTING, GPU_VERDICTS_SETTING


class Verdict(StrEnum):
    """Worst last: a GPU's verdict is the worst of its signals'."""

    OK = "ok"
    DEGRADED = "degraded"
    RESTART_APP = "restart-app"
    RESET_GPU = "reset-gpu"
    REBOOT = "reboot"
    SERVICE = "service"

    @property
    def label(self) -> str:
        return LABELS[self]

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def blocks_start(self) -> bool:
        """Refuses a start or restart of the service."""
        return self in (Verdict.RESET_GPU, Verdict.REBOOT, Verdict.SERVICE)


LABELS = {
    Verdict.OK: "ok",
    Verdict.DEGRADED: "degraded",
    Verdict.RESTART_APP: "needs app restart",
    Verdict.RESET_GPU: "needs GPU reset",
    Verdict.REBOOT: "needs reboot",
    Verdict.SERVICE: "needs service",
}
_RANK = {v: i for i, v in enumerate(Verdict)}

ACTIONS = {
    Verdict.OK: "none",
    Verdict.DEGRADED: "keep serving and watch it: cooling, power and error counts (`nvidia-smi -q -d PERFORMANCE,ECC`)",
    Verdict.RESTART_APP: "restart the application (NVIDIA: RESTART_APP); a converge that restarts the service does",
    Verdict.RESET_GPU: "stop the service and reset the GPU (`nvidia-smi -r -i {index}`), or reboot the host "
    "(NVIDIA: RESET_GPU)",
    Verdict.REBOOT: "reboot the host (NVIDIA: RESTART_BM)",
    Verdict.SERVICE: "take the GPU out of service and contact NVIDIA support (NVIDIA: CONTACT_SUPPORT)",
}

XID_OTHER = "xid other"
FALLEN_OFF = "fallen off the bus"
READ_ERROR = "ERR!"  # also stands for [Unknown Error]
# nvml.h's clock event reasons by bit.
THROTTLE_BITS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}

_V = Verdict
DEFAULT_TABLE: dict[str, Verdict] = {
    "xid 13": _V.RESTART_APP,
    "xid 31": _V.RESTART_APP,
    "xid 43": _V.RESTART_APP,
    "xid 45": _V.RESTART_APP,
    "xid 94": _V.RESTART_APP,
    "xid 48": _V.RESET_GPU,
    "xid 63": _V.RESET_GPU,
    "xid 64": _V.RESET_GPU,
    "xid 74": _V.RESET_GPU,
    "xid 95": _V.RESET_GPU,
    "xid 119": _V.RESET_GPU,
    "xid 120": _V.RESET_GPU,
    "xid 79": _V.REBOOT,
    FALLEN_OFF: _V.REBOOT,
    "xid 92": _V.DEGRADED,
    XID_OTHER: _V.DEGRADED,
    "gpu_recovery_action=Reset": _V.RESET_GPU,
    "gpu_recovery_action=Drain P2P": _V.RESET_GPU,
    "gpu_recovery_action=Drain and Reset": _V.RESET_GPU,
    "gpu_recovery_action=Reboot": _V.REBOOT,
    "gpu_recovery_action=other": _V.RESET_GPU,
    "reset_status.reset_required=Yes": _V.RESET_GPU,
    "reset_status.drain_and_reset_recommended=Yes": _V.RESET_GPU,
    "remapped_rows.pending=Yes": _V.RESET_GPU,
    "retired_pages.pending=Yes": _V.RESET_GPU,
    "remapped_rows.failure=Yes": _V.SERVICE,
    "ecc.errors.uncorrected.volatile.total>0": _V.DEGRADED,
    "ecc.errors.corrected.volatile.total>0": _V.DEGRADED,
    **{f"clocks_event_reasons.{name}": _V.DEGRADED for name in THROTTLE_BITS.values()},
    "clocks_event_reasons.sw_power_cap": _V.OK,  # a GPU at full load runs at its power cap
    READ_ERROR: _V.DEGRADED,
}
_XID_KEY = re.compile(r"xid (0|[1-9][0-9]{0,3})")


def xid_signal(code: int, table: Mapping[str, Verdict]) -> str:
    key = f"xid {code}"
    return key if key in table else XID_OTHER


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    return max(verdicts, key=lambda v: v.rank, default=Verdict.OK)


def verdict_table(overrides: object) -> dict[str, Verdict]:
    """DEFAULT_TABLE with gpufleet_gpu_verdicts over it; ValueError naming the first bad entry."""
    if overrides is None:
        return dict(DEFAULT_TABLE)
    if not isinstance(overrides, Mapping):
        raise ValueError("is not a map of signal to verdict")
    table = dict(DEFAULT_TABLE)
    for key, value in overrides.items():
        if not isinstance(key, str) or not (key in DEFAULT_TABLE or _XID_KEY.fullmatch(key)):
            raise ValueError(f"{key!r} is not a signal of the verdict table")
        try:
            table[key] = Verdict(value)
        except ValueError:
            raise ValueError(f"{key!r}: {value!r} is not a verdict") from None
    return table


def cleared_at(value: object) -> float | None:
    """gpufleet_gpu_cleared_at as epoch seconds (None stays None); ValueError without a zone."""
    if value is None:
        return None
    stamp = None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if stamp is None or stamp.tzinfo is None:
        raise ValueError("is not an ISO 8601 time with its zone")
    return stamp.timestamp()


@dataclass(frozen=True)
class GpuSettings:
    """A host's verdict table, and the time before which its Xid lines no longer count."""

    table: Mapping[str, Verdict] = field(default_factory=lambda: dict(DEFAULT_TABLE))
    cleared_at: float | None = None

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> GpuSettings:
        """ValueError for a bad value."""
        return cls(
            verdict_table(settings.get(GPU_VERDICTS_SETTING, DEFAULTS[GPU_VERDICTS_SETTING])),
            cleared_at(settings.get(GPU_CLEARED_SETTING, DEFAULTS[GPU_CLEARED_SETTING])),
        )
