"""The host snapshot as a pyinfra fact: the parser of gpufleet.vllm.host_command's output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import FactBase
from pyinfra.api.exceptions import FactProcessError

from gpufleet.facts.gpu_health import GpuHealth, parse_health
from gpufleet.facts.nvidia import Gpu, NvidiaVersion, parse_gpus, parse_version
from gpufleet.hoststate import reader, sections
from gpufleet.vllm.host_command import (
    COMMAND_TIMEOUT_S,
    DAEMON_JSON,
    DOCKER_CONTAINERS,
    DOCKER_IMAGES,
    DRIVER_FILE,
    GPU_HEALTH,
    GROUP_PROBE_TIMEOUT_S,
    KERNEL_LOG,
    TIMED_OUT,
    Paths,
    snapshot_command,
)
from gpufleet.wire.identity import served_models
from gpufleet.wire.metrics import parse_metrics

# Preflight matches this to name the port's listener in its fix.
SNAPSHOT_REFUSED = "host snapshot refused"
# A few partial downloads name the problem; a failed download may leave many.
MAX_INCOMPLETE = 3


@dataclass(frozen=True)
class ServiceUnit:
    """systemd's view of the unit vllm_service names, which may predate gpufleet."""

    name: str  # an alias resolves to its target
    load_state: str
    fragment_path: str
    first_line: str  # gpufleet's units start with its "Managed by" header

    @property
    def exists(self) -> bool:
        return self.load_state not in ("", "not-found")


# The unit header's second line (templates/vllm.service.j2).
UNIT_PINS = re.compile(r"^# Spec (?P<spec>[0-9a-f]+); image pinned to (?P<image>\S+)\.$")


@dataclass(frozen=True)
class RunningService:
    """What really runs for the service, next to what its unit file says (docs/crash-safety.md)."""

    active_state: str = ""
    sub_state: str = ""
    need_daemon_reload: bool = False
    unit_spec_hash: str | None = None  # None: no gpufleet unit on disk
    unit_image: str | None = None
    containers: tuple[tuple[str, str], ...] = ()  # (label, image) of each labelled running container
    restarts: int = 0  # systemd's NRestarts since the last start

    @property
    def running_image(self) -> str | None:
        """None unless exactly one labelled container runs."""
        return self.containers[0][1] if len(self.containers) == 1 else None

    @property
    def running_spec_hash(self) -> str | None:
        return self.containers[0][0] if len(self.containers) == 1 else None

    def drift(self) -> list[str]:
        """How what runs differs from the unit, one phrase each. Only a running gpufleet unit is compared."""
        problems = []
        if self.need_daemon_reload:
            problems.append("systemd has not loaded the unit file on disk (NeedDaemonReload=yes)")
        if self.unit_spec_hash is None or self.active_state != "active":
            return problems
        for label, image in self.containers:
            if label != self.unit_spec_hash:
                problems.append(f"the container runs spec {label or 'unlabelled'}, the unit spec {self.unit_spec_hash}")
            if image != self.unit_image:
                problems.append(f"the container runs {image}, the unit pins {self.unit_image}")
        if len(self.containers) > 1:
            problems.append(f"{len(self.containers)} containers carry the service's label")
        return problems


