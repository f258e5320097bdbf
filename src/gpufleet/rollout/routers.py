"""The routers as a rollout uses them: each swapped replica leaves their worker sets and rejoins after its swap
(docs/rollout.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from functools import partial
from typing import Any, TypeVar

from gpufleet.errors import GpufleetError, one_line
from gpufleet.hostlock import HostLock, HostLockBusy, HostLockError, lock_timings
from gpufleet.inventory import HostData
from gpufleet.remote.ssh import needs_sudo
from gpufleet.remote.transport import SshTransport, Unreachable
from gpufleet.router.api import Router, RouterError
from gpufleet.router.settings import router_settings, worker_url
from gpufleet.router.status import connect
from gpufleet.router.workers import join, leave, record
from gpufleet.vllm.settings import merged_settings

T = TypeVar("T")
RELOCK_WAIT_S = 5.0


class Routers:
    """Open sessions to every router; close() ends them."""

    def __init__(
        self,
        routers: Sequence[tuple[Router, float]],
        urls: Mapping[str, str],
        hosts: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        self.routers = list(routers)  # (router, its join timeout)
        self.urls = dict(urls)  # replica name -> its worker URL
        self.locks: dict[str, HostLock] = {}
        self.hosts = dict(hosts or {})  # router name -> its inventory data
        self.notes: dict[str, list[str]] = {}  # router name -> lines for the next reconcile

    @classmethod
    def connect(cls, routers: Sequence[HostData], replicas: Sequence[HostData]) -> Routers:
        """Every router, reached, answering and locked; raises GpufleetError naming the first that is not."""
        # A fleet without a router may keep vLLM on loopback: no worker URL to build.
        urls = {name: worker_url(name, data) for name, data in replicas} if routers else {}
        opened = cls([], urls, dict(routers))
        try:
            for name, data in routers:
                try:
                    router = connect(name, data)
                except Unreachable as error:
                    raise GpufleetError(
                        one_line(
                            f"router {name}: {error} (fix: bring the router back, or take it "
                            "out of the routers inventory group)"
                        )
                    ) from None
                opened.routers.append((router, float(router_settings(data)["router_worker_startup_timeout_s"])))
                try:
                    router.list_workers()
                except (RouterError, OSError) as error:
                    raise GpufleetError(
                        one_line(
                            f"router {name}: its worker list does not answer: {error} (fix: "
                            "`gpufleet status` shows the router; start it, or take it out of "
                            "the routers inventory group)"
                        )
                    ) from None
                opened.locks[name] = _lock(router, data)
        except BaseException:
            opened.close()
            raise
        return opened

    def capacity_problem(
        self, batches: Sequence[Sequence[str]], belongs: Mapping[str, bool | None] | None = None
    ) -> str | None:
        """Why a batch would leave a router with no replica in service, counting what `belongs` and the earlier
        batches leave."""
        belongs = belongs or {}
        for i, (router, _) in enumerate(self.routers):
            try:
                listed = set(self._call(i, lambda r: r.list_workers()))
            except Exception as error:  # one line, before anything changes
                return one_line(
                    f"router {router.name}: its worker list does not answer: {_why(error)}; nothing was "
                    "changed (fix: `gpufleet status` shows the router; run again once it answers)"
                )
            serving = {
                host
                for host, url in self.urls.items()
                if belongs.get(host) or (url in listed and belongs.get(host) is not False)
            }
            for batch in batches:
                if serving and not serving - set(batch):
                    return one_line(
                        f"router {router.name}: swapping {', '.join(batch)} at once would leave it no replica in "
                        f"service (it routes to {len(serving)}: {', '.join(sorted(serving))}); nothing was changed "
                        "(fix: a smaller --batch, or --canary 1, so that one replica always serves)"
                    )
                serving |= set(batch)
        return None

    @contextmanager
    def out(self, hosts: Sequence[str], drain_timeout_s: float) -> Iterator[None]:
        """The hosts out of every router, drained, for the block; rejoin() or reconcile() puts them back. Raises
        RouterError before the block when a router refuses one."""
        taken: list[tuple[int, str, float]] = []
        try:
            for i, (_, join_timeout_s) in enumerate(self.routers):
                members = set(self._call(i, lambda r: r.list_workers()))
                router = self.routers[i][0]  # _call may have reached it again
                for host in hosts:
                    url = self.urls[host]
                    if url in members:
                        taken.append((i, url, join_timeout_s))
                        leave(router, url, drain_timeout_s)  # not retried: a cut mid-leave fails the batch
        except Exception as error:
            for i, url, join_timeout_s in taken:
                with suppress(Exception):  # the leave's error is the one to report; the last reconcile retries
                    self._call(i, partial(_join, url=url, timeout_s=join_timeout_s))
            raise RouterError(one_line(f"taking {', '.join(hosts)} out of the routers: {_why(error)}")) from None
        yield

    def rejoin(self, host: str) -> str | None:
        """Put the host back in every router; one line naming any that did not take it."""
        problems = []
        for i, (router, join_timeout_s) in enumerate(self.routers):
            try:
                self._call(i, partial(_join, url=self.urls[host], timeout_s=join_timeout_s))
            except Exception as error:
                problems.append(f"did not rejoin router {router.name}: {_why(error)}")
        return one_line("; ".join(problems)) if problems else None

    def reconcile(self, belongs: Mapping[str, bool | None]) -> dict[str, str]:
        """Make every router's worker set what `belongs` says, removing workers of no replica. Never raises."""
        if not self.routers:
            return {}
        by_url = {url: host for host, url in self.urls.items()}
        changed: dict[str, list[str]] = {}
        for i, (router, join_timeout_s) in enumerate(self.routers):
            try:
                members = set(self._call(i, lambda r: r.list_workers()))
            except Exception as error:
                changed.setdefault(router.name, []).append(f"router {router.name}: worker list: {_why(error)}")
                continue
            finally:
                changed.setdefault(router.name, [])[:0] = self._said(i)
            router = self.routers[i][0]  # _call may have reached it again
            removed = False  # join() records itself; removals are recorded once, below
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
                    record(router)  # what a restarted router comes back with
                except Exception as error:
                    changed.setdefault(router.name, []).append(_why(error))
        return {name: one_line("; ".join(lines)) for name, lines in changed.items() if lines}

    def _call(self, i: int, call: Callable[[Router], T]) -> T:
        """call(router i), repeated once over a new session and lock when the SSH session broke."""
        router = self.routers[i][0]
        if _broken(router):
            router = self._reach_again(i)
        try:
            return call(router)
        except Exception:
            if not _broken(router):
                raise  # the router's own answer, not the session's
        return call(self._reach_again(i))

    def _reach_again(self, i: int) -> Router:
        """Raises Unreachable or GpufleetError."""
        old, join_timeout_s = self.routers[i]
        data = self.hosts.get(old.name)
        if data is None:  # not opened by connect()
            raise Unreachable(f"{old.name}: SSH connection is not open")
        lock = self.locks.pop(old.name, None)
        if lock is not None:
            lock.release(wait=False)
        _close(old)
        fresh = connect(old.name, data)
        try:
            self.locks[old.name] = _relock(fresh, data)
        except BaseException:
            _close(fresh)
            raise
        fresh.non_finite.extend(old.non_finite)
        self.routers[i] = (fresh, join_timeout_s)
        self._note(old.name, "the router's SSH session broke; reached it again, its lock taken again")
        return fresh

    def _note(self, router: str, line: str) -> None:
        if line not in self.notes.setdefault(router, []):
            self.notes[router].append(line)

    def _said(self, i: int) -> list[str]:
        """Router i's notes and uncounted metrics, each said once."""
        router = self.routers[i][0]
        lines = self.notes.pop(router.name, [])
        if router.non_finite:
            lines.append(
                f"the router's metrics gave {len(router.non_finite)} sample(s) that are not a "
                f"number ({', '.join(router.non_finite[:3])}{', ...' if len(router.non_finite) > 3 else ''})"
                ": not counted, so a drain counted no request in flight there (the replica's own drain "
                "still waits for its requests)"
            )
            router.non_finite.clear()
        return lines

    def close(self) -> None:
        for lock in self.locks.values():
            lock.release(wait=False)
        self.locks.clear()
        for router, _ in self.routers:
            _close(router)
        self.routers.clear()

    def __enter__(self) -> Routers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _why(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _join(router: Router, url: str, timeout_s: float) -> None:
    join(router, url, timeout_s)


def _broken(router: Router) -> bool:
    if not isinstance(router.transport, SshTransport):
        return False
    session = router.transport.client.get_transport()
    return session is None or not session.is_active()


def _close(router: Router) -> None:
    client = getattr(router.transport, "client", None)
    if client is not None:
        client.close()


def _relock(router: Router, data: Mapping[str, Any]) -> HostLock:
    """The old session's shell may still hold the lock for this run until its lease ends; that counts as held."""
    _, lease_s = lock_timings(f"router {router.name}", merged_settings(dict(data)))
    client = router.transport.client  # type: ignore[attr-defined]  # status.connect opens an SshTransport
    lock = HostLock(client, router.name, lease_s=lease_s, sudo=needs_sudo(client))
    try:
        return lock.acquire(wait_s=RELOCK_WAIT_S)
    except HostLockBusy as busy:
        mine = lock.holder
        if busy.holder is None or (busy.holder.user, busy.holder.controller, busy.holder.pid) != (
            mine.user,
            mine.controller,
            mine.pid,
        ):
            raise GpufleetError(one_line(f"router {router.name}: reached again, but {busy}")) from None
        return lock  # not held by this object: close() lets nothing go, the old shell ends by its lease
    except HostLockError as error:
        raise GpufleetError(one_line(f"router {router.name}: reached again, but {error}")) from None


def _lock(router: Router, data: Mapping[str, Any]) -> HostLock:
    """Held until close(): a router deploy or another rollout meanwhile is refused."""
    wait_s, lease_s = lock_timings(f"router {router.name}", merged_settings(dict(data)))
    client = router.transport.client  # type: ignore[attr-defined]  # status.connect opens an SshTransport
    lock = HostLock(client, router.name, lease_s=lease_s, sudo=needs_sudo(client))
    try:
        return lock.acquire(wait_s=wait_s)
    except HostLockError as error:
        raise GpufleetError(one_line(f"router {router.name}: {error}")) from None
