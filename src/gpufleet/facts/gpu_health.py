"""The shell that reads nvidia-smi's health fields and the kernel log's Xid lines, and its parsers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from gpufleet.wire.evidence import excerpt

# Each field with the older names a driver may know it by.
HEALTH_FIELDS: tuple[tuple[str, ...], ...] = (
    ("index",),
    ("pci.bus_id", "gpu_bus_id"),
    ("ecc.mode.current",),
    ("ecc.errors.corrected.volatile.total",),
    ("ecc.errors.corrected.aggregate.total",),
    ("ecc.errors.uncorrected.volatile.total",),
    ("ecc.errors.uncorrected.aggregate.total",),
    ("retired_pages.pending",),
    ("remapped_rows.correctable", "remapped_rows.sbe"),
    ("remapped_rows.uncorrectable", "remapped_rows.dbe"),
    ("remapped_rows.pending",),
    ("remapped_rows.failure",),
    ("gpu_recovery_action",),
    ("clocks_event_reasons.active", "clocks_throttle_reasons.active"),
    ("temperature.gpu",),
    ("power.draw",),
    ("pcie.link.gen.gpucurrent", "pcie.link.gen.current"),
    ("pcie.link.gen.max",),
    ("pcie.link.width.current",),
    ("pcie.link.width.max",),
)
# R580 rejects these: asked only of a driver whose help lists them.
OLDER_FIELDS: tuple[tuple[str, ...], ...] = (
    ("reset_status.reset_required",),
    ("reset_status.drain_and_reset_recommended",),
)
QUERY_HEALTH = f"nvidia-smi --query-gpu={','.join(names[0] for names in HEALTH_FIELDS)} --format=csv"
KERNEL_LOG = "dmesg --time-format iso"
REFUSED_FIELD = "is not a valid field to query"
TIMED_OUT = (124, 137)  # `timeout`'s exit codes

_CANONICAL = {name: names[0] for names in (*HEALTH_FIELDS, *OLDER_FIELDS) for name in names}
_UNREADABLE = ("ERR!", "[Unknown Error]")
_LOST = "GPU is lost"


def query_shell(t: str = "$t") -> str:
    """The health query, then `@@rc <status>`; after a refused field, only what `--help-query-gpu` lists.
    t: the shell word that bounds each program."""
    learn = " ".join("/".join(names) for names in (*HEALTH_FIELDS, *OLDER_FIELDS))
    return (
        f"h=$({t} {QUERY_HEALTH} 2>&1); r=$?; case $r:$h in 2:*{REFUSED_FIELD!r}*) "
        f"hq=$({t} nvidia-smi --help-query-gpu 2>/dev/null); f=; for w in {learn}; do "
        'while :; do x=${w%%/*}; case $hq in *"\\"$x\\""*) f=$f,$x; break;; esac; '
        '[ "$x" = "$w" ] && break; w=${w#*/}; done; done; '
        f'[ -n "$f" ] && {{ h=$({t} nvidia-smi "--query-gpu=${{f#,}}" --format=csv 2>&1); r=$?; }};; esac; '
        'printf \'%s\\n@@rc %s\\n\' "$h" "$r"'
    )


def kernel_shell(t: str = "$t") -> str:
    """The last NVRM line of each (GPU, Xid code) after its count; dmesg's complaint as `@@error`."""
    program = (
        '/NVRM: Xid |NVRM: GPU .*fallen off the bus/ { k = $0; sub(/^[^ ]* /, "", k); sub(/,.*/, "", k); '
        "if (!(k in n)) o[++m] = k; n[k]++; l[k] = $0; next } "
        '!/^[0-9][0-9][0-9][0-9]-/ && e < 3 { print "@@error " $0; e++ } '
        "END { for (i = 1; i <= m; i++) print n[o[i]], l[o[i]] }"
    )
    return f"{t} {KERNEL_LOG} 2>&1 | awk '{program}'"


Bus = tuple[int, int, int]  # PCI domain, bus, device


