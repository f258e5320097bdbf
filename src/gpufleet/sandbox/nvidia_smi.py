"""Host-side `nvidia-smi` stand-in, generated from real recordings (tests/fixtures/nvidia-smi/).

The host half (`/usr/bin/nvidia-smi` runs this stdlib-only file) comes first and exits before the machine half's
imports, so a call costs no more than the real tool's (docs/bench-history.md). The machine half builds a per-host
Profile from the recordings and installs it.

    >>> p = make_profile(3, seed="gpuhost1")
    >>> render(p, ["--query-gpu=count", "--format=csv,noheader"]).stdout
    '3\\n3\\n3\\n'
"""

from __future__ import annotations

import sys
import time

HOST_MODULE = "/usr/lib/gpufleet-standin/nvidia_smi.py"
HOST_PROFILE = "/etc/gpufleet-standin/nvidia-smi.json"
HOST_HELP = "/etc/gpufleet-standin/nvidia-smi-help.txt"  # what --help-query-gpu prints
# Isolated, as the real tool ignores PYTHON* too, and without site, most of an interpreter's startup.
HOST_PYTHON_FLAGS = "-I -S"
# The richest recording: NVLink, two GPUs, field help.
TEMPLATE = "h200-2gpu"

INVALID_ARGS = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"


class Result:
    """What one call prints and its exit status; a plain class, as the host half must not import dataclasses."""

    __slots__ = ("rc", "stdout")

    def __init__(self, stdout: str, rc: int = 0) -> None:
        self.stdout = stdout
        self.rc = rc

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Result) and (self.stdout, self.rc) == (other.stdout, other.rc)

    def __hash__(self) -> int:
        return hash((self.stdout, self.rc))

    def __repr__(self) -> str:
        return f"Result(stdout={self.stdout!r}, rc={self.rc!r})"


# ------------------------------------------------------------------------------------------------------ render
def _free(g: Gpu) -> int:
    return g.memory_total - g.memory_used - g.memory_reserved


def _fit(value: str, width: int) -> str:
    """Left-justify in the recorded column width; a longer value pushes the rest right, as in the real tool."""
    return value.ljust(width)


def table(p: Profile, now: float | None = None, gpus: list[Gpu] | None = None) -> str:
    gpus = p.gpus if gpus is None else gpus
    sep = "+-----------------------------------------+------------------------+----------------------+\n"
    full = "+-----------------------------------------------------------------------------------------+\n"
    out = [
        time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(now)) + "       \n",
        full,
        f"| NVIDIA-SMI {_fit(p.driver, 22)} Driver Version: {_fit(p.driver, 14)} CUDA Version: {_fit(p.cuda, 9)}|\n",
        sep,
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |\n",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |\n",
        "|                                         |                        |               MIG M. |\n",
        "|=========================================+========================+======================|\n",
    ]
    for g in gpus:
        pm = "On" if g.persistence else "Off"
        power = f"{round(g.power_draw)}W / {round(g.power_limit):>4}W"
        memory = f"{g.memory_used}MiB / {g.memory_total}MiB"
        out += [
            f"| {g.index:>3}  {g.name.ljust(33 - len(pm))}{pm}  |   {g.bus_id} Off | {g.ecc:>20} |\n",
            f"| N/A  {g.temperature:>3}C    {g.perf}{power:>24} | {memory:>22} | {g.utilization:>6}%{g.compute_mode:>13} |\n",
            f"|                                         |                        | {g.mig:>20} |\n",
            sep,
        ]
    out += [
        "\n",
        full,
        "| Processes:                                                                              |\n",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |\n",
        "|        ID   ID                                                               Usage      |\n",
        "|=========================================================================================|\n",
        "|  No running processes found                                                             |\n",
        full,
    ]
    return "".join(out)


def list_gpus(p: Profile) -> str:
    return "".join(f"GPU {g.index}: {g.name} (UUID: {g.uuid})\n" for g in p.gpus)


def version(p: Profile) -> str:
    nvml = ".".join(p.driver.split(".")[:2])
    return (
        f"NVIDIA-SMI version  : {p.driver}\nNVML version        : {nvml}\n"
        f"DRIVER version      : {p.driver}\nCUDA Version        : {p.cuda}\n"
    )