@dataclass
class HostSnapshot:
    os: dict[str, str] = field(default_factory=dict)
    arch: str = ""
    nvidia_smi: bool = False  # on PATH
    gpus: list[Gpu] = field(default_factory=list)
    driver: NvidiaVersion | None = None
    # What the version file must hold; None when not asked or unusable.
    driver_output: str | None = None
    driver_from_file: bool = False  # read from Paths.nvidia_version_file
    nvidia_error: str | None = None  # nvidia-smi present but its output unusable
    gpu_health: GpuHealth | None = None  # None: not read
    daemon_json: dict[str, Any] | None = None  # None: no file
    daemon_json_error: str | None = None
    free_kib: dict[str, int] = field(default_factory=dict)  # "docker"/"models" -> KiB free
    free_path: dict[str, str] = field(default_factory=dict)  # the directory actually measured
    # On the site cache's host only.
    site_cache_used_kib: int | None = None
    site_cache_shares_docker: bool = False
    packages: dict[str, str] = field(default_factory=dict)  # installed package -> version
    file_sha256: dict[str, str | None] = field(default_factory=dict)
    # Armored keys as served now; None: not asked, or no answer.
    nvidia_key: str | None = None
    docker_key: str | None = None
    ledger_text: str | None = None  # None: no ledger file
    other_ledgers: dict[str, str] = field(default_factory=dict)  # path -> text
    images: list[tuple[str, str, str]] = field(default_factory=list)  # (repository, tag, digest)
    model_files: dict[str, int] = field(default_factory=dict)  # name -> size, top level
    model_shards: list[str] = field(default_factory=list)  # shards listed by model.safetensors.index.json
    model_incomplete: list[str] = field(default_factory=list)  # hf's *.incomplete partial downloads
    model_checked: str | None = None  # the weights.MARKER file: repo@commit
    dirs: dict[str, tuple[str, str, str] | None] = field(default_factory=dict)  # path -> (user, group, mode)
    units: dict[str, tuple[str, str]] = field(default_factory=dict)  # unit -> (is-active, is-enabled)
    service_unit: ServiceUnit | None = None
    running: RunningService = field(default_factory=RunningService)
    health_code: str | None = None
    served_models: list[tuple[str, int | None]] | None = None  # /v1/models: (id, max_model_len)
    cache_config: dict[str, str] = field(default_factory=dict)  # vllm:cache_config_info labels
    # A group rank's probe of its head's master port (group_probe).
    group_probe: str | None = None

    def installed(self, package: str) -> bool:
        return package in self.packages

    def unit_active(self, unit: str) -> bool:
        return self.units.get(unit, ("", ""))[0] == "active"

    def unit_enabled(self, unit: str) -> bool:
        return self.units.get(unit, ("", ""))[1] == "enabled"

    def has_image_digest(self, ref: str) -> bool:
        """Is `repo@sha256:...` present locally?"""
        repo, _, digest = ref.partition("@")
        return any(r == repo and d == digest for r, _, d in self.images)

    @property
    def nvidia_runtime(self) -> bool:
        runtimes = (self.daemon_json or {}).get("runtimes")
        return isinstance(runtimes, dict) and "nvidia" in runtimes


# The service's answers come last; a marker in them naming another section is forged (docs/crash-safety.md).
AFTER_ANSWERS = ("cache_config", sections.END)


def split_sections(lines: list[str]) -> dict[str, list[str]]:
    try:
        return sections.split(lines, answers="health", after_answers=AFTER_ANSWERS)
    except sections.Forged as error:
        raise FactProcessError(f"{SNAPSHOT_REFUSED}: {error}") from None
    except sections.Truncated as error:
        raise FactProcessError(f"host snapshot output is truncated ({error})") from None


def _nvidia_section(lines: list[str]) -> tuple[list[str], int]:
    rc = 0
    if lines and lines[-1].startswith("@@rc "):
        rc = int(lines[-1].split()[1])
        lines = lines[:-1]
    if rc in TIMED_OUT:
        raise FactProcessError(f"nvidia-smi did not answer within {COMMAND_TIMEOUT_S} s (a wedged driver or GPU)")
    return lines, rc


