"""Fixtures for the real test-host tier: nspawn hosts on bridge gf-test (10.213.1.0/24; under pytest-xdist each
worker has its own session fleet: tests/integration/fleets.py), booted over the same code as `gpufleet sandbox up`
(gpufleet.sandbox), with SSH as `deploy` + sudo, apt from the local mirror, the stand-in NVIDIA repo and registry.

    def test_x(test_hosts, pyinfra_inventory, fleet): ...        # 2 hosts booted once per session
    def test_y(fresh_hosts):  a, b = fresh_hosts(OLD_DRIVER, NO_GPU)  # new hosts, deleted after the test
    def test_z(module_host): ...                                     # one new host for the module's tests

Without root or systemd-nspawn every test here skips with one line (tests/conftest.py fails such skips under CI).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.sandbox.config import Gpus, H200x3
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.hosts import Host
from gpufleet.sandbox.inventory import inventory_document, write_pyinfra_inventory
from tests.integration.fleets import running_fleet, session_fleet_config

PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
# Fresh hosts are numbered from here, so they never collide with the session's hosts.
FRESH_FROM = 11


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    """The session's test fleet with its services up (no hosts yet); stopped, leaving nothing, at session end."""
    with running_fleet(session_fleet_config()) as f:
        yield f


@pytest.fixture(scope="session")
def test_hosts(fleet: Fleet) -> list[Host]:
    """Two 3x H200 hosts (gft1, gft2; gw<n>t1, gw<n>t2 on xdist worker gw<n>), booted once per session."""
    return fleet.add_hosts([H200x3, H200x3], first=1)


@pytest.fixture(scope="session")
def inventory_json(fleet: Fleet, test_hosts: list[Host], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session hosts' inventory (same document `gpufleet sandbox up` writes), frozen to these hosts: the
    fleet's own inventory.json also lists fresh hosts other tests add and remove meanwhile."""
    path = tmp_path_factory.mktemp("inventory") / "inventory.json"
    path.write_text(json.dumps(inventory_document(fleet.cfg, test_hosts, fleet.key), indent=2) + "\n")
    return path


@pytest.fixture(scope="session")
def pyinfra_inventory(inventory_json: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pyinfra inventory file (group `gpuhosts`) for the session hosts, with the sandbox host data."""
    return write_pyinfra_inventory(inventory_json, tmp_path_factory.mktemp("inventory") / "test_hosts.py")


@pytest.fixture(scope="session")
def _fresh_numbers():
    """Host numbers for fresh hosts, never reused within a session: a name is never booted twice."""
    return itertools.count(FRESH_FROM)


@pytest.fixture
def fresh_hosts(fleet: Fleet, _fresh_numbers):
    """Factory: fresh_hosts(*gpus) boots new hosts (gft11, gft12, ...) for one test and deletes them after it."""
    made: list[Host] = []

    def boot(*gpus: Gpus) -> list[Host]:
        first = next(_fresh_numbers)
        for _ in gpus[1:]:
            next(_fresh_numbers)
        hosts = fleet.add_hosts(list(gpus), first=first)
        made.extend(hosts)
        return hosts

    yield boot
    if made:
        fleet.remove_hosts([h.name for h in made])


@pytest.fixture(scope="module")
def module_host(fleet: Fleet, _fresh_numbers) -> Host:
    """One fresh 3x H200 host shared by a module's tests (steps that build on each other), deleted after them."""
    (host,) = fleet.add_hosts([H200x3], first=next(_fresh_numbers))
    yield host
    fleet.remove_hosts([host.name])


@pytest.fixture(scope="session")
def pyinfra():
    """pyinfra(inventory, *args) -> CompletedProcess: the real CLI, over SSH, as the inventory's user.

    Its output (pyinfra logs host output on stderr) is all in .stdout."""

    def run(inventory: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [PYINFRA, "-y", str(inventory), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"pyinfra {' '.join(args)} failed:\n{proc.stdout[-4000:]}")
        return proc

    return run
