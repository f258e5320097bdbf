"""Take a replica out of a router's worker set and put it back: what a rollout does around each swap.

Through the router's own worker API (vllm-router has one): /remove_worker stops new requests going there at
once, while requests already proxied there finish on their open connections; leave() then waits until the
router has none in flight there. /add_worker re-adds it once it answers /health (call join() after the replica
verified ready). Clients of the router see no error: measured in tests/integration/test_router.py. The rollout
uses them through gpufleet.rollout.routers (every router, a failed rejoin recorded per host).
"""

from __future__ import annotations

import time

from gpufleet.router.api import Router, RouterError

POLL_S = 0.5


def in_flight(router: Router, url: str) -> int:
    """Requests the router has in flight to `url` now (0 when its metrics do not name it)."""
    return int(sum(value for name, labels, value in router.metrics()
                   if name == "vllm_router_running_requests" and labels.get("worker") == url))


def leave(router: Router, url: str, drain_timeout_s: float = 60.0) -> float:
    """Remove `url` from the router's workers and wait for its in-flight requests to finish; returns the seconds
    the drain took. Raises RouterError when the router refuses, or requests are still in flight at the deadline."""
    router.remove_worker(url)
    if url in router.list_workers():
        raise RouterError(f"{router.name}: {url} is still in its worker set after /remove_worker")
    start = time.monotonic()
    while (left := in_flight(router, url)) > 0:
        if time.monotonic() - start > drain_timeout_s:
            raise RouterError(f"{router.name}: {left} request(s) still in flight to {url} after {drain_timeout_s:g} s")
        time.sleep(POLL_S)
    return time.monotonic() - start


def join(router: Router, url: str, timeout_s: float = 120.0) -> None:
    """Put `url` back (the router waits for its /health); a no-op when it is in the set already."""
    if url in router.list_workers():
        return
    router.add_worker(url, timeout_s + 10)
    if url not in router.list_workers():
        raise RouterError(f"{router.name}: {url} is not in its worker set after /add_worker")
