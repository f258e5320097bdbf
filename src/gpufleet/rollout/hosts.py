"""The inventory's hosts as a rollout sees them, and their SSH sessions, used in parallel."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import gevent.pool

from gpufleet.errors import GpufleetError, one_line
from gpufleet.health.runner import PARALLEL
from gpufleet.remote.ssh import needs_sudo, open_ssh
from gpufleet.remote.transport import SshTransport, Unreachable
from gpufleet.vllm.host_specs import load_host_specs
from gpufleet.vllm.spec import ServeSpec

T = TypeVar("T")


@dataclass(frozen=True)
class FleetHost:
    name: str
    spec: ServeSpec
    data: Mapping[str, Any] = field(repr=False)  # merged host data

    @property
    def api_key(self) -> str | None:
        key = self.data.get("vllm_api_key")
        return str(key) if key else None


def load_fleet(inventory: str, only_host: str | None = None) -> list[FleetHost]:
    """The inventory's vLLM hosts (or one), validated."""
    hosts = [FleetHost(spec.host, spec, data) for spec, data in load_host_specs(inventory, only_host)]
    if not hosts:
        raise GpufleetError(f"{inventory}: no hosts in the inventory")
    return hosts


def shell(transport: SshTransport, command: str, timeout: float = 60.0, root: bool = False) -> tuple[int, str, str]:
    """Run a shell command over the session, as root (sudo -n) when `root`."""
    sudo = "sudo -n " if root and needs_sudo(transport.client) else ""
    return transport.shell(f"{sudo}sh -c {shlex.quote(command)}" if sudo else command, timeout=timeout)


class Sessions:
    """One SSH session per host for the rollout's reads."""

    def __init__(self, hosts: Sequence[FleetHost]):
        self.hosts = {h.name: h for h in hosts}
        self._open: dict[str, SshTransport] = {}

    def get(self, name: str) -> SshTransport:
        """The host's session, reopened if it closed; raises Unreachable."""
        transport = self._open.get(name)
        live = transport is not None and (t := transport.client.get_transport()) is not None and t.is_active()
        if transport is None or not live:
            transport = open_ssh(name, self.hosts[name].data)
            self._open[name] = transport
        return transport

    def each(self, names: Sequence[str], fn: Callable[[FleetHost, SshTransport], T]) -> dict[str, T | str]:
        """fn(host, session) on every named host in parallel: its value, or one line saying why not."""

        def one(name: str) -> T | str:
            try:
                return fn(self.hosts[name], self.get(name))
            except (Unreachable, GpufleetError) as e:
                return one_line(str(e))

        if not names:
            return {}
        pool = gevent.pool.Pool(min(len(names), PARALLEL))
        jobs = {name: pool.spawn(one, name) for name in names}
        gevent.joinall(list(jobs.values()))
        return {name: job.get() for name, job in jobs.items()}

    def close(self) -> None:
        for transport in self._open.values():
            transport.client.close()
        self._open.clear()

    def __enter__(self) -> Sessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
