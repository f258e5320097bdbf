"""A converge whose new image fails verification puts the committed version back (real test host, SSH).

One fresh host, three steps in file order (pytest keeps it): good image -> `rejects-flag` (its own parser rejects
a serve flag: caught by the flag check before the unit changes) -> `dies` (ready, then its engine dies: caught by
the soak, rolled back, marked failed in the ledger) -> the good image again: no change.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from gpufleet.health import HealthState, check
from gpufleet.hoststate.paths import committed_unit
from gpufleet.remote.ssh import open_ssh
from gpufleet.remote.transport import SshTransport
from gpufleet.sandbox.image import image_ref
from gpufleet.vllm.settings import build_spec
from gpufleet.wire.identity import Expected
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.test_deploy_qwen35 import (
    SERVICE,
    STATE_FILE,
    committed_ref,
    deploy,
    ledger,
    running_image,
    sh,
    write_inventory,
)

UNIT = f"/etc/systemd/system/{SERVICE}.service"
API_KEY = "sk-gf-rollback-51d0e2"  # /v1/models is key-guarded: the checks must send it inside the SSH channel
# A short deadline: the broken images fail in seconds; a bug that waits for the timeout fails the test quickly.
DATA = {"vllm_ready_timeout": 60, "vllm_ready_soak_s": 20, "vllm_api_key": API_KEY}


@pytest.fixture(scope="module")
def host(module_host):
    """One fresh 3x H200 host for the module's steps, deleted after them."""
    return module_host


@pytest.fixture(scope="module")
def data() -> dict:
    """The host's settings for run()."""
    return DATA


@pytest.fixture(scope="module")
def run(host, fleet, pyinfra, tmp_path_factory, data):
    """run(tag) -> (pyinfra output, rc, seconds): converge the host with vllm_image at that stand-in tag."""
    tmp = tmp_path_factory.mktemp("rollback")

    def converge(tag: str):
        inv = write_inventory(
            tmp, fleet.write_inventory(), [host.name], {host.name: {**data, "vllm_image": image_ref(fleet.cfg, tag)}}
        )
        start = time.monotonic()
        proc = deploy(pyinfra, inv, check=False)
        return proc.stdout, proc.returncode, time.monotonic() - start

    return converge


@pytest.fixture(scope="module")
def good(run, host, fleet):
    """The host serving the good image; its pinned digest."""
    out, rc, _ = run("good")
    assert rc == 0, out[-4000:]
    return committed_ref(fleet, host)


def health_over_ssh(host, fleet) -> tuple[HealthState, str]:
    """gpufleet.health.check through the host's SSH (the deploy's own view), with the API key."""
    doc = json.loads(Path(fleet.write_inventory()).read_text())
    data = {**doc["host_data"], "ssh_hostname": host.ip, **DATA}
    client = open_ssh(host.name, data).client
    try:
        report = check(
            SshTransport(client, name=host.name), Expected.from_spec(build_spec(host.name, data)), api_key=API_KEY
        )
        return report.state, report.detail
    finally:
        client.close()


def kept_unit(fleet, host) -> bytes:
    """The committed unit's copy, the one the ledger names by its checksum."""
    doc = ledger(fleet, host)
    return fleet.read_file(host, committed_unit(SERVICE, doc["committed"]["unit_sha256"]))


def assert_rolled_back(out: str, rc: int, host, fleet, good: str, caught: str) -> dict:
    assert rc != 0, out[-4000:]
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith(f"{host.name}: new image ")]
    assert len(lines) == 1, out[-4000:]
    assert re.search(
        rf"failed verification \(dead: .*{caught}.*\); rolled back to {re.escape(good)}, which is "
        r"ready \(fix: ",
        lines[0],
    ), lines[0]
    assert any(
        line.strip().startswith(f"[{host.name}]   | ") for line in out.splitlines()
    )  # the failed container's log
    assert API_KEY not in out
    # Serving the previous digest again, through the same checks the deploy uses.
    assert sh(fleet, host, f"systemctl is-active {SERVICE}").strip() == "active"
    assert running_image(fleet, host) == good
    assert f" {good} " in fleet.read_file(host, UNIT).decode()
    assert health_over_ssh(host, fleet)[0] is HealthState.READY
    doc = ledger(fleet, host)
    assert fleet.read_file(host, UNIT) == kept_unit(fleet, host)  # the kept unit is the one restored
    assert doc["committed"]["ref"] == good and doc["pending"] is None
    assert doc["failed"][-1]["ref"] != good and doc["failed"][-1]["reason"].startswith("dead: ")
    return doc


def test_an_image_that_rejects_a_serve_flag_is_caught_before_the_unit_changes(good, run, host, fleet):
    pid = sh(fleet, host, f"systemctl show -p MainPID --value {SERVICE}").strip()
    before = fleet.read_file(host, STATE_FILE)
    out, rc, seconds = run("rejects-flag")
    assert rc != 0, out[-4000:]
    lines = [line.strip() for line in out.splitlines() if f"{host.name}: image " in line and " rejects " in line]
    assert lines and "--performance-mode" in lines[0], out[-4000:]
    # The old version kept serving: same process, same unit, the ledger untouched.
    assert sh(fleet, host, f"systemctl show -p MainPID --value {SERVICE}").strip() == pid
    assert running_image(fleet, host) == good and f" {good} " in fleet.read_file(host, UNIT).decode()
    assert fleet.read_file(host, STATE_FILE) == before
    assert seconds < DATA["vllm_ready_timeout"], seconds


def test_an_image_whose_engine_dies_after_ready_is_caught_by_the_soak_and_rolled_back(good, run, host, fleet):
    out, rc, _ = run("dies")
    assert f"[{host.name}] ready: " in out and "watching it for 20 s" in out  # it did get ready first
    doc = assert_rolled_back(out, rc, host, fleet, good, caught=r"s after it was ready")
    assert [f["reason"][:5] for f in doc["failed"]] == ["dead:"] and doc["history"] == []


def test_the_good_image_again_after_a_rollback_changes_nothing(good, run, host, fleet):
    pid = sh(fleet, host, f"systemctl show -p MainPID --value {SERVICE}").strip()
    out, rc, _ = run("good")
    assert rc == 0, out[-4000:]
    assert changes(out) == 0, changed_ops(out)
    assert sh(fleet, host, f"systemctl show -p MainPID --value {SERVICE}").strip() == pid
    assert committed_ref(fleet, host) == good
