"""Is a router serving the fleet? Its status against the inventory, as one-line problems (docs/router.md, Verify)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.errors import one_line
from gpufleet.router.settings import Replica, RouterSettings
from gpufleet.router.status import RouterStatus, WorkerRow

POLL_S = 1.0  # between looks of `verify --wait`


@dataclass(frozen=True)
class RouterExpected:
    """What a router should route to (worker URL to replica name), and how to say the fixes."""

    workers: Mapping[str, str]
    health_check_interval_s: int = 10
    service: str = "vllm-router"
    inventory: str = "INVENTORY"  # as the fixes spell it

    @classmethod
    def for_router(cls, settings: RouterSettings, replicas: Sequence[Replica], inventory: str) -> RouterExpected:
        """The set the router deploy configures when every replica is ready."""
        return cls(
            {_norm(r.url): r.name for r in replicas}, settings.health_check_interval_s, settings.service, inventory
        )


@dataclass(frozen=True)
class RouterVerdict:
    status: RouterStatus
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        """A `--json` row: the status row, ok, and the problems."""
        return (
            {"host": self.status.name, "role": "router"}
            | self.status.as_dict()
            | {"ok": self.ok, "problems": list(self.problems)}
        )


def problems(row: RouterStatus, expected: RouterExpected) -> tuple[str, ...]:
    """Every reason `row` does not serve the fleet `expected` describes; () when it does."""
    name, inv = row.name, expected.inventory
    deploy = f"pyinfra {inv} deploys/router.py"
    if row.state == "unreachable":
        return (
            one_line(
                f"{name}: cannot SSH to the router host: {row.detail} (fix: bring {name} back, or check its "
                f"ssh_* data in {inv})"
            ),
        )
    if row.state not in ("ready", "not-ready"):
        return (
            one_line(
                f"{name}: the router does not answer: {row.detail or row.state} (fix: `systemctl status "
                f"{expected.service}` on {name}; {deploy} starts it)"
            ),
        )
    found: list[str] = []
    if row.front_door and row.front_door != "200":
        found.append(
            f"{name}: the client port does not answer /health ({row.front_door}): clients cannot reach the "
            f"router (fix: `systemctl status nginx` on {name}; {deploy} configures it)"
        )
    if row.fenced is False:
        found.append(
            f"{name}: the router's worker API is open to every local user of {name}: its nftables fence "
            f"is not loaded (fix: {deploy} loads it)"
        )
    listed = {_norm(w.url): w for w in row.workers}
    fix = f"gpufleet status {inv} --fix"
    for url, replica in expected.workers.items():
        worker: WorkerRow | None = listed.get(url)
        if worker is None:
            found.append(
                f"{name}: worker {url} ({replica}) is not in the router's worker set (fix: once {replica} "
                f"verifies ready, `{fix}` puts it back)"
            )
        elif not worker.healthy:
            found.append(
                f"{name}: worker {url} ({replica}) is not healthy in the router (fix: gpufleet verify {inv} "
                f"--host {replica}; the router re-checks it every {expected.health_check_interval_s} s)"
            )
    for url in listed:
        if url not in expected.workers:
            found.append(f"{name}: worker {url} is not a replica of the inventory (fix: `{fix}` removes it)")
    if row.state != "ready" and not found:
        found.append(f"{name}: {row.state}: {row.detail} (fix: {deploy})")  # e.g. no replica in the inventory at all
    return tuple(one_line(line) for line in found)


def verify_router(
    read: Callable[[], RouterStatus],
    expected: RouterExpected,
    deadline: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> RouterVerdict:
    """Read and judge the router until it passes or clock() passes `deadline`; at least one look."""
    while True:
        row = read()
        verdict = RouterVerdict(row, problems(row, expected))
        if verdict.ok or clock() + POLL_S > deadline:
            return verdict
        sleep(POLL_S)


def _norm(url: str) -> str:
    # The router lists a worker as it was given, trailing slash included.
    return url.rstrip("/")