@dataclass(frozen=True)
class GpuReading:
    """One GPU's row of the health query; None: not asked or not available."""

    index: int
    bus_id: str
    ecc_mode: str | None = None
    corrected_volatile: int | None = None
    corrected_aggregate: int | None = None
    uncorrected_volatile: int | None = None
    uncorrected_aggregate: int | None = None
    retired_pending: bool | None = None
    remapped_correctable: int | None = None
    remapped_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    recovery_action: str | None = None  # "None", "Reset", ...
    reset_required: bool | None = None
    drain_and_reset: bool | None = None
    clocks_event_reasons: int | None = None  # the active bitmask
    temperature_c: int | None = None
    power_w: float | None = None
    pcie: str | None = None  # "gen 5 x16 (max gen 5 x16)"
    unreadable: tuple[str, ...] = ()  # fields answered ERR! or [Unknown Error]
    lost: bool = False

    @property
    def bus(self) -> Bus | None:
        return bus_of(self.bus_id)


@dataclass(frozen=True)
class KernelEvent:
    """The last kernel log line of one (GPU, Xid code) since boot, and their count."""

    bus: Bus
    code: int | None  # None: "GPU has fallen off the bus"
    text: str  # without pid and process name
    at: float | None  # epoch seconds
    count: int = 1

    @property
    def when(self) -> str:
        if self.at is None:
            return "at an unknown time"
        return f"at {datetime.fromtimestamp(self.at, UTC):%Y-%m-%dT%H:%M:%SZ}"


@dataclass(frozen=True)
class GpuHealth:
    gpus: tuple[GpuReading, ...] = ()
    events: tuple[KernelEvent, ...] = ()
    lacks: tuple[str, ...] = ()  # health fields this driver does not offer
    error: str | None = None  # why the health query failed
    kernel_log_error: str | None = None


def bus_of(text: str) -> Bus | None:
    """ "00000000:3B:00.0" (nvidia-smi) or "0000:3b:00" (an Xid line) -> (domain, bus, device)."""
    m = re.fullmatch(r"(?:PCI:)?([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?", text.strip())
    return (int(m[1], 16), int(m[2], 16), int(m[3], 16)) if m else None


def _rc(lines: list[str]) -> tuple[list[str], int]:
    if lines and lines[-1].startswith("@@rc "):
        return lines[:-1], int(lines[-1].split()[1])
    return lines, 0


def parse_query(lines: list[str]) -> tuple[tuple[GpuReading, ...], tuple[str, ...], str | None]:
    """(readings, the fields this driver lacks, error)."""
    lines, rc = _rc(lines)
    rows = [line for line in lines if line.strip()]
    if rc in TIMED_OUT:
        return (), (), "nvidia-smi did not answer within its bound (a wedged driver or GPU)"
    if not rows or not rows[0].startswith("index"):
        return (), (), excerpt(f"nvidia-smi exited {rc}: {' '.join(rows) or 'no output'}", 300)
    names = [_CANONICAL.get(re.sub(r" \[.*\]$", "", name.strip()), name.strip()) for name in rows[0].split(",")]
    lacks = tuple(names_[0] for names_ in HEALTH_FIELDS if names_[0] not in names)
    readings: list[GpuReading] = []
    for row in rows[1:]:
        if _LOST in row:
            found = re.search(r"([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])", row)
            readings.append(GpuReading(index=len(readings), bus_id=found[1] if found else "?", lost=True))
            continue
        values = [value.strip() for value in row.split(",")]
        if len(values) != len(names):
            return (), lacks, excerpt(f"a row of {len(values)} fields under a header of {len(names)}: {row}", 300)
        try:
            readings.append(_reading(dict(zip(names, values, strict=True))))
        except ValueError as error:
            return (), lacks, excerpt(f"{error}: {row}", 300)
    return tuple(readings), lacks, None


