"""RouterSpec: everything a router host runs, frozen; the only place its argv and its install argv are built."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from gpufleet.names import LOOPBACK

PACKAGE = "vllm-router"
# The router's worker set, one URL per line, kept by the deploy and the rollouts in step with the live set, and
# replayed by the unit after every (re)start: membership is not in the unit, so a replica's readiness never rewrites
# or restarts it. Readable by the router's own (dynamic) user.
MEMBERS_DIR = "/var/lib/gpufleet-router"


# In each locked venv, written once its install succeeded: the lock key (sha256 of the requirements) it holds.
MARKER = "gpufleet-lock.sha256"


def members_path(service: str) -> str:
    return f"{MEMBERS_DIR}/{service}.workers"


# vllm-router's unauthenticated worker API shares its loopback port, which every local user reaches: an nftables
# rule lets only root and nginx's workers (www-data) connect to it.
NFT = "/usr/sbin/nft"
FENCE_USERS = ("root", "www-data")


# Policies that keep a session on one replica by its X-Session-ID: the front door derives one for requests without.
SESSION_POLICIES = ("sticky_least_loaded", "consistent_hash")


def fence_table(internal_port: int) -> str:
    """The nftables table (family inet) that fences the router listening on `internal_port`."""
    return f"gpufleet-router-{int(internal_port)}"


@dataclass(frozen=True)
class RouterSpec:
    host: str
    service: str  # systemd unit name without .service
    venv: str  # absolute path of the router's own virtualenv
    version: str  # vllm-router version installed (pinned: a re-run never moves it)
    index_url: str  # PEP 503 index pip installs from (PyPI or a lab mirror)
    address: str  # where clients reach the router (nginx listens there)
    port: int
    metrics_port: int
    policy: str
    workers: tuple[str, ...]  # http://<address>:<port> of each replica that verified ready, in inventory order:
    # its membership, kept through the router's API and members_file, never in its argv or unit
    health_check_interval_s: int
    worker_startup_timeout_s: int
    internal_port: int = 28000  # vllm-router's own listener, on the loopback

    def argv(self) -> list[str]:
        """The router's command line (no secret: clients' Authorization headers pass through to vLLM). No worker:
        vllm-router then listens at once, and its members are added through its API (rejoin_argv)."""
        return [
            f"{self.venv}/bin/vllm-router",
            "--host", LOOPBACK,
            "--port", str(self.internal_port),
            "--policy", self.policy,
            "--prometheus-host", LOOPBACK,
            "--prometheus-port", str(self.metrics_port),
            "--health-check-interval-secs", str(self.health_check_interval_s),
            "--worker-startup-timeout-secs", str(self.worker_startup_timeout_s),
        ]

    def fence_argv(self) -> list[str]:
        """Load the fence in one nftables transaction that replaces its table: a connection to the router's port
        from a socket of any user but FENCE_USERS gets a reset."""
        table = f"inet {fence_table(self.internal_port)}"
        rule = (f'oifname "lo" tcp dport {self.internal_port} meta skuid != {{ {", ".join(FENCE_USERS)} }} '
                "reject with tcp reset")
        return [NFT, f"table {table}; delete table {table}; table {table} {{ chain output {{ type filter hook "
                     f"output priority 0; policy accept; {rule}; }}; }}"]

    def rejoin_argv(self) -> list[str]:
        """Run after each (re)start: once the router listens, every worker in members_file is added back, each in
        the background (/add_worker waits until that worker answers /health), so the start never waits on one."""
        add = (f"curl -fsS -o /dev/null -G -X POST --max-time {self.worker_startup_timeout_s + 10} "
               f"--data-urlencode \"url=$u\" {self.control_url}/add_worker")
        script = (f"i=0; until curl -fs -o /dev/null --max-time 2 {self.control_url}/liveness; do i=$((i+1)); "
                  f"[ $i -lt 60 ] || exit 0; sleep 0.5; done; "
                  f"[ -r {self.members_file} ] || exit 0; "
                  f"while read -r u; do [ -n \"$u\" ] && {{ {add} & }}; done < {self.members_file}; exit 0")
        return ["/bin/sh", "-c", script]

    @property
    def keys_sessions(self) -> bool:
        return self.policy in SESSION_POLICIES

    @property
    def members_file(self) -> str:
        return members_path(self.service)

    def members_text(self) -> str:
        """members_file's content for this spec's workers."""
        return "".join(f"{url}\n" for url in self.workers)

    @property
    def venvs_dir(self) -> str:
        """Where each locked install gets a venv of its own; `venv` is a symlink to the one in use."""
        return f"{self.venv}.venvs"

    def venv_dir(self, key: str) -> str:
        """The venv of the lock entry whose requirements hash to `key` (gpufleet.router.wheels.LockedInstall.key)."""
        return f"{self.venvs_dir}/{key[:16]}"

    def pip_install_argv(self, venv_dir: str, requirements: str) -> list[str]:
        """Install exactly the lock's wheels into venv_dir from `index_url`: every one pinned by sha256
        (--require-hashes), wheels only, nothing the requirements do not name (--no-deps). A plain-HTTP lab mirror
        is trusted by name (pip ignores http:// indexes otherwise): the hashes, not the transport, vouch for it."""
        argv = [f"{venv_dir}/bin/pip", "install", "--disable-pip-version-check", "--no-input", "--quiet",
                "--require-hashes", "--only-binary", ":all:", "--no-deps", "--index-url", self.index_url]
        url = urlsplit(self.index_url)
        if url.scheme == "http" and url.hostname:
            argv += ["--trusted-host", url.hostname]
        return [*argv, "-r", requirements]

    @property
    def control_url(self) -> str:
        """Where the router host itself reaches the router (its worker management API, readiness): its loopback
        listener, which nothing off the host reaches."""
        return f"http://{LOOPBACK}:{self.internal_port}"

    @property
    def spec_hash(self) -> str:
        """What the unit runs, hashed: everything but the membership (which never restarts the router)."""
        runs = {k: v for k, v in asdict(self).items() if k != "workers"}
        return hashlib.sha256(json.dumps(runs, sort_keys=True).encode()).hexdigest()[:16]
