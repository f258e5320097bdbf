"""Check a whole fleet in parallel over the deploy's own SSH stack, then check() each host and, as asked, send it a
client's requests (answers) and probe() it.

Hosts are connected by pyinfra's SSH connector from their inventory data, so `status` and `verify` log in exactly
as the deploy does: ssh_hostname, ssh_port, ssh_user, ssh_key (and its password), ~/.ssh/config or ssh_config_file,
ssh_known_hosts_file and ssh_strict_host_key_checking (pyinfra's default "accept-new"; "yes" refuses a host whose
key is not known). Hosts are checked at once, each in a greenlet, as a pyinfra deploy connects them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import gevent
import gevent.pool

from gpufleet.health.answers import AnswerCheck, check_answers
from gpufleet.health.check import UNREADABLE, HealthReport, HealthState, check, reached, spec_drift
from gpufleet.health.probe import probe
from gpufleet.health.probe_report import ProbeReport
from gpufleet.health.serving import Served, run_checks
from gpufleet.health.wait import wait_until_ready
from gpufleet.remote.ssh import open_ssh
from gpufleet.remote.transport import Transport, Unreachable
from gpufleet.wire.evidence import DETAIL_CHARS, excerpt
from gpufleet.wire.identity import Expected, SpecArgs

PARALLEL = 64  # hosts checked at once (each holds a socket, a greenlet and paramiko's reader)

# Told (host, what it is doing now) as a host's check moves on: the CLI's progress on stderr.
Phase = Callable[[str, str], None]


def _silent(host: str, text: str) -> None:
    pass


@dataclass(frozen=True)
class HostTarget:
    """A host to check: how to reach it and what it should serve."""

    name: str
    ssh: Mapping[str, Any]  # the host's ssh_* data, as pyinfra's inventory loader merged it
    expected: Expected
    gpus: tuple[int, ...] = ()
    max_num_batched_tokens: int | None = None  # as configured; evidence for the probe
    api_key: str | None = field(default=None, repr=False)  # the server's --api-key (vllm_api_key)
    served: Served = Served()  # its parsers and prefix caching: which serving checks apply
    # A replica group's rank: (group, rank, head). A rank other than the head serves no API: its container is its
    # state, and the group serves through its head.
    rank: tuple[str, int, str] | None = None

    @property
    def headless(self) -> bool:
        return self.rank is not None and self.rank[1] > 0

    @classmethod
    def for_spec(cls, spec: SpecArgs, data: Mapping[str, Any]) -> HostTarget:
        """What `gpufleet verify` checks on a host: its spec (drift included), reached with its ssh_* data."""
        return cls(
            name=spec.host,
            ssh={k: v for k, v in data.items() if k.startswith("ssh_")},
            expected=replace(Expected.from_spec(spec), spec_hash=spec.spec_hash),
            gpus=spec.gpus,
            max_num_batched_tokens=_configured_int(spec, "max-num-batched-tokens"),
            api_key=data.get("vllm_api_key"),
            served=Served.from_spec(spec),
        )


def _configured_int(spec: SpecArgs, flag: str) -> int | None:
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
    checks: tuple[AnswerCheck, ...] = ()  # gpufleet.health.serving, those asked for that apply to the host

    @property
    def ok(self) -> bool:
        return (self.health.ready and (self.probe is None or self.probe.ok) and self.probe_error is None
                and all(a.ok for a in (*self.answers, *self.checks)))


def check_host(
    target: HostTarget,
    run_probe: bool = False,
    wait_s: float = 0.0,
    api_key: str | None = None,
    transport: Transport | None = None,
    answer: bool = False,
    checks: Sequence[str] = (),
    progress: Phase = _silent,
) -> HostResult:
    """Health (and, when the host is ready, the answer checks and the probe, as asked) of one host. Never raises:
    whatever goes wrong with this host (SSH, its server, a case nobody foresaw) is this host's result, so one host
    never sinks the others.

    Without a transport the host is connected by pyinfra's connector from target.ssh. api_key overrides the
    target's own key. checks: serving checks (gpufleet.health.serving) to run once the answers passed. progress is
    told what the check is doing, then how it ended."""
    asked = _Asked(run_probe, wait_s, api_key, answer, tuple(checks), progress)
    try:
        if transport is not None:
            result = _check_host(target, transport, asked)
        else:
            result = _check_over_ssh(target, asked)
    except Exception as e:
        result = _failed(target, e)
    why = "a check failed" if result.health.ready else str(result.health.state)
    progress(target.name, "ok" if result.ok else f"not ok ({why})")
    return result


@dataclass(frozen=True)
class _Asked:
    run_probe: bool
    wait_s: float
    api_key: str | None
    answer: bool
    checks: tuple[str, ...]
    progress: Phase = _silent


def _check_over_ssh(target: HostTarget, asked: _Asked) -> HostResult:
    asked.progress(target.name, "connecting over SSH")
    try:
        transport = open_ssh(target.name, target.ssh)
    except Unreachable as e:
        return HostResult(target, HealthReport(HealthState.SSH_UNREACHABLE, str(e), host=target.name))
    try:
        return _check_host(target, transport, asked)
    finally:
        transport.client.close()


def _failed(target: HostTarget, e: Exception) -> HostResult:
    detail = excerpt(f"the check failed: {type(e).__name__}: {e}", DETAIL_CHARS)
    return HostResult(target, HealthReport(HealthState.DEAD, detail, host=target.name))


def _check_host(target: HostTarget, transport: Transport, asked: _Asked) -> HostResult:
    if target.headless:
        asked.progress(target.name, "reading its container")
        return HostResult(target, rank_health(transport, target))
    api_key, say = asked.api_key or target.api_key, partial(asked.progress, target.name)
    if asked.wait_s > 0:
        say(f"waiting for it to be ready (up to {asked.wait_s:.0f} s)")
        health = wait_until_ready(transport, target.expected, timeout_s=asked.wait_s, api_key=api_key)
    else:
        say("checking")
        health = check(transport, target.expected, api_key=api_key)
    expected = reached(target.expected, health.container)  # the container that answered, not the port's listener
    answers: tuple[AnswerCheck, ...] = ()
    if asked.answer and health.ready:
        say("sending a chat completion, plain and streamed")
        answers = check_answers(transport, expected, api_key=api_key)
    checks: tuple[AnswerCheck, ...] = ()
    if asked.checks and health.ready and all(a.ok for a in answers):
        say(f"serving checks: {', '.join(asked.checks)}")
        checks = run_checks(transport, expected, target.served, asked.checks, api_key=api_key)
    report, error = None, None
    if asked.run_probe and health.ready:
        say("probing prompt re-processing (up to a few minutes)")
        try:
            report = probe(transport, expected, max_num_batched_tokens=target.max_num_batched_tokens, api_key=api_key)
        except Exception as e:  # a probe failure is a finding about this host, not a crash of the fleet run
            error = excerpt(f"{type(e).__name__}: {e}", DETAIL_CHARS)
    return HostResult(target, health, report, error, answers, checks)


def rank_health(transport: Transport, target: HostTarget) -> HealthReport:
    """A headless rank's state: its labelled container running the inventory's spec (it answers no request)."""
    assert target.rank is not None
    group, rank, head = target.rank
    try:
        container = transport.container(target.expected.service)
    except Exception as e:  # one state for anything, as check()
        return HealthReport(HealthState.DEAD, excerpt(f"{UNREADABLE}: {type(e).__name__}: {e}", DETAIL_CHARS),
                            host=target.name)
    if container is None or not container.running:
        return HealthReport(HealthState.CONTAINER_NOT_RUNNING, f"rank {rank} of group {group}: no running container "
                            "carries the service's label", host=target.name, container=container)
    drift = spec_drift(target.expected, container)
    state, detail = (HealthState.MISCONFIGURED, drift) if drift else (
        HealthState.READY, f"rank {rank} of group {group}: its container runs; the group serves through {head}")
    return HealthReport(state, detail, host=target.name, container=container)


def check_fleet(
    targets: Sequence[HostTarget], run_probe: bool = False, wait_s: float = 0.0, api_key: str | None = None,
    answer: bool = False, checks: Sequence[str] = (), progress: Phase = _silent,
) -> list[HostResult]:
    """All hosts in parallel (network-bound), results in inventory order, one per host whatever happens."""
    if not targets:
        return []
    pool = gevent.pool.Pool(min(len(targets), PARALLEL))
    jobs = [pool.spawn(check_host, t, run_probe, wait_s, api_key, None, answer, checks, progress) for t in targets]
    gevent.joinall(jobs)
    return [job.get() for job in jobs]
