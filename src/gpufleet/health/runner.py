"""Check a fleet in parallel over the deploy's own SSH stack: health, and as asked the answers, serving checks and
probe. Hosts log in as the deploy does (docs/health.md, Fleets).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import gevent
import gevent.pool

from gpufleet.defaults import DEFAULTS, SPEED_TOLERANCE_SETTING
from gpufleet.facts.gpu_verdict import GpuVerdict, HostGpus
from gpufleet.health import gpu
from gpufleet.health.answers import AnswerCheck, check_answers
from gpufleet.health.check import UNREADABLE, HealthReport, HealthState, check, committed_drift, reached, spec_drift
from gpufleet.health.probe import probe
from gpufleet.health.probe_report import ProbeReport
from gpufleet.health.serving import Served, run_checks
from gpufleet.health.speed import speed_check
from gpufleet.health.wait import wait_until_ready
from gpufleet.remote.ssh import open_ssh
from gpufleet.remote.transport import SshTransport, Transport, Unreachable
from gpufleet.wire.checks import SPEED
from gpufleet.wire.evidence import DETAIL_CHARS, excerpt
from gpufleet.wire.gpu_verdicts import GpuSettings
from gpufleet.wire.identity import Expected, SpecArgs
from gpufleet.wire.speed import SpeedFigures

PARALLEL = 64  # hosts checked at once

# Told (host, what it is doing now), for the CLI's progress.
Phase = Callable[[str, str], None]
# The digest a host's ledger has committed and its recorded speed figures; None when there is none.
CommittedRead = Callable[["HostTarget", Transport], "tuple[str, SpeedFigures | None] | None"]


def _silent(host: str, text: str) -> None:
    pass


@dataclass(frozen=True)
class HostTarget:
    """A host to check: how to reach it and what it should serve."""

    name: str
    ssh: Mapping[str, Any]  # the host's ssh_* data
    expected: Expected
    gpus: tuple[int, ...] = ()
    max_num_batched_tokens: int | None = None  # as configured
    api_key: str | None = field(default=None, repr=False)
    served: Served = field(default_factory=Served)
    speed_tolerance: float = DEFAULTS[SPEED_TOLERANCE_SETTING]
    gpu_settings: GpuSettings = field(default_factory=GpuSettings)
    # (group, rank, head) in a replica group; a rank other than the head serves no API.
    rank: tuple[str, int, str] | None = None

    @property
    def headless(self) -> bool:
        return self.rank is not None and self.rank[1] > 0

    @classmethod
    def for_spec(cls, spec: SpecArgs, data: Mapping[str, Any]) -> HostTarget:
        """What `gpufleet verify` checks on a host."""
        return cls(
            name=spec.host,
            ssh={k: v for k, v in data.items() if k.startswith("ssh_")},
            expected=replace(Expected.from_spec(spec), spec_hash=spec.spec_hash),
            gpus=spec.gpus,
            max_num_batched_tokens=_configured_int(spec, "max-num-batched-tokens"),
            api_key=data.get("vllm_api_key"),
            served=Served.from_spec(spec),
            gpu_settings=GpuSettings.of(data),
        )


def _configured_int(spec: SpecArgs, flag: str) -> int | None:
    # The server does not expose --max-num-batched-tokens.
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
    answers: tuple[AnswerCheck, ...] = ()
    checks: tuple[AnswerCheck, ...] = ()  # serving checks
    speed: SpeedFigures | None = None
    speed_earlier: SpeedFigures | None = None  # what it was held to
    gpus: HostGpus | None = None
    committed_ref: str | None = None

    @property
    def committed_drift(self) -> str | None:
        return committed_drift(self.committed_ref, self.health.container)

    @property
    def ok(self) -> bool:
        return (
            self.health.ready
            and (self.probe is None or self.probe.ok)
            and self.probe_error is None
            and all(a.ok for a in (*self.answers, *self.checks))
            and not self.sick_gpus
            and self.committed_drift is None
        )

    @property
    def sick_gpus(self) -> list[GpuVerdict]:
        """The GPUs the service runs on that need a reset, a reboot or service."""
        return self.gpus.blocking(self.target.gpus) if self.gpus is not None else []


def check_host(
    target: HostTarget,
    *,
    run_probe: bool = False,
    wait_s: float = 0.0,
    api_key: str | None = None,
    transport: Transport | None = None,
    answer: bool = False,
    checks: Sequence[str] = (),
    progress: Phase = _silent,
    committed: CommittedRead | None = None,
) -> HostResult:
    """One host's health and, once it is ready, the checks asked for. Never raises, so one host never sinks the
    others. Without a transport, the host is reached from target.ssh."""
    asked = _Asked(run_probe, wait_s, api_key, answer, tuple(checks), progress, committed)
    try:
        result = _check_host(target, transport, asked) if transport is not None else _check_over_ssh(target, asked)
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
    committed: CommittedRead | None = None


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
        return _check_rank(target, transport, asked)
    api_key, say = asked.api_key or target.api_key, partial(asked.progress, target.name)
    if asked.wait_s > 0:
        say(f"waiting for it to be ready (up to {asked.wait_s:.0f} s)")
        health = wait_until_ready(transport, target.expected, timeout_s=asked.wait_s, api_key=api_key)
    else:
        say("checking")
        health = check(transport, target.expected, api_key=api_key)
    expected = reached(target.expected, health.container)
    gpus = _read_gpus(target, transport, health, say)
    answers: tuple[AnswerCheck, ...] = ()
    if asked.answer and health.ready:
        say("sending a chat completion, plain and streamed")
        answers = check_answers(transport, expected, api_key=api_key)
    checks: tuple[AnswerCheck, ...] = ()
    committed = asked.committed(target, transport) if asked.committed and health.container else None
    figures, earlier = None, None
    if SPEED in asked.checks and health.ready and all(a.ok for a in answers):
        say("measuring its speed (under a minute)")
        # Held only to the figures recorded for the digest that runs.
        running = health.container.image if health.container else None
        earlier = committed[1] if committed and committed[0] == running else None
        speed, figures = speed_check(
            transport, expected, target.served, earlier, target.speed_tolerance, api_key=api_key
        )
        checks = (speed,)
    rest = [name for name in asked.checks if name != SPEED]
    if rest and health.ready and all(c.ok for c in (*answers, *checks)):
        say(f"serving checks: {', '.join(rest)}")
        checks += run_checks(transport, expected, target.served, rest, api_key=api_key)
    report, error = None, None
    if asked.run_probe and health.ready:
        say("probing prompt re-processing (up to a few minutes)")
        try:
            report = probe(transport, expected, max_num_batched_tokens=target.max_num_batched_tokens, api_key=api_key)
        except Exception as e:  # a finding about this host
            error = excerpt(f"{type(e).__name__}: {e}", DETAIL_CHARS)
    return HostResult(
        target,
        health,
        report,
        error,
        answers,
        checks,
        speed=figures,
        speed_earlier=earlier,
        gpus=gpus,
        committed_ref=committed[0] if committed else None,
    )


def _check_rank(target: HostTarget, transport: Transport, asked: _Asked) -> HostResult:
    """A headless rank: its container, its GPUs and its committed digest."""
    say = partial(asked.progress, target.name)
    say("reading its container")
    assert target.rank is not None
    health = rank_health(transport, target.expected, target.name, target.rank)
    gpus = _read_gpus(target, transport, health, say)
    committed = asked.committed(target, transport) if asked.committed and health.container else None
    return HostResult(target, health, gpus=gpus, committed_ref=committed[0] if committed else None)


def _read_gpus(
    target: HostTarget, transport: Transport, health: HealthReport, say: Callable[[str], None]
) -> HostGpus | None:
    if not isinstance(transport, SshTransport):
        return None
    say("reading the GPUs' health")
    return gpu.judged(transport, target.gpu_settings, health.container.started_at if health.container else None)


def rank_health(transport: Transport, expected: Expected, name: str, rank: tuple[str, int, str]) -> HealthReport:
    """A headless rank's state: its labelled container running the expected spec."""
    group, number, head = rank
    try:
        container = transport.container(expected.service)
    except Exception as e:  # one state for anything, as check()
        return HealthReport(
            HealthState.DEAD, excerpt(f"{UNREADABLE}: {type(e).__name__}: {e}", DETAIL_CHARS), host=name
        )
    if container is None or not container.running:
        return HealthReport(
            HealthState.CONTAINER_NOT_RUNNING,
            f"rank {number} of group {group}: no running container carries the service's label",
            host=name,
            container=container,
        )
    drift = spec_drift(expected, container)
    state, detail = (
        (HealthState.MISCONFIGURED, drift)
        if drift
        else (HealthState.READY, f"rank {number} of group {group}: its container runs; the group serves through {head}")
    )
    return HealthReport(state, detail, host=name, container=container)


def check_fleet(
    targets: Sequence[HostTarget],
    *,
    run_probe: bool = False,
    wait_s: float = 0.0,
    api_key: str | None = None,
    answer: bool = False,
    checks: Sequence[str] = (),
    progress: Phase = _silent,
    committed: CommittedRead | None = None,
) -> list[HostResult]:
    """All hosts in parallel, one result per host in inventory order."""
    if not targets:
        return []
    pool = gevent.pool.Pool(min(len(targets), PARALLEL))
    jobs = [
        pool.spawn(
            check_host,
            t,
            run_probe=run_probe,
            wait_s=wait_s,
            api_key=api_key,
            answer=answer,
            checks=checks,
            progress=progress,
            committed=committed,
        )
        for t in targets
    ]
    gevent.joinall(jobs)
    return [job.get() for job in jobs]
