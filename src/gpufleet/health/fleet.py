"""Check a whole fleet in parallel over the deploy's own SSH stack, then check() each host and, as asked, send it a
client's requests (answers) and probe() it.

Hosts are connected by pyinfra's SSH connector from their inventory data, so `status` and `verify` log in exactly
as the deploy does: ssh_hostname, ssh_port, ssh_user, ssh_key (and its password), ~/.ssh/config or ssh_config_file,
ssh_known_hosts_file and ssh_strict_host_key_checking (pyinfra's default "accept-new"; "yes" refuses a host whose
key is not known). Hosts are checked at once, each in a greenlet, as a pyinfra deploy connects them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import gevent
import gevent.pool
import paramiko
from pyinfra.api import Config, Inventory, State
from pyinfra.api.host import Host

# pyinfra's connector is gevent code: hosts connect in parallel only over gevent's sockets, so pyinfra_cli's
# monkey.patch_all() (run by gpufleet.inventory) must precede any thread.
import gpufleet.inventory  # noqa: F401
from gpufleet.health.answers import AnswerCheck, check_answers
from gpufleet.health.api import excerpt
from gpufleet.health.check import DETAIL_CHARS, Expected, HealthReport, HealthState, check
from gpufleet.health.probe import ProbeReport, probe
from gpufleet.health.transport import SshTransport, Transport, Unreachable, transport_from_pyinfra_host
from gpufleet.health.wait import wait_until_ready
from gpufleet.spec import ServeSpec

SSH_TIMEOUT_S = 10.0  # per connection attempt: TCP connect, banner, key exchange and login together
PARALLEL = 64  # hosts checked at once (each holds a socket, a greenlet and paramiko's reader)


@dataclass(frozen=True)
class HostTarget:
    """A host to check: how to reach it and what it should serve."""

    name: str
    ssh: Mapping[str, Any]  # the host's ssh_* data, as pyinfra's inventory loader merged it
    expected: Expected
    gpus: tuple[int, ...] = ()
    max_num_batched_tokens: int | None = None  # as configured; evidence for the probe
    api_key: str | None = field(default=None, repr=False)  # the server's --api-key (vllm_api_key)

    @classmethod
    def for_spec(cls, spec: ServeSpec, data: Mapping[str, Any]) -> HostTarget:
        """What `gpufleet verify` checks on a host: its spec (drift included), reached with its ssh_* data."""
        return cls(
            name=spec.host,
            ssh={k: v for k, v in data.items() if k.startswith("ssh_")},
            expected=replace(Expected.from_spec(spec), spec_hash=spec.spec_hash),
            gpus=spec.gpus,
            max_num_batched_tokens=_configured_int(spec, "max-num-batched-tokens"),
            api_key=data.get("vllm_api_key"),
        )


def _configured_int(spec: ServeSpec, flag: str) -> int | None:
    # The server does not expose --max-num-batched-tokens; the probe cites the configured value as evidence.
    value = spec.arg(flag)
    try:
        return int(str(value).replace("_", "")) if value not in (None, True, False) else None
    except ValueError:
        return None


@dataclass(frozen=True)
class HostResult:
    target: HostTarget
    health: HealthReport
    probe: ProbeReport | None = None
    probe_error: str | None = None
    answers: tuple[AnswerCheck, ...] = ()  # gpufleet.health.answers, when asked for and the host was ready

    @property
    def ok(self) -> bool:
        return (self.health.ready and (self.probe is None or self.probe.ok) and self.probe_error is None
                and all(a.ok for a in self.answers))


def pyinfra_host(name: str, data: Mapping[str, Any]) -> Host:
    """A pyinfra Host for this host data, in a State of its own: pyinfra checks the connector data (types) here,
    and one host's bad data must not take the others' rows down."""
    inventory = Inventory(([(name, dict(data))], {}))
    State(inventory, Config(CONNECT_TIMEOUT=SSH_TIMEOUT_S))  # initialises the host's connector
    return inventory.get_host(name)


def connect(name: str, data: Mapping[str, Any]) -> paramiko.SSHClient:
    """One host's SSH connection, opened as the deploy opens it (see open_ssh). The caller closes it."""
    return open_ssh(name, data).client


