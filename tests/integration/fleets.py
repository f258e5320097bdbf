"""Test fleets: the session fleet's config (one per pytest-xdist worker), a module's own fixed fleet's config, a
fleet for a fixture's lifetime, and an inventory of a fleet's hosts on an image tag of the module's own."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpufleet.sandbox.config import FleetConfig, test_config
from gpufleet.sandbox.fleet import Fleet, check_prerequisites
from gpufleet.sandbox.hosts import Host
from gpufleet.sandbox.image import REPOSITORY
from gpufleet.sandbox.procs import SandboxError

# Session fleets of xdist workers take 10.213.<10+n>.0/24 (gw0 -> 10.213.10); 10.213.0-9 are the sandbox's and the
# fixed fleets' (test 1, tdown 2, bench 3, carry 4, roll 5, rbench 6, rtr 7, scbench 8, cbench 9), as is 10.213.100
# (rroll: the rollouts behind a router).
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
        raise SandboxError(
            f"xdist worker {worker}: session fleets have subnets for {MAX_WORKERS} workers (fix: fewer -n)"
        )
    return FleetConfig(
        name=f"tw{n}",
        bridge=f"gf-tw{n}",
        net=f"10.213.{WORKER_NET_FROM + n}",
        host_prefix=f"gw{n}t",
        state_dir=state_dir.with_name(f"{state_dir.name}-{worker}"),
    )


def own_fleet_config(name: str, net: str, host_prefix: str, state_dir_env: str) -> FleetConfig:
    """A module's own fixed fleet (bridge gf-<name>, <net>.0/24, hosts <host_prefix><i>), so it never waits on, or
    clears, the session's fleet; its state in $<state_dir_env>, else /var/lib/gpufleet/<name>."""
    return FleetConfig(
        name=name,
        bridge=f"gf-{name}",
        net=net,
        host_prefix=host_prefix,
        state_dir=Path(os.environ.get(state_dir_env, f"/var/lib/gpufleet/{name}")),
    )


def module_tag(prefix: str) -> str:
    """An image tag of the module's own (<prefix>-<8 hex digits>): the tests move it in the fleet's registry, as a
    nightly tag moves, and no other module's tag is it."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def tagged_inventory(path: Path, fleet: Fleet, hosts: Sequence[Host], tag: str, data: dict) -> Path:
    """Writes a pyinfra inventory of these hosts of the fleet (group `gpuhosts`) to `path`: the sandbox's host data,
    `data` over it and vllm_image on `tag` in the fleet's registry."""
    image = f"{fleet.cfg.registry}/{REPOSITORY}:{tag}"
    names = [h.name for h in hosts]
    path.write_text(
        "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
        f"gpuhosts = [(n, {{**d, **{data!r}, 'vllm_image': {image!r}}}) for n, d in "
        f"pyinfra_hosts({str(fleet.write_inventory())!r}) if n in {names!r}]\n"
    )
    return path


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