def topo(p: Profile) -> str:
    names = [f"GPU{g.index}" for g in p.gpus]
    out = ["\t\x1b[4m" + "\t".join([*names, "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]) + "\x1b[0m\n"]
    for i, name in enumerate(names):
        links = [" X " if j == i else p.link for j in range(len(names))]
        out.append("\t".join([name, *links, p.cpu_affinity, p.numa, "", "N/A"]) + "\n")
    return "".join(out) + "\n" + p.topo_legend


# field -> (header unit, value), in the recorded formats
_FIELDS = {
    "index": ("", lambda p, g: str(g.index)),
    "uuid": ("", lambda p, g: g.uuid),
    "gpu_uuid": ("", lambda p, g: g.uuid),
    "name": ("", lambda p, g: g.name),
    "gpu_name": ("", lambda p, g: g.name),
    "count": ("", lambda p, g: str(len(p.gpus))),
    "memory.total": ("MiB", lambda p, g: str(g.memory_total)),
    "memory.used": ("MiB", lambda p, g: str(g.memory_used)),
    "memory.free": ("MiB", lambda p, g: str(_free(g))),
    "driver_version": ("", lambda p, g: p.driver),
    "pci.bus_id": ("", lambda p, g: g.bus_id),
    "gpu_bus_id": ("", lambda p, g: g.bus_id),
    "compute_cap": ("", lambda p, g: g.compute_cap),
    "persistence_mode": ("", lambda p, g: "Enabled" if g.persistence else "Disabled"),
    "temperature.gpu": ("", lambda p, g: str(g.temperature)),
    "utilization.gpu": ("%", lambda p, g: str(g.utilization)),
    "power.draw": ("W", lambda p, g: f"{g.power_draw:.2f}"),
    "power.limit": ("W", lambda p, g: f"{g.power_limit:.2f}"),
}


# A healthy idle H200's health fields, recorded; a GPU's injected `fields` print instead.
HEALTHY = {
    "ecc.mode.current": "Enabled",
    "retired_pages.pending": "[N/A]",
    "retired_pages.sbe": "[N/A]",
    "retired_pages.dbe": "[N/A]",
    "remapped_rows.pending": "No",
    "remapped_rows.failure": "No",
    "gpu_recovery_action": "None",
    "reset_status.reset_required": "No",
    "reset_status.drain_and_reset_recommended": "No",
    "clocks_event_reasons.active": "0x0000000000000001",
    "clocks_throttle_reasons.active": "0x0000000000000001",
    "pcie.link.gen.gpucurrent": "5",
    "pcie.link.gen.current": "5",
    "pcie.link.gen.max": "5",
    "pcie.link.width.current": "16",
    "pcie.link.width.max": "16",
    **{
        f"ecc.errors.{kind}.{scope}.total": "0"
        for kind in ("corrected", "uncorrected")
        for scope in ("volatile", "aggregate")
    },
    **{f"remapped_rows.{kind}": "0" for kind in ("correctable", "uncorrectable", "sbe", "dbe")},
}


def query_gpu(p: Profile, fields: list[str], fmt: set[str], gpus: list[Gpu]) -> Result:
    for f in fields:
        if f not in _FIELDS and f not in p.valid_fields:
            return Result(f'Field "{f}" is not a valid field to query.\n\n', 2)
    lines = []
    if "noheader" not in fmt:
        units = [_FIELDS.get(f, ("", None))[0] for f in fields]
        lines.append(
            ", ".join(f"{f} [{u}]" if u and "nounits" not in fmt else f for f, u in zip(fields, units, strict=False))
        )
    for g in gpus:
        cells = []
        for f in fields:
            unit, get = _FIELDS.get(f, ("", None))
            if f in g.fields:
                cells.append(g.fields[f])
                continue
            value = get(p, g) if get else HEALTHY.get(f, "[N/A]")  # a valid field not modelled
            cells.append(f"{value} {unit}" if unit and "nounits" not in fmt and get else value)
        lines.append(", ".join(cells))
    return Result("".join(line + "\n" for line in lines))


def render(p: Profile, argv: list[str], now: float | None = None, help_text: str = "") -> Result:
    """What the real nvidia-smi prints, and its exit status, for argv on a host with this profile."""
    args = list(argv)
    if args == ["--help-query-gpu"]:
        return Result(help_text)
    gpus = p.gpus
    if args[:1] == ["-i"] or (args and args[0].startswith("--id=")):
        ids = args[1] if args[0] == "-i" else args[0].split("=", 1)[1]
        args = args[2:] if args[0] == "-i" else args[1:]
        try:
            gpus = [p.gpus[int(i)] for i in ids.split(",")]
        except (ValueError, IndexError):
            return Result("No devices were found\n", 6)
        if args == ["-L"]:
            return Result("ERROR: Option -i is not valid for this command. Please run 'nvidia-smi -h' for help.\n\n", 2)
    if not args:
        return Result(table(p, now, gpus))
    if args == ["-L"]:
        return Result(list_gpus(p))
    if args == ["--version"]:
        return Result(version(p))
    if args == ["topo", "-m"]:
        return Result(topo(p))
    query = [a for a in args if a.startswith("--query-gpu=")]
    fmt = [a for a in args if a.startswith("--format=")]
    if query and fmt and len(args) == 2 and fmt[0].split("=", 1)[1].split(",")[0] == "csv":
        return query_gpu(p, query[0].split("=", 1)[1].split(","), set(fmt[0].split("=", 1)[1].split(",")), gpus)
    if query:
        return Result(f'Field "{query[0].split("=", 1)[1]}" is not a valid field to query.\n\n', 2)
    return Result(INVALID_ARGS, 2)


# ------------------------------------------------------------------------------------------------------ host run
class _JsonContext:
    """json.loads' own settings, for json's C scanner without `import json`."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


def _json_loads(text: str) -> object:
    """json.loads(text); what the C scanner does not take whole goes to json."""
    try:
        from _json import make_scanner

        # typeshed asks for a JSONDecoder-like object; the scanner reads only _JsonContext's attributes
        value, end = make_scanner(_JsonContext)(text, 0)  # type: ignore[arg-type]
        if not text[end:].strip(" \t\n\r"):
            return value
    except (ImportError, StopIteration, ValueError):
        pass
    import json

    return json.loads(text)


class _Row:
    """A Gpu or Profile as the host half reads it, without importing dataclasses."""

    def __init__(self, defaults: dict[str, object], fields: dict[str, object]) -> None:
        self.__dict__.update(defaults)
        self.__dict__.update(fields)


# The dataclasses' defaults, kept equal by a unit test.
_GPU_DEFAULTS: dict[str, object] = {
    "perf": "P0",
    "ecc": "0",
    "compute_mode": "Default",
    "mig": "Disabled",
    "fields": {},
}
_PROFILE_DEFAULTS: dict[str, object] = {"valid_fields": [], "hang": False}


def host_profile(text: str) -> Profile:
    data = _json_loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise TypeError(f"{HOST_PROFILE}: not a stand-in profile (rewrite it with Profile.to_json())")
    data["gpus"] = [_Row(_GPU_DEFAULTS, g) for g in data["gpus"]]
    return _Row(_PROFILE_DEFAULTS, data)  # type: ignore[return-value]


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        profile = host_profile(f.read())
    if profile.hang:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it (timeout -k)
        while True:
            time.sleep(3600)
    help_text = ""
    if argv[1:] == ["--help-query-gpu"]:  # beside the profile (HOST_HELP on a host)
        with open(argv[0].rpartition("/")[0] + "/" + HOST_HELP.rpartition("/")[2]) as f:
            help_text = f.read()
    result = render(profile, argv[1:], help_text=help_text)
    sys.stdout.write(result.stdout)
    return result.rc


if __name__ == "__main__":
    # The host answers here, before the machine half's imports.
    sys.exit(main(sys.argv[1:]))


# ------------------------------------------------------------------------------------------------- machine half
import dataclasses  # noqa: E402  (below the host's exit on purpose: see the module docstring)
import hashlib  # noqa: E402
import json  # noqa: E402
import uuid as uuidlib  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402


@dataclass
class Gpu:
    index: int
    uuid: str
    name: str
    bus_id: str
    memory_total: int  # MiB
    memory_used: int
    memory_reserved: int  # total - used - free in the recordings
    compute_cap: str
    persistence: bool
    temperature: int
    utilization: int
    power_draw: float
    power_limit: float
    perf: str = "P0"
    ecc: str = "0"
    compute_mode: str = "Default"
    mig: str = "Disabled"
    fields: dict[str, str] = field(default_factory=dict)  # injected --query-gpu values


@dataclass
class Profile:
    driver: str
    cuda: str
    gpus: list[Gpu]
    cpu_affinity: str
    numa: str
    link: str  # between two GPUs in `topo -m`, e.g. NV18
    topo_legend: str
    valid_fields: list[str] = field(default_factory=list)  # from `nvidia-smi --help-query-gpu`
    hang: bool = False  # a wedged driver: every call blocks and ignores SIGTERM

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        data["gpus"] = [Gpu(**g) for g in data["gpus"]]
        return cls(**data)


# ----------------------------------------------------------------------------------------------- from recordings
def _read(d: Path, name: str) -> tuple[str, int]:
    """A recording and its exit status, from a trailing `rc=N` line."""
    text = (d / name).read_text()
    lines = text.splitlines(keepends=True)
    if lines and lines[-1].startswith("rc="):
        return "".join(lines[:-1]), int(lines[-1][3:])
    return text, 0


def profile_from_recording(d: Path) -> Profile:
    """The Profile of the recorded host."""
    gpus = []
    for line in (d / "query-gpu.csv").read_text().splitlines():
        (idx, uuid, name, total, used, free, _drv, bus, cc, pm, temp, util, power, limit) = line.split(", ")
        gpus.append(
            Gpu(
                index=int(idx),
                uuid=uuid,
                name=name,
                bus_id=bus,
                memory_total=int(total),
                memory_used=int(used),
                memory_reserved=int(total) - int(used) - int(free),
                compute_cap=cc,
                persistence=pm == "Enabled",
                temperature=int(temp),
                utilization=int(util),
                power_draw=float(power),
                power_limit=float(limit),
            )
        )
    version = {
        k.strip(): v.strip() for k, v in (line.split(" : ", 1) for line in (d / "version.txt").read_text().splitlines())
    }
    topo, _ = _read(d, "topo.txt")
    matrix, legend = topo.split("\n\n", 1)
    row0 = matrix.splitlines()[1].split("\t")
    n = len(gpus)
    help_file = d / "help-query-gpu.txt"
    if not help_file.exists():
        help_file = d.parent / TEMPLATE / "help-query-gpu.txt"
    return Profile(
        driver=version["DRIVER version"],
        cuda=version["CUDA Version"],
        gpus=gpus,
        cpu_affinity=row0[n + 1],
        numa=row0[n + 2],
        link=row0[2] if n > 1 else "NV18",
        topo_legend=legend,
        valid_fields=_fields_from_help(help_file.read_text()),
    )


def _fields_from_help(text: str) -> list[str]:
    return [
        part.strip().strip('"') for line in text.splitlines() if line.startswith('"') for part in line.split(" or ")
    ]


def help_text(recorded: str, valid_fields: list[str]) -> str:
    """The recorded --help-query-gpu cut to valid_fields, plus a line for each it lacks."""
    kept, known = [], set()
    for paragraph in recorded.rstrip("\n").split("\n\n"):
        first, newline, rest = paragraph.partition("\n")
        names = _fields_from_help(first) if paragraph.startswith('"') else []
        known.update(_fields_from_help(paragraph))
        offered = [name for name in names if name in valid_fields]
        if not names:
            kept.append(paragraph)
        elif offered:  # `"a" or "b"` may become `"b"`
            kept.append(paragraph if offered == names else " or ".join(f'"{n}"' for n in offered) + newline + rest)
    built = [
        f'"{name}"\n(a field of an older driver; built, not recorded)' for name in valid_fields if name not in known
    ]
    body = recorded.rstrip("\n")
    return "\n\n".join([*kept, *built]) + recorded[len(body) :]


def make_profile(
    count: int,
    *,
    model: str = "NVIDIA H200",
    memory_mib: int | None = None,
    driver: str | None = None,
    cuda: str | None = None,
    seed: str = "gpufleet",
    recordings: Path | None = None,
) -> Profile:
    """A `count`-GPU box derived from the real recording, its UUIDs derived from `seed` (the host name)."""
    base = profile_from_recording(recordings or default_recordings() / TEMPLATE)
    proto = base.gpus
    start_bus = int(proto[0].bus_id.rsplit(":", 1)[1].split(".")[0], 16)
    gpus = []
    for i in range(count):
        g = dataclasses.replace(
            proto[i % len(proto)],
            index=i,
            name=model,
            uuid="GPU-" + str(uuidlib.UUID(hashlib.sha256(f"{seed}/{i}".encode()).hexdigest()[:32])),
            bus_id=f"{proto[0].bus_id.rsplit(':', 1)[0]}:{start_bus + i:02X}.0",
        )
        if memory_mib is not None:
            g.memory_total = memory_mib
        gpus.append(g)
    return dataclasses.replace(base, gpus=gpus, driver=driver or base.driver, cuda=cuda or base.cuda)


def default_recordings() -> Path:
    return Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "nvidia-smi"


# ------------------------------------------------------------------------------------------------ install / run
def write_host_files(root: Path, profile: Profile | None) -> None:
    """Install the stand-in into a host root; no profile is a box without the driver."""
    if profile is None:
        return
    module = root / HOST_MODULE.lstrip("/")
    module.parent.mkdir(parents=True, exist_ok=True)
    module.write_text(Path(__file__).read_text())
    prof = root / HOST_PROFILE.lstrip("/")
    prof.parent.mkdir(parents=True, exist_ok=True)
    prof.write_text(profile.to_json())
    recorded = default_recordings() / TEMPLATE / "help-query-gpu.txt"
    if recorded.exists():  # not in a container, whose nvidia-smi is asked no help
        (root / HOST_HELP.lstrip("/")).write_text(help_text(recorded.read_text(), profile.valid_fields))
    exe = root / "usr/bin/nvidia-smi"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f'#!/bin/sh\nexec /usr/bin/python3 {HOST_PYTHON_FLAGS} {HOST_MODULE} {HOST_PROFILE} "$@"\n')
    exe.chmod(0o755)
