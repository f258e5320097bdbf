"""Check a whole fleet in parallel: one SSH connection per host (threads), then check() and optionally probe()."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import paramiko

from gpufleet.health.api import excerpt
from gpufleet.health.check import DETAIL_CHARS, Expected, HealthReport, HealthState, check, wait_until_ready
from gpufleet.health.probe import ProbeReport, probe
from gpufleet.health.transport import SshTransport, Transport

SSH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HostTarget:
    """A host to check: how to reach it and what it should serve."""

    name: str
    ssh: Mapping[str, Any]  # ssh_hostname, ssh_user, ssh_key, ssh_port, ssh_password (pyinfra's host data keys)
    expected: Expected
    gpus: tuple[int, ...] = ()
    max_num_batched_tokens: int | None = None  # as configured; evidence for the probe
    api_key: str | None = field(default=None, repr=False)  # the server's --api-key (vllm_api_key)


@dataclass(frozen=True)
class HostResult:
    target: HostTarget
    health: HealthReport
    probe: ProbeReport | None = None
    probe_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.health.ready and (self.probe is None or self.probe.ok) and self.probe_error is None


def connect(name: str, ssh: Mapping[str, Any]) -> paramiko.SSHClient:
    """Open SSH like pyinfra would for this host data. Unknown host keys are accepted (pyinfra's accept-new);
    a known host presenting a different key is still refused by paramiko."""
    client = paramiko.SSHClient()
    client.load_system_host_keys()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(
        hostname=ssh.get("ssh_hostname") or name,
        port=int(ssh.get("ssh_port") or 22),
        username=ssh.get("ssh_user"),
        key_filename=ssh.get("ssh_key"),
        password=ssh.get("ssh_password"),
        timeout=SSH_TIMEOUT_S,
        banner_timeout=SSH_TIMEOUT_S,
        auth_timeout=SSH_TIMEOUT_S,
    )
    return client


def check_host(
    target: HostTarget,
    run_probe: bool = False,
    wait_s: float = 0.0,
    api_key: str | None = None,
    transport: Transport | None = None,
) -> HostResult:
    """Health (and the probe, when the host is ready) of one host. Never raises: whatever goes wrong with this
    host (SSH, its server, a case nobody foresaw) is this host's result, so one host never sinks the others.

    api_key overrides the target's own key."""
    try:
        return _check_host(target, run_probe, wait_s, api_key or target.api_key, transport)
    except Exception as e:
        detail = excerpt(f"the check failed: {type(e).__name__}: {e}", DETAIL_CHARS)
        return HostResult(target, HealthReport(HealthState.DEAD, detail, host=target.name))


def _check_host(
    target: HostTarget, run_probe: bool, wait_s: float, api_key: str | None, transport: Transport | None
) -> HostResult:
    client = None
    if transport is None:
        try:
            client = connect(target.name, target.ssh)
        except Exception as e:  # paramiko raises more than its own and OSError (bad key files, odd host data)
            where = target.ssh.get("ssh_hostname") or target.name
            detail = excerpt(f"cannot SSH to {where}: {e or type(e).__name__}", DETAIL_CHARS)
            return HostResult(target, HealthReport(HealthState.SSH_UNREACHABLE, detail, host=target.name))
        transport = SshTransport(client, name=target.name)
    try:
        if wait_s > 0:
            health = wait_until_ready(transport, target.expected, timeout_s=wait_s, api_key=api_key)
        else:
            health = check(transport, target.expected, api_key=api_key)
        report, error = None, None
        if run_probe and health.ready:
            try:
                report = probe(transport, target.expected, max_num_batched_tokens=target.max_num_batched_tokens, api_key=api_key)
            except Exception as e:  # a probe failure is a finding about this host, not a crash of the fleet run
                error = excerpt(f"{type(e).__name__}: {e}", DETAIL_CHARS)
        return HostResult(target, health, report, error)
    finally:
        if client is not None:
            client.close()


def check_fleet(
    targets: Sequence[HostTarget], run_probe: bool = False, wait_s: float = 0.0, api_key: str | None = None
) -> list[HostResult]:
    """All hosts in parallel (network-bound), results in inventory order, one per host whatever happens."""
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return list(pool.map(lambda t: check_host(t, run_probe, wait_s, api_key), targets))