def _reading(v: dict[str, str]) -> GpuReading:
    unreadable = tuple(name for name, value in v.items() if value in _UNREADABLE)

    def text(name: str) -> str | None:
        value = v.get(name)
        return None if value is None or value.startswith("[") or value in _UNREADABLE else value

    def count(name: str) -> int | None:
        value = text(name)
        return int(value) if value is not None and value.isdigit() else None

    def flag(name: str) -> bool | None:
        return {"Yes": True, "No": False}.get(text(name) or "")

    def number(name: str) -> float | None:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(?: \w+)?", text(name) or "")
        return float(m[1]) if m else None

    reasons = text("clocks_event_reasons.active")
    gen, gen_max = text("pcie.link.gen.gpucurrent"), text("pcie.link.gen.max")
    width, width_max = text("pcie.link.width.current"), text("pcie.link.width.max")
    temperature = number("temperature.gpu")
    return GpuReading(
        index=int(v["index"]),
        bus_id=v.get("pci.bus_id", "?"),
        ecc_mode=text("ecc.mode.current"),
        corrected_volatile=count("ecc.errors.corrected.volatile.total"),
        corrected_aggregate=count("ecc.errors.corrected.aggregate.total"),
        uncorrected_volatile=count("ecc.errors.uncorrected.volatile.total"),
        uncorrected_aggregate=count("ecc.errors.uncorrected.aggregate.total"),
        retired_pending=flag("retired_pages.pending"),
        remapped_correctable=count("remapped_rows.correctable"),
        remapped_uncorrectable=count("remapped_rows.uncorrectable"),
        remap_pending=flag("remapped_rows.pending"),
        remap_failure=flag("remapped_rows.failure"),
        recovery_action=text("gpu_recovery_action"),
        reset_required=flag("reset_status.reset_required"),
        drain_and_reset=flag("reset_status.drain_and_reset_recommended"),
        clocks_event_reasons=int(reasons, 16) if reasons and re.fullmatch(r"0x[0-9a-fA-F]+", reasons) else None,
        temperature_c=None if temperature is None else int(temperature),
        power_w=number("power.draw"),
        pcie=f"gen {gen} x{width} (max gen {gen_max} x{width_max})" if gen and width else None,
        unreadable=unreadable,
    )


_XID = re.compile(r"NVRM: Xid \((?P<bus>[^)]*)\): (?P<code>\d+)(?:, (?P<text>.*))?$")
_FALLEN = re.compile(r"NVRM: GPU (?:at )?(?P<bus>[0-9A-Za-z:.]+): GPU has fallen off the bus")
_PROCESS = re.compile(r"^(?:pid=[^,]*, )?(?:name=[^,]*, )?")


def parse_kernel_log(lines: list[str]) -> tuple[tuple[KernelEvent, ...], str | None]:
    """(events, what dmesg said instead of a log)."""
    events, errors = [], []
    for line in lines:
        if line.startswith("@@error "):
            errors.append(line[len("@@error ") :].strip())
            continue
        count, _, rest = line.strip().partition(" ")
        stamp, _, message = rest.partition(" ")
        if not count.isdigit():
            continue
        xid, fallen = _XID.search(message), _FALLEN.search(message)
        found = xid or fallen
        bus = bus_of(found["bus"]) if found else None
        if found is None or bus is None:
            continue
        text = _PROCESS.sub("", xid["text"] or "") if xid else "GPU has fallen off the bus"
        events.append(
            KernelEvent(
                bus=bus,
                code=int(xid["code"]) if xid else None,
                text=excerpt(text, 120),
                at=_epoch(stamp),
                count=int(count),
            )
        )
    return tuple(events), excerpt("; ".join(errors), 200) if errors else None


def _epoch(stamp: str) -> float | None:
    try:
        return datetime.fromisoformat(stamp.replace(",", ".")).timestamp()
    except ValueError:
        return None


def parse_health(query: list[str], kernel: list[str]) -> GpuHealth:
    gpus, lacks, error = parse_query(query)
    events, kernel_error = parse_kernel_log(kernel)
    return GpuHealth(gpus=gpus, events=events, lacks=lacks, error=error, kernel_log_error=kernel_error)
