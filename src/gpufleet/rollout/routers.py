"""The routers in front of the replicas (the inventory's routers group), as a rollout uses them: a replica leaves
every router's worker set before its drain and rejoins once its outcome is committed or rolled back (a rolled-back
replica serves the old version, so it rejoins too), so clients of a router never reach a replica while it restarts.
At the start and the end of every rollout the worker sets are reconciled with the replicas' ledgers and health, so a
controller killed between a leave and a rejoin leaves nothing stranded for the next run."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from gpufleet.errors import GpufleetError, one_line
from gpufleet.hostlock import LEASE_SETTING, WAIT_SETTING, HostLock, HostLockError
from gpufleet.inventory import HostData
from gpufleet.remote.ssh import needs_sudo
from gpufleet.remote.transport import Unreachable
from gpufleet.router.api import Router, RouterError
from gpufleet.router.settings import router_settings, worker_url
from gpufleet.router.status import connect
from gpufleet.router.workers import join, leave, record
from gpufleet.settings import merged_settings


class Routers:
    """Open sessions to every router; close() ends them."""

    def __init__(self, routers: Sequence[tuple[Router, float]], urls: Mapping[str, str]):
        self.routers = list(routers)  # (router, seconds it waits for a re-added worker's /health)
        self.urls = dict(urls)  # replica name -> the URL the routers know it by
        self.locks: list[HostLock] = []  # each router host's lock, held for the rollout

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
                opened.locks.append(_lock(router, data))
        except BaseException:
            opened.close()
            raise
        return opened

    def capacity_problem(self, groups: Sequence[Sequence[str]]) -> str | None:
        """One line when a group would leave a router with no replica in service, counting those already out of
        it; None when every group leaves at least one (or there is no router)."""
        for router, _ in self.routers:
            try:
                listed = set(router.list_workers())
            except Exception as error:  # an SSH cut, a refusal: one line, before anything changes
                return one_line(f"router {router.name}: its worker list does not answer: {_why(error)}; nothing was "
                                "changed (fix: `gpufleet status` shows the router; run again once it answers)")
            serving = {host for host, url in self.urls.items() if url in listed}
            for group in groups:
                if serving and not serving - set(group):
                    return one_line(
                        f"router {router.name}: swapping {', '.join(group)} at once would leave it no replica in "
                        f"service (it routes to {len(serving)}: {', '.join(sorted(serving))}); nothing was changed "
                        "(fix: a smaller --batch, or --canary 1, so that one replica always serves)")
        return None

    @contextmanager
    def out(self, hosts: Sequence[str], drain_timeout_s: float) -> Iterator[None]:
        """The hosts out of every router, drained, for the block. They do not come back by themselves: rejoin() puts
        a host back once its swap ended committed or rolled back (a replica that ended neither stays out), and
        reconcile() at the end of the rollout settles whatever a raised block left. A router that refuses to let
        one go raises RouterError before the block, after putting back the ones this call took out."""
        taken: list[tuple[Router, str, float]] = []
        try:
            for router, join_timeout_s in self.routers:
                members = set(router.list_workers())
                for host in hosts:
                    url = self.urls[host]
                    if url in members:  # one the router does not list has nothing to drain there
                        taken.append((router, url, join_timeout_s))
                        leave(router, url, drain_timeout_s)
        except Exception as error:  # SSH cut, a refusal, an answer that is not the router's: one line
            for router, url, join_timeout_s in taken:
                try:
                    join(router, url, join_timeout_s)  # not swapped: back where it was
                except Exception:
                    pass  # the error that stops the rollout is the leave's
            raise RouterError(one_line(f"taking {', '.join(hosts)} out of the routers: {_why(error)}")) from None
        yield

    def rejoin(self, host: str) -> str | None:
        """The host back in every router; None, or one line saying which router did not take it back."""
        problems = []
        for router, join_timeout_s in self.routers:
            try:
                join(router, self.urls[host], join_timeout_s)
            except Exception as error:
                problems.append(f"did not rejoin router {router.name}: {_why(error)}")
        return one_line("; ".join(problems)) if problems else None

    def reconcile(self, belongs: Mapping[str, bool | None]) -> dict[str, str]:
        """Every router's worker set made what the ledgers and the replicas say: a replica that belongs (committed,
        nothing pending, verifies ready) is in, one that does not is out, and a worker that is no replica of the
        inventory is out; a replica whose state could not be read (None) is left as it is. Returns host (or
        router) -> one line of what changed or failed there; never raises."""
        if not self.routers:
            return {}
        by_url = {url: host for host, url in self.urls.items()}
        changed: dict[str, list[str]] = {}
        for router, join_timeout_s in self.routers:
            try:
                members = set(router.list_workers())
            except Exception as error:
                changed.setdefault(router.name, []).append(f"router {router.name}: worker list: {_why(error)}")
                continue
            removed = False  # join() records the file itself; a removal here is recorded once, below
            for host, wanted in belongs.items():
                url = self.urls.get(host)
                if url is None or wanted is None or (url in members) == wanted:
                    continue
                try:
                    if wanted:
                        join(router, url, join_timeout_s)
                        changed.setdefault(host, []).append(f"put back in router {router.name}")
                    else:
                        router.remove_worker(url)
                        removed = True
                        changed.setdefault(host, []).append(f"taken out of router {router.name}")
                except Exception as error:
                    changed.setdefault(host, []).append(f"router {router.name}: {_why(error)}")
            for url in sorted(members - set(by_url)):
                try:
                    router.remove_worker(url)
                    removed = True
                    changed.setdefault(router.name, []).append(f"removed {url}: no replica of the inventory")
                except Exception as error:
                    changed.setdefault(router.name, []).append(f"removing {url}: {_why(error)}")
            if removed:
                try:
                    record(router)  # what it holds now is what it comes back with after a restart
                except Exception as error:
                    changed.setdefault(router.name, []).append(_why(error))
        return {name: one_line("; ".join(lines)) for name, lines in changed.items()}

    def close(self) -> None:
        for lock in self.locks:
            lock.release(wait=False)
        self.locks.clear()
        for router, _ in self.routers:
            client = getattr(router.transport, "client", None)
            if client is not None:
                client.close()
        self.routers.clear()

    def __enter__(self) -> Routers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _why(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _lock(router: Router, data: Mapping[str, Any]) -> HostLock:
    """The router host's lock, taken over the rollout's own session to it and held until close(): a router deploy
    (or another rollout) meanwhile is refused, naming this one."""
    settings = merged_settings(dict(data))
    client = router.transport.client  # type: ignore[attr-defined]  # status.connect opens an SshTransport
    lock = HostLock(client, router.name, lease_s=float(settings[LEASE_SETTING]), sudo=needs_sudo(client))
    try:
        return lock.acquire(wait_s=float(settings[WAIT_SETTING]))
    except HostLockError as error:
        raise GpufleetError(one_line(f"router {router.name}: {error}")) from None
    except (TypeError, ValueError):
        raise GpufleetError(one_line(f"router {router.name}: {WAIT_SETTING} and {LEASE_SETTING} must be numbers of "
                                     "seconds (fix: set them to numbers)")) from None
