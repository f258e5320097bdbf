"""Waiting on readiness, for the deploy's ready wait and soak, `verify --wait` and `status`.

`exited` gives the service manager's reason when the --rm container is gone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpufleet.health.api import DEFAULT_TIMEOUT_S
from gpufleet.health.check import DEFAULT_GRACE_S, UNREADABLE, HealthReport, HealthState, check
from gpufleet.remote.transport import Transport, TransportError
from gpufleet.wire.identity import Expected

POLL_S = 2.0
FINAL_STATES = (HealthState.READY, HealthState.DEAD, HealthState.MISCONFIGURED)

CheckOnce = Callable[[], HealthReport]
EXIT_SETTLE_S = 10.0
Exited = Callable[[], "str | None"]


def transient(report: HealthReport) -> bool:
    """A look that says nothing about the server: SSH failed, or docker could not be asked."""
    return report.state is HealthState.SSH_UNREACHABLE or (
        report.state is HealthState.CONTAINER_NOT_RUNNING and report.detail.startswith(UNREADABLE)
    )


def dead_if_exited(report: HealthReport, exited: Exited | None) -> HealthReport:
    """Dead, with the service manager's reason, when `docker run` exited."""
    if report.state is HealthState.CONTAINER_NOT_RUNNING and exited is not None:
        why = exited()
        if why:
            return replace(report, state=HealthState.DEAD, detail=why)
    return report


def _settle(
    report: HealthReport,
    check_once: CheckOnce,
    exited: Exited | None,
    clock: Callable[[], float],
    sleep: Callable[[float], Any],
) -> HealthReport:
    """Look again for up to EXIT_SETTLE_S, so a server that stopped answering is dead with its exit reason."""
    deadline = clock() + EXIT_SETTLE_S
    while report.state in (HealthState.STARTING, HealthState.CONTAINER_NOT_RUNNING) and clock() < deadline:
        sleep(1.0)
        if report.state is HealthState.STARTING:
            look = dead_if_exited(check_once(), exited)
            report = report if transient(look) else look
        else:
            report = dead_if_exited(report, exited)
    if report.state is HealthState.STARTING:
        return replace(report, state=HealthState.DEAD, detail=f"stopped answering: {report.detail}")
    return report


def poll_ready(
    check_once: CheckOnce,
    timeout_s: float,
    poll_s: float = POLL_S,
    exited: Exited | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Any] = time.sleep,
) -> HealthReport:
    """Poll until ready; return early on a state that waiting cannot change."""
    deadline = clock() + timeout_s
    while True:
        report = dead_if_exited(check_once(), exited)
        if report.state in FINAL_STATES:
            return report
        if clock() + poll_s > deadline:
            return replace(report, detail=f"{report.detail} (gave up after {timeout_s:.0f} s)")
        sleep(poll_s)


def soak(
    check_once: CheckOnce,
    ready: HealthReport,
    soak_s: float,
    poll_s: float = POLL_S,
    exited: Exited | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Any] = time.sleep,
) -> HealthReport:
    """Keep checking a just-ready service for soak_s, so an engine that dies after its first /health 200 fails
    the deploy, not the first client."""
    start = clock()
    report = ready
    while clock() - start < soak_s:
        sleep(min(poll_s, max(0.0, soak_s - (clock() - start))))
        report = dead_if_exited(check_once(), exited)
        if not transient(report):
            report = _settle(report, check_once, exited, clock, sleep)
        if not report.ready and not transient(report):
            return replace(report, detail=f"{report.detail} ({clock() - start:.0f} s after it was ready)")
    return report


def wait_until_ready(
    transport: Transport,
    expected: Expected,
    *,
    timeout_s: float,
    poll_s: float = POLL_S,
    grace_s: float = DEFAULT_GRACE_S,
    api_key: str | None = None,
    request_timeout_s: float = DEFAULT_TIMEOUT_S,
    exited: Exited | None = None,
) -> HealthReport:
    """Poll check() until ready; a report that is not ready carries the container's last 30 log lines."""

    def check_once() -> HealthReport:
        return check(transport, expected, grace_s=grace_s, api_key=api_key, timeout_s=request_timeout_s)

    report = poll_ready(check_once, timeout_s, poll_s, exited)
    if report.ready or report.state is HealthState.SSH_UNREACHABLE:
        return report
    try:
        logs = tuple(transport.logs(expected.service, tail=30))
    except TransportError:
        logs = ()
    return replace(report, logs=logs)
