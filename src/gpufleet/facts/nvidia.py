"""NVIDIA GPU facts, parsed from nvidia-smi commands recorded on real H200 hosts (tests/fixtures/nvidia-smi/)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyinfra.api.exceptions import FactProcessError

GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
    "driver_version",
    "pci.bus_id",
    "compute_cap",
    "persistence_mode",
    "temperature.gpu",
    "utilization.gpu",
    "power.draw",
    "power.limit",
)
QUERY_GPUS = f"nvidia-smi --query-gpu={','.join(GPU_FIELDS)} --format=csv,noheader,nounits"
QUERY_VERSION = "nvidia-smi --version"
QUERY_TOPOLOGY = "nvidia-smi topo -m"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What nvidia-smi prints instead of data when the driver is unusable.
_KNOWN_FAILURES = (
    "NVIDIA-SMI has failed",
    "No devices were found",
    "is not a valid field to query",
    "Failed to initialize NVML",
    "Driver/library version mismatch",
    "couldn't communicate with the NVIDIA driver",
)


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    memory_free_mib: int
    driver_version: str
    pci_bus_id: str
    compute_cap: str
    persistence_mode: str
    temperature_c: int | None
    utilization_pct: int | None
    power_draw_w: float | None
    power_limit_w: float | None

    @property
    def memory_total_gib(self) -> float:
        return self.memory_total_mib / 1024


@dataclass(frozen=True)
class NvidiaVersion:
    driver_version: str
    cuda_version: str  # the newest CUDA the driver supports

    @property
    def cuda(self) -> tuple[int, ...]:
        return version_tuple(self.cuda_version)


@dataclass(frozen=True)
class Topology:
    """`nvidia-smi topo -m` between GPUs: links[(i, j)] is "X", "NV18", "SYS", "PIX", ..."""

    gpus: tuple[int, ...]
    links: dict[tuple[int, int], str]

    def link(self, a: int, b: int) -> str | None:
        return self.links.get((a, b))

    def nvlinks(self, a: int, b: int) -> int:
        """Bonded NVLinks between GPU a and b; 0 over PCIe or the CPU."""
        match = re.fullmatch(r"NV(\d+)", self.link(a, b) or "")
        return int(match.group(1)) if match else 0


def version_tuple(text: str) -> tuple[int, ...]:
    if not re.fullmatch(r"\d+(\.\d+)*", text.strip()):
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in text.strip().split("."))


def _failure(lines: list[str]) -> str | None:
    text = " ".join(line.strip() for line in lines if line.strip())
    for marker in _KNOWN_FAILURES:
        if marker in text:
            return text
    return None


def _optional_int(text: str) -> int | None:
    return int(float(text)) if re.fullmatch(r"\d+(\.\d+)?", text) else None  # "[N/A]", "[Not Supported]"


def _optional_float(text: str) -> float | None:
    return float(text) if re.fullmatch(r"\d+(\.\d+)?", text) else None


def parse_gpus(lines: list[str]) -> list[Gpu]:
    """FactProcessError names the line it cannot read."""
    if failure := _failure(lines):
        raise FactProcessError(f"nvidia-smi failed: {failure}")
    gpus = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != len(GPU_FIELDS):
            raise FactProcessError(
                f"nvidia-smi --query-gpu line {number}: expected {len(GPU_FIELDS)} comma-separated fields "
                f"({','.join(GPU_FIELDS)}), got {len(fields)}: {line.strip()!r}"
            )
        try:
            gpus.append(
                Gpu(
                    index=int(fields[0]),
                    uuid=fields[1],
                    name=fields[2],
                    memory_total_mib=int(fields[3]),
                    memory_used_mib=int(fields[4]),
                    memory_free_mib=int(fields[5]),
                    driver_version=fields[6],
                    pci_bus_id=fields[7],
                    compute_cap=fields[8],
                    persistence_mode=fields[9],
                    temperature_c=_optional_int(fields[10]),
                    utilization_pct=_optional_int(fields[11]),
                    power_draw_w=_optional_float(fields[12]),
                    power_limit_w=_optional_float(fields[13]),
                )
            )
        except ValueError as error:
            raise FactProcessError(f"nvidia-smi --query-gpu line {number}: {error}: {line.strip()!r}") from error
    return gpus


def parse_version(lines: list[str]) -> NvidiaVersion:
    if failure := _failure(lines):
        raise FactProcessError(f"nvidia-smi failed: {failure}")
    values = {}
    for line in lines:
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip().lower()] = value.strip()
    driver, cuda = values.get("driver version"), values.get("cuda version")
    if not driver or not cuda or not re.fullmatch(r"\d+(\.\d+)*", cuda):
        raise FactProcessError(
            f"nvidia-smi --version: no 'DRIVER version' and 'CUDA Version' lines in: {' | '.join(lines)[:200]!r}"
        )
    return NvidiaVersion(driver_version=driver, cuda_version=cuda)


def parse_topology(lines: list[str]) -> Topology:
    """The GPU x GPU matrix of `nvidia-smi topo -m`, without NICs."""
    if failure := _failure(lines):
        raise FactProcessError(f"nvidia-smi failed: {failure}")
    rows = [_ANSI.sub("", line).rstrip() for line in lines]
    header_at = next((i for i, row in enumerate(rows) if re.match(r"^\s+GPU\d+\b", row)), None)
    if header_at is None:
        raise FactProcessError(f"nvidia-smi topo -m: no GPU header line in: {' | '.join(rows)[:200]!r}")
    columns = rows[header_at].split("\t")[1:]
    gpu_columns = [(pos, int(name[3:])) for pos, name in enumerate(columns) if re.fullmatch(r"GPU\d+", name.strip())]
    links: dict[tuple[int, int], str] = {}
    gpus = []
    for row in rows[header_at + 1 :]:
        if not row.strip() or row.startswith("Legend"):
            break
        cells = row.split("\t")
        if not re.fullmatch(r"GPU\d+", cells[0].strip()):
            continue  # NIC rows
        this = int(cells[0].strip()[3:])
        gpus.append(this)
        for pos, other in gpu_columns:
            if pos + 1 >= len(cells):
                raise FactProcessError(f"nvidia-smi topo -m: row {cells[0].strip()} is short: {row!r}")
            links[(this, other)] = cells[pos + 1].strip()
    return Topology(gpus=tuple(gpus), links=links)
