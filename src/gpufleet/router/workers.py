"""Take a replica out of a router's worker set and put it back: what a rollout does around each swap.

Through the router's own worker API (vllm-router has one): /remove_worker stops new requests going there at
once, while requests already proxied there finish on their open connections; leave() then waits until the
router has none in flight there. /add_worker re-adds it once it answers /health (call join() after the replica
verified ready). Clients of the router see no error: measured in tests/integration/test_router.py. The rollout
uses them through gpufleet.rollout.routers (every router, a failed rejoin recorded per host).
"""

from __future__ import annotations

import posixpath
import shlex
import time

from gpufleet.errors import one_line
from gpufleet.hoststate.atomic import atomic_write_command
from gpufleet.remote.transport import SshTransport
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
    record(router)  # a router restarted now must not take it back mid-swap
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
    record(router)


def record(router: Router) -> None:
    """Write the router's live worker set to its members file on the router host (atomically, as root), which its
    unit replays after a restart: a router restarted or rebooted mid-rollout comes back with the replicas that were
    in, not the one being swapped. Raises RouterError with one line."""
    if router.members_file is None or not isinstance(router.transport, SshTransport):
        return
    text = "".join(f"{url}\n" for url in router.list_workers())
    directory = posixpath.dirname(router.members_file)
    status, _, err = router.as_root(f"printf %s {shlex.quote(text)} | {{ install -d -m 755 {shlex.quote(directory)} "
                                    f"&& {atomic_write_command(router.members_file)}; }}", 30.0)
    if status != 0:
        raise RouterError(one_line(f"{router.name}: could not record its workers in {router.members_file}: "
                                   f"{err.strip() or f'exit status {status}'}"))
