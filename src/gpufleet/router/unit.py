"""The router's systemd unit."""

from __future__ import annotations

from gpufleet.quoting import systemd_exec, systemd_text
from gpufleet.router.spec import RouterSpec


def unit_path(service: str) -> str:
    return f"/etc/systemd/system/{service}.service"


def render_unit(spec: RouterSpec) -> str:
    workers = len(spec.workers)
    return f"""# Managed by gpufleet ({systemd_text(spec.host)}): changes here are overwritten by the next deploy.
# Spec {spec.spec_hash}; vllm-router {systemd_text(spec.version)} from {systemd_text(spec.index_url)}.
[Unit]
Description=vLLM router {systemd_text(spec.service)} ({spec.policy}, port {spec.port}, {workers} workers)
Documentation=https://github.com/vllm-project/router
After=network-online.target
Wants=network-online.target
StartLimitIntervalSec=0

[Service]
Type=simple
# No secret here: clients' Authorization headers pass through the router to vLLM, which checks them.
ExecStart={systemd_exec(spec.argv())}
Restart=on-failure
RestartSec=5s
# The router waits for every listed worker to answer /health before it listens (--worker-startup-timeout-secs).
TimeoutStartSec={spec.worker_startup_timeout_s + 30}
TimeoutStopSec=30

[Install]
WantedBy=multi-user.target
"""
