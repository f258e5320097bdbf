"""GPU faults injected into a running test host, in NVIDIA's documented formats: nvidia-smi fields, Xid lines.

inject(host.root, 1, "remap-pending")         # GPU 1: remapped_rows.pending=Yes
log_xid(host.root, 2, 79)                     # GPU 2 fell off the bus, now
clear(host.root)                              # as after a reboot
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from gpufleet.sandbox import kernel_log
from gpufleet.sandbox.nvidia_smi import HOST_PROFILE


def _reasons(mask: int) -> dict[str, str]:
    value = f"0x{mask:016x}"
    return {"clocks_event_reasons.active": value, "clocks_throttle_reasons.active": value}


def _ecc(kind: str, count: int) -> dict[str, str]:
    return {f"ecc.errors.{kind}.{scope}.total": str(count) for scope in ("volatile", "aggregate")}


# fault -> what nvidia-smi then prints for the GPU.
FAULTS: dict[str, dict[str, str]] = {
    "remap-pending": {"remapped_rows.pending": "Yes", "remapped_rows.uncorrectable": "1"},
    "remap-failure": {"remapped_rows.failure": "Yes"},
    "reset-required": {"gpu_recovery_action": "Reset", "reset_status.reset_required": "Yes"},
    "reboot-required": {"gpu_recovery_action": "Reboot"},
    "ecc-uncorrected": _ecc("uncorrected", 2),
    "ecc-corrected": _ecc("corrected", 5),
    "thermal": {**_reasons(0x40), "temperature.gpu": "91"},  # HW Thermal Slowdown, hot
    "power-brake": _reasons(0x80),  # HW Power Brake Slowdown
    "unreadable": {"power.draw": "ERR!"},
}

# Xid code -> the driver's text (the catalog's descriptions).
XID_TEXT = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    31: "Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_34560000. "
    "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000008",
    45: "Ch 00000008",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, "
    "subpartition 0.",
    63: "Row Remapper: New row (0x00000000000a1b2c) marked for remapping, reset gpu to activate.",
    64: "Row Remapper: Failed to mark row (0x00000000000a1b2c) for remapping.",
    74: "NVLink: fatal error detected on link 3(0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    94: "Contained: CE User Channel (0x2). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) "
    "(0x20801813 0x4c).",
    120: "GSP task exception: GSP Error: Task 1 raised error code 0x5 for reason 0x0 at 0x1a2b3c.",
    154: "GPU recovery action changed from 0x0 (None) to 0x1 (Reset).",
}
# Xids the driver logs for a process (the others come from the driver itself).
_WITH_PROCESS = {13, 31, 43, 45, 48, 63, 64, 94, 95}


def _profile(root: Path) -> Path:
    return root / HOST_PROFILE.lstrip("/")


def set_fields(root: Path, gpu: int, fields: Mapping[str, str]) -> None:
    """What nvidia-smi prints for these fields of GPU `gpu` from now on."""
    profile = json.loads(_profile(root).read_text())
    row = profile["gpus"][gpu]
    row["fields"] = {**row.get("fields", {}), **fields}
    _write(root, profile)


def _write(root: Path, profile: dict[str, object]) -> None:
    path = _profile(root)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    os.replace(tmp, path)


def inject(root: Path, gpu: int, fault: str) -> None:
    if fault not in FAULTS:
        raise ValueError(f"{fault!r} is not one of {', '.join(FAULTS)}")
    set_fields(root, gpu, FAULTS[fault])


def bus_id(root: Path, gpu: int) -> str:
    return str(json.loads(_profile(root).read_text())["gpus"][gpu]["bus_id"])


def xid_lines(
    bus: str, code: int, at: float, text: str | None = None, pid: int = 2201, process: str = "python3"
) -> list[str]:
    """The driver's kernel log lines for Xid `code` on the GPU at `bus`."""
    domain, bus_no, device = bus.lower().split(".")[0].split(":")
    where = f"{domain[-4:]}:{bus_no}:{device}"
    said = text or XID_TEXT.get(code, "Unknown Error")
    process_part = f"pid={pid}, name={process}, " if code in _WITH_PROCESS else ""
    lines = [kernel_log.line(at, f"NVRM: Xid (PCI:{where}): {code}, {process_part}{said}")]
    if code == 79:
        lines.append(kernel_log.line(at, f"NVRM: GPU {where}.0: GPU has fallen off the bus."))
    return lines


def log_xid(root: Path, gpu: int, code: int, at: float | None = None, text: str | None = None) -> list[str]:
    """Log Xid `code` for GPU `gpu` at `at` (default: now); returns the lines added."""
    lines = xid_lines(bus_id(root, gpu), code, time.time() if at is None else at, text)
    kernel_log.append(root, lines)
    return lines


def clear(root: Path) -> None:
    """Every GPU healthy and an empty kernel log, as after a reboot."""
    profile = json.loads(_profile(root).read_text())
    for row in profile["gpus"]:
        row["fields"] = {}
    _write(root, profile)
    kernel_log.clear(root)
