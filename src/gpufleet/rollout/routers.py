"""The routers in front of the replicas (the inventory's routers group), as a rollout uses them: a replica leaves
every router's worker set before its drain and rejoins after its outcome (a rolled-back replica serves the old
version, so it rejoins too), so clients of a router never reach a replica while it restarts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager

from gpufleet.errors import GpufleetError, one_line
from gpufleet.inventory import HostData
from gpufleet.remote.transport import Unreachable
from gpufleet.router.api import Router, RouterError
from gpufleet.router.settings import router_settings, worker_url
from gpufleet.router.status import connect
from gpufleet.router.workers import join, leave


class Routers:
    """Open sessions to every router; close() ends them."""

    def __init__(self, routers: Sequence[tuple[Router, float]], urls: Mapping[str, str]):
        self.routers = list(routers)  # (router, seconds it waits for a re-added worker's /health)
        self.urls = dict(urls)  # replica name -> the URL the routers know it by

    @classmethod
    def connect(cls, routers: Sequence[HostData], replicas: Sequence[HostData]) -> Routers:
        """Every router, reached and answering its worker list; raises GpufleetError with one line naming the
        first that is not (a replica must not restart while a router may still send it traffic)."""
        # Addresses only when there is a router to address them: a fleet without one may keep vLLM on loopback.
        urls = {name: worker_url(name, data) for name, data in replicas} if routers else {}
        opened = cls([], urls)
        try:
            for name, data in routers:
                try:
                    router = connect(name, data)
                except Unreachable as error:
                    raise GpufleetError(one_line(f"router {name}: {error} (fix: bring the router back, or take it "
                                                 "out of the inventory's routers group)")) from None
                opened.routers.append((router, float(router_settings(data)["router_worker_startup_timeout_s"])))
                try:
                    router.list_workers()
                except (RouterError, OSError) as error:
                    raise GpufleetError(one_line(f"router {name}: its worker list does not answer: {error} (fix: "
                                                 "`gpufleet status` shows the router; start it, or take it out of "
                                                 "the inventory's routers group)")) from None
        except BaseException:
            opened.close()
            raise
        return opened

    @contextmanager
    def out(self, hosts: Sequence[str], drain_timeout_s: float, rejoin_failed: dict[str, str]) -> Iterator[None]:
        """The hosts out of every router that routes to them, for the block; back in after it, also when it raised.
        A router that refuses to let one go raises RouterError before the block (the ones already out rejoin); one
        that does not take one back is recorded in rejoin_failed[host], never raised over the block's outcome."""
        with ExitStack() as stack:
            for router, join_timeout_s in self.routers:
                members = set(router.list_workers())
                for host in hosts:
                    if self.urls[host] in members:  # a replica the router does not route to stays out of it
                        stack.enter_context(self._rotation(router, host, drain_timeout_s, join_timeout_s,
                                                           rejoin_failed))
            yield

    @contextmanager
    def _rotation(self, router: Router, host: str, drain_timeout_s: float, join_timeout_s: float,
                  rejoin_failed: dict[str, str]) -> Iterator[None]:
        # workers.out_of_rotation's steps, with a failed rejoin attributed to its host instead of raised over the
        # block (or over another host's failed leave, which must reach the caller).
        url = self.urls[host]
        try:
            leave(router, url, drain_timeout_s)
        except (RouterError, OSError) as error:
            # leave() may fail after the removal (requests still in flight at its deadline): not swapped, so back.
            try:
                join(router, url, join_timeout_s)
            except (RouterError, OSError):
                pass  # the error that stops the rollout is the leave's
            raise RouterError(one_line(f"{router.name}: taking {url} out: {error}")) from None
        try:
            yield
        finally:
            try:
                join(router, url, join_timeout_s)
            except (RouterError, OSError) as error:
                rejoin_failed[host] = one_line(f"did not rejoin router {router.name}: {error}")

    def close(self) -> None:
        for router, _ in self.routers:
            client = getattr(router.transport, "client", None)
            if client is not None:
                client.close()
        self.routers.clear()

    def __enter__(self) -> Routers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
