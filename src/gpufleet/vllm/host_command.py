"""The host snapshot's one command: data/vllm/snapshot.sh and a call per section. Design: docs/deploy.md."""

from __future__ import annotations

import ipaddress
import json
import shlex
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.facts.gpu_health import kernel_shell, query_shell
from gpufleet.facts.nvidia import QUERY_GPUS, QUERY_VERSION
from gpufleet.hoststate import reader
from gpufleet.hoststate.sections import MARK, end
from gpufleet.names import LOOPBACK, container_label_key, url_host
from gpufleet.units import unit_name, unit_path
from gpufleet.vllm.weights import MARKER
from gpufleet.wire.metrics import CACHE_CONFIG

DAEMON_JSON = "/etc/docker/daemon.json"
DOCKER_SOCKET = "/var/run/docker.sock"
# Without curl, the docker CLI's sections are "images" and "running".
DOCKER_IMAGES, DOCKER_CONTAINERS = "docker_images", "docker_containers"
DRIVER_FILE = "driver_file"
GPU_HEALTH, KERNEL_LOG = "gpu_health", "kernel_log"
COMMAND_TIMEOUT_S = 20  # per program
TIMED_OUT = (124, 137)  # timeout's: cut off, or killed after ignoring SIGTERM
SYSTEMD_PROPERTIES = (
    "Id",
    "LoadState",
    "ActiveState",
    "SubState",
    "UnitFileState",
    "FragmentPath",
    "NeedDaemonReload",
    "NRestarts",
)
PACKAGES = (
    "docker.io",
    "containerd",
    "docker-ce",
    "docker-ce-cli",
    "containerd.io",
    "nvidia-container-toolkit",
    "curl",
    "ca-certificates",
)


@dataclass(frozen=True)
class Paths:
    """What the snapshot reads. dirs and files are what the operations manage: no write is decided blind."""

    service: str
    models_dir: str  # free space measured here
    model_dir: str
    dirs: tuple[str, ...]  # owner and mode read
    files: tuple[str, ...]  # sha256 read
    ledger_path: str
    env_file: str
    port: int
    nvidia_key_url: str
    docker_repo_url: str | None  # docker-ce only
    # Keys are fetched only for a missing keyring or refresh_keys (docs/deploy.md).
    nvidia_keyring: str
    docker_keyring: str
    nvidia_version_file: str | None = None  # None: always ask nvidia-smi --version
    refresh_keys: bool = False
    address: str = LOOPBACK  # ServeSpec.reach_address
    site_cache_storage: str | None = None  # the site cache's host only
    group_head: tuple[str, int] | None = None  # a group rank probes its head's master port


SCRIPT = (Path(__file__).resolve().parents[1] / "data" / "vllm" / "snapshot.sh").read_text()


def snapshot_command(paths: Paths) -> str:
    return script(steps(paths))


def script(calls: Sequence[str]) -> str:
    """snapshot.sh's and gpu_health's functions, then `calls`, one line each."""
    return "\n".join(
        [f"query_gpu_health() {{ {query_shell()}; }}", f"read_kernel_log() {{ {kernel_shell()}; }}", SCRIPT, *calls]
    )


def steps(paths: Paths) -> list[str]:
    """The snapshot's calls, in order, the last printing the end marker."""
    label = container_label_key(paths.service)
    containers = "/containers/json?filters=" + urllib.parse.quote(
        json.dumps({"label": [label]}, separators=(",", ":")), safe=""
    )
    # Settings accept only an IP address here; url_host brackets IPv6.
    address = url_host(str(ipaddress.ip_address(paths.address)))
    # '' fetches the key even where one is installed.
    nvidia_keyring, docker_keyring = ("", "") if paths.refresh_keys else (paths.nvidia_keyring, paths.docker_keyring)
    return [
        call("begin", MARK, COMMAND_TIMEOUT_S, DOCKER_SOCKET),
        "read_os",
        call("read_gpus", *shlex.split(QUERY_GPUS)),
        call("read_driver", paths.nvidia_version_file or "", *shlex.split(QUERY_VERSION)),
        "read_gpu_health",
        call("read_docker_config", DAEMON_JSON),
        call("read_free", paths.models_dir),
        *([] if paths.site_cache_storage is None else [call("read_site_cache", paths.site_cache_storage)]),
        *([] if paths.group_head is None else [group_probe_call(*paths.group_head)]),
        call("read_packages", *PACKAGES),
        call("read_files", *paths.files),
        *reader.read_lines(paths.ledger_path),
        "read_images",
        call("read_model", paths.model_dir, MARKER),
        call("read_dirs", *paths.dirs),
        call("read_units", unit_name(paths.service), *(word for p in SYSTEMD_PROPERTIES for word in ("-p", p))),
        call("read_running", unit_path(paths.service), label),
        call("find_container", containers),
        call(
            "read_http",
            paths.env_file,
            address,
            int(paths.port),
            label,
            containers,
            CACHE_CONFIG,
            nvidia_keyring,
            paths.nvidia_key_url,
            docker_keyring,
            paths.docker_repo_url or "",
        ),
        end(),
    ]


def call(function: str, *args: object) -> str:
    return shlex.join([function, *map(str, args)])


GROUP_PROBE_TIMEOUT_S = 5  # a filtered port never answers


def group_probe_call(address: str, port: int) -> str:
    return call("probe_group", ipaddress.ip_address(address), int(port), GROUP_PROBE_TIMEOUT_S)