def parse_snapshot(lines: list[str]) -> HostSnapshot:
    s = split_sections(lines)
    snap = HostSnapshot()
    for line in s.get("os", []):
        key, sep, value = line.partition("=")
        if sep:
            snap.os[key.strip()] = value.strip().strip('"')
    snap.arch = (s.get("arch") or [""])[0].strip()
    snap.nvidia_smi = (s.get("nvidia_smi") or ["0"])[0].strip() == "1"
    if snap.nvidia_smi:
        try:
            gpus, rc = _nvidia_section(s.get("gpus", []))
            if rc == 6 or any("No devices were found" in line for line in gpus):
                snap.gpus = []  # driver, no GPU: a GPU-less host
            else:
                snap.gpus = parse_gpus(gpus)
                if rc:
                    raise FactProcessError(f"nvidia-smi --query-gpu exited {rc}")
                if DRIVER_FILE in s:
                    snap.driver, snap.driver_from_file = parse_version(s[DRIVER_FILE]), True
                else:
                    driver = _nvidia_section(s.get("driver", []))[0]
                    snap.driver = parse_version(driver)
                    snap.driver_output = "\n".join(driver) + "\n"
        except FactProcessError as error:
            snap.nvidia_error = str(error)
    if snap.gpus and s.get(GPU_HEALTH):
        snap.gpu_health = parse_health(s[GPU_HEALTH], s.get(KERNEL_LOG, []))
    text = "\n".join(s.get("daemon_json", [])).strip()
    if text:
        try:
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            snap.daemon_json = value
        except ValueError as error:
            snap.daemon_json_error = f"{DAEMON_JSON} is not valid JSON ({error})"
    for line in s.get("free", []):
        place, _, rest = line.partition(" ")
        path, _, kib = rest.rpartition(" ")  # the path may hold spaces
        if path and kib.isdigit():
            snap.free_kib[place] = int(kib)
            snap.free_path[place] = path
    for line in s.get("site_cache", []):
        word, _, rest = line.partition(" ")
        if word == "used" and rest.isdigit():
            snap.site_cache_used_kib = int(rest)
        elif word == "free" and rest.partition(" ")[0].isdigit():
            snap.free_kib["site_cache"] = int(rest.partition(" ")[0])
            snap.free_path["site_cache"] = rest.partition(" ")[2]
        snap.site_cache_shares_docker |= word == "shares_docker"
    if "group_probe" in s:
        snap.group_probe = group_probe(s["group_probe"])
    for line in s.get("packages", []):
        parts = line.split()
        # "ii": installed; "rc" and "un" are not.
        if len(parts) >= 3 and parts[1] == "ii":
            snap.packages[parts[0]] = parts[2]
    for line in s.get("files", []):
        digest, _, path = line.partition(" ")
        if len(digest) == 64:
            snap.file_sha256[path.strip().lstrip("*")] = digest
    for name in ("nvidia_key", "docker_key"):
        text = "\n".join(s.get(name, [])).strip()
        if "BEGIN PGP PUBLIC KEY BLOCK" in text:
            setattr(snap, name, text + "\n")
    ledgers = reader.ledger_texts(s)
    snap.ledger_text, snap.other_ledgers = ledgers.own, dict(ledgers.others)
    snap.images = docker_images(s.get(DOCKER_IMAGES, []))
    for line in s.get("images", []):  # the docker CLI's rows (a host without curl)
        parts = line.split("|")
        if len(parts) == 3 and parts[2].startswith("sha256:"):
            snap.images.append((parts[0], parts[1], parts[2]))
    shards = set()
    for line in s.get("model", []):
        kind, _, rest = line.partition(" ")
        if kind == "shard":
            shards.add(rest)
        elif kind == "checked":
            snap.model_checked = rest.strip() or None
        elif kind == "incomplete":
            if len(snap.model_incomplete) < MAX_INCOMPLETE:
                snap.model_incomplete.append(rest)
        else:
            name, _, size = line.rpartition(" ")
            if size.isdigit():
                snap.model_files[name] = int(size)
    snap.model_shards = sorted(shards)
    for line in s.get("dirs", []):
        parts = line.split(" ", 3)
        if len(parts) == 4:
            snap.dirs[parts[3]] = (parts[0], parts[1], parts[2])
    blocks = systemd_blocks(s.get("units", []))
    for block in blocks:
        snap.units[block.get("Id", "?")] = (block.get("ActiveState", ""), block.get("UnitFileState", ""))
    # The service's block: docker.service's comes first.
    service = blocks[1] if len(blocks) > 1 else {}
    fields = {**service, **dict(line.partition("=")[::2] for line in s.get("service_unit", []) if "=" in line)}
    if fields.get("Id"):
        snap.service_unit = ServiceUnit(
            name=fields["Id"],
            load_state=fields.get("LoadState", ""),
            fragment_path=fields.get("FragmentPath", ""),
            first_line=fields.get("FirstLine", ""),
        )
    api_containers = next(
        (
            docker_containers(body, name.partition(" ")[2])
            for name, body in s.items()
            if name.startswith(DOCKER_CONTAINERS + " ")
        ),
        [],
    )
    snap.running = parse_running(s.get("running", []), service, api_containers)
    health = s.get("health", [])
    if health and health[0].strip() not in ("", "000"):
        snap.health_code = health[0].strip()
        body = "\n".join(health[1:]).strip()
        try:
            snap.served_models = served_models(body.encode())
        except ValueError:
            snap.served_models = None
    try:
        snap.cache_config = parse_metrics("\n".join(s.get("cache_config", [])) + "\n").cache_config
    except ValueError:
        snap.cache_config = {}
    return snap


