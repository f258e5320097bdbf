"""Test fleets: the session fleet's config (one per pytest-xdist worker) and a fleet for a fixture's lifetime."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpufleet.sandbox.config import FleetConfig, test_config
from gpufleet.sandbox.fleet import Fleet, check_prerequisites
from gpufleet.sandbox.procs import SandboxError

# Session fleets of xdist workers take 10.213.<10+n>.0/24 (gw0 -> 10.213.10); 10.213.0-9 are the sandbox's and the
# fixed fleets' (test 1, tdown 2, bench 3, carry 4, roll 5, rbench 6, rtr 7, scbench 8, cbench 9).
WORKER_NET_FROM = 10
MAX_WORKERS = 90


def session_fleet_config() -> FleetConfig:
    """gf-test (10.213.1, hosts gft<i>) for a run without workers; under xdist, worker gw<n> gets its own fleet
    (fleet tw<n>, bridge gf-tw<n>, 10.213.<10+n>, hosts gw<n>t<i>, state dir <dir>-gw<n>), so the modules that share
    the session's hosts can run on several workers at once. Every name differs from the fixed fleets' and none
    starts with another fleet's name and a dash, which is how a fleet's start finds a killed run's leftovers."""
    state_dir = Path(os.environ.get("GPUFLEET_TEST_FLEET_DIR", "/var/lib/gpufleet/test"))
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...; unset without xdist
    if not worker:
        return test_config(state_dir)
    n = int(worker.removeprefix("gw"))
    if n >= MAX_WORKERS:
        raise SandboxError(f"xdist worker {worker}: session fleets have subnets for {MAX_WORKERS} workers (fix: fewer -n)")
    return FleetConfig(
        name=f"tw{n}",
        bridge=f"gf-tw{n}",
        net=f"10.213.{WORKER_NET_FROM + n}",
        host_prefix=f"gw{n}t",
        state_dir=state_dir.with_name(f"{state_dir.name}-{worker}"),
    )


@contextmanager
def running_fleet(cfg: FleetConfig) -> Iterator[Fleet]:
    """The fleet with its services up (no hosts yet), stopped, leaving nothing, on exit; the test is skipped when
    this machine cannot run test hosts (tests/conftest.py fails such a skip under CI)."""
    try:
        check_prerequisites()
    except SandboxError as err:
        pytest.skip(f"test hosts unavailable: {err}")
    fleet = Fleet(cfg)
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()
