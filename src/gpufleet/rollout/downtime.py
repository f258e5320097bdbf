"""A host's downtime during its swap: the time its /health, polled from the controller, did not answer 200."""

from __future__ import annotations

import time
from collections.abc import Callable

import gevent

from gpufleet.health.api import get
from gpufleet.remote.transport import LOOPBACK, Transport

POLL_S = 0.25
REQUEST_TIMEOUT_S = 2.0


def healthy(transport: Transport, port: int, address: str = LOOPBACK) -> bool:
    try:
        return get(transport, port, "/health", timeout=REQUEST_TIMEOUT_S, address=address)[0] == 200
    except Exception:  # any failure is "not serving" here
        return False


class DowntimeWatch:
    """Poll /health from start() to stop(); stop() gives the seconds it was not 200 (None: no look made)."""

    def __init__(
        self,
        transport: Transport,
        port: int,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
        address: str = LOOPBACK,
    ):
        self.transport, self.port, self.poll_s, self.clock = transport, port, poll_s, clock
        self.address = address
        self.down_s = 0.0
        self.looks = 0
        self._down_since: float | None = None
        self._greenlet: gevent.Greenlet[[], None] | None = None

    def _look(self) -> None:
        up = healthy(self.transport, self.port, self.address)
        now = self.clock()
        self.looks += 1
        if not up and self._down_since is None:
            self._down_since = now
        elif up and self._down_since is not None:
            self.down_s += now - self._down_since
            self._down_since = None

    def _loop(self) -> None:
        while True:
            self._look()
            gevent.sleep(self.poll_s)

    def start(self) -> DowntimeWatch:
        self._greenlet = gevent.spawn(self._loop)
        return self

    def stop(self) -> float | None:
        if self._greenlet is not None:
            self._greenlet.kill()
        self._look()  # a host still down counts until now
        if self._down_since is not None:
            self.down_s += self.clock() - self._down_since
            self._down_since = None
        return self.down_s if self.looks > 1 else None
