"""Take a replica out of a router's worker set and put it back, around a rollout's swap (docs/router.md)."""

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
    """Requests the router has in flight to `url` now."""
    return int(
        sum(
            value
            for name, labels, value in router.metrics()
            if name == "vllm_router_running_requests" and labels.get("worker") == url
        )
    )


def leave(router: Router, url: str, drain_timeout_s: float = 60.0) -> float:
    """Remove `url` from the router's workers and drain it; returns the drain's seconds."""
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
    """Put `url` back once it answers /health."""
    if url in router.list_workers():
        return
    router.add_worker(url, timeout_s + 10)
    if url not in router.list_workers():
        raise RouterError(f"{router.name}: {url} is not in its worker set after /add_worker")
    record(router)


def record(router: Router) -> None:
    """Write the live worker set to the members file the unit replays after a restart."""
    if router.members_file is None or not isinstance(router.transport, SshTransport):
        return
    text = "".join(f"{url}\n" for url in router.list_workers())
    directory = posixpath.dirname(router.members_file)
    status, _, err = router.as_root(
        f"printf %s {shlex.quote(text)} | {{ install -d -m 755 {shlex.quote(directory)} "
        f"&& {atomic_write_command(router.members_file)}; }}",
        30.0,
    )
    if status != 0:
        raise RouterError(
            one_line(
                f"{router.name}: could not record its workers in {router.members_file}: "
                f"{err.strip() or f'exit status {status}'}"
            )
        )