def group_probe(lines: list[str]) -> str:
    """ "open", "refused", or why the probe could not reach the head."""
    rc = lines[-1].removeprefix("rc ").strip() if lines and lines[-1].startswith("rc ") else ""
    said = " ".join(line.rsplit(": ", 1)[-1].strip() for line in lines[:-1] if line.strip())
    if rc == "0":
        return "open"
    if "Connection refused" in said:
        return "refused"
    if rc.isdigit() and int(rc) in TIMED_OUT:
        return f"no answer within {GROUP_PROBE_TIMEOUT_S} s"
    return said or f"the probe exited {rc or 'without a status'}"


def systemd_blocks(lines: list[str]) -> list[dict[str, str]]:
    """`systemctl show` output of several units, one dict per unit."""
    blocks: list[dict[str, str]] = []
    block: dict[str, str] = {}
    for line in [*lines, ""]:
        key, sep, value = line.partition("=")
        if sep:
            block[key.strip()] = value.strip()
        elif block:
            blocks.append(block)
            block = {}
    return blocks


def _json_list(lines: list[str]) -> list[dict[str, Any]]:
    """An Engine API listing; [] when the daemon gave none."""
    try:
        value = json.loads("\n".join(lines))
    except ValueError:
        return []
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def docker_images(lines: list[str]) -> list[tuple[str, str, str]]:
    """/images/json as `docker images --digests` rows with a registry digest: one per tag, else tag "<none>"."""
    rows = []
    for image in _json_list(lines):
        tags: dict[str, list[str]] = {}
        for name in image.get("RepoTags") or []:
            repository, _, tag = str(name).rpartition(":")
            if repository and tag and "/" not in tag:  # "/": a registry port, not a tag
                tags.setdefault(repository, []).append(tag)
        for name in image.get("RepoDigests") or []:
            repository, _, digest = str(name).partition("@")
            if repository and digest.startswith("sha256:"):  # "<none>@<none>": no digest
                rows += [(repository, tag, digest) for tag in tags.get(repository, ["<none>"])]
    return rows


def docker_containers(lines: list[str], label_key: str) -> list[tuple[str, str]]:
    """/containers/json as (label value, image) pairs, as `docker ps` prints them."""
    return [
        (str((c.get("Labels") or {}).get(label_key, "")), str(c.get("Image") or "<no image>"))
        for c in _json_list(lines)
    ]


def parse_running(
    lines: list[str], unit: dict[str, str] | None = None, containers: list[tuple[str, str]] | None = None
) -> RunningService:
    """The section's lines (Header; Container on a host without curl) add to `unit`'s systemd properties and to
    `containers`."""
    fields: dict[str, str] = dict(unit or {})
    containers = list(containers or [])
    for line in lines:
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "Container":
            label, _, image = value.partition("|")
            containers.append((label.strip(), image.strip()))
        else:
            fields[key] = value.strip()
    pins = UNIT_PINS.match(fields.get("Header", ""))
    return RunningService(
        active_state=fields.get("ActiveState", ""),
        sub_state=fields.get("SubState", ""),
        need_daemon_reload=fields.get("NeedDaemonReload") == "yes",
        restarts=int(fields["NRestarts"]) if fields.get("NRestarts", "").isdigit() else 0,
        unit_spec_hash=pins["spec"] if pins else None,
        unit_image=pins["image"] if pins else None,
        containers=tuple(containers),
    )


class GpufleetHost(FactBase[HostSnapshot]):
    """Everything the deploy decides from, in one command; run it with _sudo=True (it reads root files)."""

    def command(self, paths: Paths) -> str:
        return snapshot_command(paths)

    @staticmethod
    def default() -> HostSnapshot:
        return HostSnapshot()

    def process(self, output: list[str]) -> HostSnapshot:
        return parse_snapshot(output)