def open_ssh(name: str, data: Mapping[str, Any]) -> SshTransport:
    """A transport over the host's SSH connection, opened by pyinfra's connector from its host data; the caller
    closes its client. Raises Unreachable with one line saying why, within SSH_TIMEOUT_S per attempt (the
    connector's ssh_connect_retries are honoured)."""
    try:
        host = pyinfra_host(name, data)
    except Exception as e:  # host data the connector refuses (an ssh_port that is not a number)
        raise Unreachable(_unreachable_line(name, data, e)) from e
    attempts = 1 + int(host.data.get("ssh_connect_retries") or 0)
    try:
        # pyinfra bounds the TCP connect only: a host that accepts and then stalls (banner, login) is cut here.
        try:
            with gevent.Timeout(SSH_TIMEOUT_S * attempts):
                host.connect(show_errors=False, raise_exceptions=True)
        except gevent.Timeout:
            pass  # not connected: reported just below
        if not host.connected:
            raise Unreachable(f"no SSH session within {SSH_TIMEOUT_S * attempts:g} s")
        return transport_from_pyinfra_host(host)
    except Exception as e:  # the connector raises more than ConnectError (key files, odd host data)
        client = getattr(host.connector, "client", None)
        if client is not None:  # a half-open session (timed out, refused key) holds a socket and a thread
            client.close()
        raise Unreachable(_unreachable_line(name, data, e)) from e


def _unreachable_line(name: str, data: Mapping[str, Any], e: Exception) -> str:
    port = data.get("ssh_port")
    where = f"{data.get('ssh_hostname') or name}" + (f":{port}" if port else "")
    why = str(e) or type(e).__name__
    line = f"cannot SSH to {where}: {why}"
    if "No host key for" in why:  # pyinfra's StrictPolicy: strict checking on, key not in known_hosts
        known = data.get("ssh_known_hosts_file") or "~/.ssh/known_hosts"
        line += f" (fix: add the host's key to {known}, e.g. with ssh-keyscan, or set ssh_strict_host_key_checking)"
    return excerpt(line, DETAIL_CHARS)


def check_host(
    target: HostTarget,
    run_probe: bool = False,
    wait_s: float = 0.0,
    api_key: str | None = None,
    transport: Transport | None = None,
    answer: bool = False,
) -> HostResult:
    """Health (and, when the host is ready, the answer checks and the probe, as asked) of one host. Never raises:
    whatever goes wrong with this host (SSH, its server, a case nobody foresaw) is this host's result, so one host
    never sinks the others.

    Without a transport the host is connected by pyinfra's connector from target.ssh. api_key overrides the
    target's own key."""
    try:
        if transport is not None:
            return _check_host(target, transport, run_probe, wait_s, api_key, answer)
        return _check_over_ssh(target, run_probe, wait_s, api_key, answer)
    except Exception as e:
        return _failed(target, e)


def _check_over_ssh(target: HostTarget, run_probe: bool, wait_s: float, api_key: str | None,
                    answer: bool) -> HostResult:  # fmt: skip
    try:
        transport = open_ssh(target.name, target.ssh)
    except Unreachable as e:
        return HostResult(target, HealthReport(HealthState.SSH_UNREACHABLE, str(e), host=target.name))
    try:
        return _check_host(target, transport, run_probe, wait_s, api_key, answer)
    finally:
        transport.client.close()


def _failed(target: HostTarget, e: Exception) -> HostResult:
    detail = excerpt(f"the check failed: {type(e).__name__}: {e}", DETAIL_CHARS)
    return HostResult(target, HealthReport(HealthState.DEAD, detail, host=target.name))


def _check_host(target: HostTarget, transport: Transport, run_probe: bool, wait_s: float, api_key: str | None,
                answer: bool = False) -> HostResult:  # fmt: skip
    api_key = api_key or target.api_key
    if wait_s > 0:
        health = wait_until_ready(transport, target.expected, timeout_s=wait_s, api_key=api_key)
    else:
        health = check(transport, target.expected, api_key=api_key)
    answers = check_answers(transport, target.expected, api_key=api_key) if answer and health.ready else ()
    report, error = None, None
    if run_probe and health.ready:
        try:
            report = probe(transport, target.expected, max_num_batched_tokens=target.max_num_batched_tokens, api_key=api_key)
        except Exception as e:  # a probe failure is a finding about this host, not a crash of the fleet run
            error = excerpt(f"{type(e).__name__}: {e}", DETAIL_CHARS)
    return HostResult(target, health, report, error, answers)


def check_fleet(
    targets: Sequence[HostTarget], run_probe: bool = False, wait_s: float = 0.0, api_key: str | None = None,
    answer: bool = False,
) -> list[HostResult]:
    """All hosts in parallel (network-bound), results in inventory order, one per host whatever happens."""
    if not targets:
        return []
    pool = gevent.pool.Pool(min(len(targets), PARALLEL))
    jobs = [pool.spawn(check_host, t, run_probe, wait_s, api_key, None, answer) for t in targets]
    gevent.joinall(jobs)
    return [job.get() for job in jobs]
