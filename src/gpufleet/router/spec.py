"""RouterSpec: everything a router host runs; the one place its argv are built."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from gpufleet import wheel_lock
from gpufleet.names import LOOPBACK

PACKAGE = "vllm-router"
# The worker set the unit replays after a restart.
MEMBERS_DIR = "/var/lib/gpufleet-router"


# In each whole locked venv: its lock key.
MARKER = "gpufleet-lock.sha256"


def members_path(service: str) -> str:
    return f"{MEMBERS_DIR}/{service}.workers"


# The worker API asks no key, so only these users may connect.
NFT = "/usr/sbin/nft"
FENCE_USERS = ("root", "www-data")


# Policies that place by X-Session-ID, which the front door derives.
SESSION_POLICIES = ("sticky_least_loaded", "consistent_hash")


def fence_table(internal_port: int) -> str:
    """The nftables table that fences the router on `internal_port`."""
    return f"gpufleet-router-{int(internal_port)}"


@dataclass(frozen=True)
class RouterSpec:
    host: str
    service: str
    venv: str
    version: str
    index_url: str
    address: str
    port: int
    metrics_port: int
    policy: str
    workers: tuple[str, ...]  # never in the argv or unit
    health_check_interval_s: int
    worker_startup_timeout_s: int
    internal_port: int = 28000

    def argv(self) -> list[str]:
        """No worker, so that the router listens at once."""
        return [
            f"{self.venv}/bin/vllm-router",
            "--host",
            LOOPBACK,
            "--port",
            str(self.internal_port),
            "--policy",
            self.policy,
            "--prometheus-host",
            LOOPBACK,
            "--prometheus-port",
            str(self.metrics_port),
            "--health-check-interval-secs",
            str(self.health_check_interval_s),
            "--worker-startup-timeout-secs",
            str(self.worker_startup_timeout_s),
        ]

    def fence_argv(self) -> list[str]:
        """One nftables transaction that replaces the fence's table."""
        table = f"inet {fence_table(self.internal_port)}"
        rule = (
            f'oifname "lo" tcp dport {self.internal_port} meta skuid != {{ {", ".join(FENCE_USERS)} }} '
            "reject with tcp reset"
        )
        return [
            NFT,
            f"table {table}; delete table {table}; table {table} {{ chain output {{ type filter hook "
            f"output priority 0; policy accept; {rule}; }}; }}",
        ]

    def rejoin_argv(self) -> list[str]:
        """After each (re)start, the members added back in the background."""
        add = (
            f"curl -fsS -o /dev/null -G -X POST --max-time {self.worker_startup_timeout_s + 10} "
            f'--data-urlencode "url=$u" {self.control_url}/add_worker'
        )
        script = (
            f"i=0; until curl -fs -o /dev/null --max-time 2 {self.control_url}/liveness; do i=$((i+1)); "
            f"[ $i -lt 60 ] || exit 0; sleep 0.5; done; "
            f"[ -r {self.members_file} ] || exit 0; "
            f'while read -r u; do [ -n "$u" ] && {{ {add} & }}; done < {self.members_file}; exit 0'
        )
        return ["/bin/sh", "-c", script]

    @property
    def keys_sessions(self) -> bool:
        return self.policy in SESSION_POLICIES

    @property
    def members_file(self) -> str:
        return members_path(self.service)

    def members_text(self) -> str:
        return "".join(f"{url}\n" for url in self.workers)

    @property
    def venvs_dir(self) -> str:
        """A venv per locked install; `venv` links to the one in use."""
        return f"{self.venv}.venvs"

    def venv_dir(self, key: str) -> str:
        """The venv of the lock entry `key`."""
        return f"{self.venvs_dir}/{key[:16]}"

    def pip_install_argv(self, venv_dir: str, requirements: str) -> list[str]:
        return wheel_lock.pip_install_argv(venv_dir, self.index_url, requirements)

    @property
    def control_url(self) -> str:
        return f"http://{LOOPBACK}:{self.internal_port}"

    @property
    def spec_hash(self) -> str:
        """Everything the unit runs but the membership, hashed."""
        runs = {k: v for k, v in asdict(self).items() if k != "workers"}
        return hashlib.sha256(json.dumps(runs, sort_keys=True).encode()).hexdigest()[:16]
