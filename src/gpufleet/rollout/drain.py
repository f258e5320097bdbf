"""Drain: before a host restarts, wait up to --drain-timeout until its vLLM runs no request; what still runs then
is left to vLLM's graceful stop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import gevent

from gpufleet.health.api import get
from gpufleet.remote.transport import LOOPBACK, Transport
from gpufleet.wire.metrics import RUNNING, parse_metrics

POLL_S = 0.5
REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Drained:
    drained: bool
    waited_s: float
    running: int | None  # at the last look

    @property
    def detail(self) -> str:
        if self.drained:
            return f"drained in {self.waited_s:.1f} s"
        return f"{self.running} request(s) still running after {self.waited_s:.0f} s (left to vLLM's shutdown)"


def running_requests(transport: Transport, port: int, address: str = LOOPBACK) -> int | None:
    """None when /metrics does not answer with it: a server down or starting runs nothing a restart could cut."""
    try:
        status, body = get(transport, port, "/metrics", timeout=REQUEST_TIMEOUT_S, address=address)
        value = parse_metrics(body).get(RUNNING) if status == 200 else None
    except Exception:  # nothing to wait for, never a crash of the rollout
        return None
    return None if value is None else int(value)


def drain(
    transport: Transport,
    port: int,
    timeout_s: float,
    poll_s: float = POLL_S,
    on_wait: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    address: str = LOOPBACK,
) -> Drained:
    start = clock()
    while True:
        running = running_requests(transport, port, address)
        waited = clock() - start
        if not running:
            return Drained(True, waited, running)
        if waited >= timeout_s:
            return Drained(False, waited, running)
        if on_wait is not None:
            on_wait(running)
        gevent.sleep(poll_s)
