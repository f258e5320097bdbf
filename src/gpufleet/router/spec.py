"""RouterSpec: everything a router host runs, frozen; the only place its argv and its install argv are built."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from gpufleet.spec import LOOPBACK

PACKAGE = "vllm-router"
# vllm-router listens on the LOOPBACK only, its Prometheus exporter too: its worker management API shares its port and
# has no authentication, so nothing but the router host itself (nginx in front, gpufleet's calls over SSH) may reach it.


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
    workers: tuple[str, ...]  # http://<address>:<port> of each replica, in inventory order
    health_check_interval_s: int
    worker_startup_timeout_s: int
    internal_port: int = 28000  # vllm-router's own listener, on the loopback

    def argv(self) -> list[str]:
        """The router's command line (no secret: clients' Authorization headers pass through to vLLM)."""
        argv = [
            f"{self.venv}/bin/vllm-router",
            "--host", LOOPBACK,
            "--port", str(self.internal_port),
            "--policy", self.policy,
            "--prometheus-host", LOOPBACK,
            "--prometheus-port", str(self.metrics_port),
            "--health-check-interval-secs", str(self.health_check_interval_s),
            "--worker-startup-timeout-secs", str(self.worker_startup_timeout_s),
        ]
        if self.workers:
            argv += ["--worker-urls", *self.workers]
        return argv

    def pip_install_argv(self) -> list[str]:
        """Install exactly `version` from `index_url` into the venv; a plain-HTTP lab mirror is trusted by name
        (pip ignores http:// indexes otherwise)."""
        argv = [f"{self.venv}/bin/pip", "install", "--disable-pip-version-check", "--no-input", "--quiet",
                "--index-url", self.index_url]
        url = urlsplit(self.index_url)
        if url.scheme == "http" and url.hostname:
            argv += ["--trusted-host", url.hostname]
        return [*argv, f"{PACKAGE}=={self.version}"]

    @property
    def control_url(self) -> str:
        """Where the router host itself reaches the router (its worker management API, readiness): its loopback
        listener, which nothing off the host reaches."""
        return f"http://{LOOPBACK}:{self.internal_port}"

    @property
    def spec_hash(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]
