"""Named faults on a real test host (nspawn, SSH, systemd, dockerd): each is injected as it happens in a fleet, and
the host must end serving what was verified. docs/crash-safety.md lists them.

One fresh host, steps in file order (pytest keeps it): converge -> unit uploaded but never loaded -> a container
started from another spec -> reboot -> a wedged nvidia-smi (last: it leaves the host unable to pass preflight until
the stand-in is mended).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.sandbox.image import image_ref
from gpufleet.sandbox.inventory import pyinfra_hosts
from gpufleet.sandbox.nvidia_smi import HOST_PROFILE
from gpufleet.vllm.host_command import COMMAND_TIMEOUT_S
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.unit import render_unit
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.test_deploy_qwen35 import (
    SERVICE,
    TEST_DATA,
    committed_ref,
    deploy,
    running_image,
    sh,
    write_inventory,
)  # fmt: skip

GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
UNIT = f"/etc/systemd/system/{SERVICE}.service"
DATA = {"vllm_ready_timeout": 60, "vllm_ready_soak_s": 5}
CHANGED = {"vllm_args": {"max-num-seqs": 8}}  # any setting that changes the spec (and so the unit)


@pytest.fixture(scope="module")
def host(module_host):
    return module_host


@pytest.fixture(scope="module")
def inventory(host, fleet, tmp_path_factory):
    """inventory(**settings) -> a pyinfra inventory of the host with these settings over DATA."""
    tmp = tmp_path_factory.mktemp("crash")

    def write(**settings):
        data = {**DATA, "vllm_image": image_ref(fleet.cfg, "good"), **settings}
        return write_inventory(tmp, fleet.write_inventory(), [host.name], {host.name: data})

    return write


def spec_for(host, fleet, **settings):
    """The ServeSpec the deploy builds for the host with these settings (the same merge as write_inventory)."""
    data = dict(pyinfra_hosts(str(fleet.write_inventory())))[host.name]
    return build_spec(host.name, {**TEST_DATA, **data, **DATA, "vllm_image": image_ref(fleet.cfg, "good"), **settings})


def container_label(fleet, host) -> str:
    ids = f"$(docker ps -q --filter label=gpufleet.{SERVICE})"
    fmt = f"'{{{{index .Config.Labels \"gpufleet.{SERVICE}\"}}}}'"
    return sh(fleet, host, f'[ -n "{ids}" ] && docker inspect --format {fmt} {ids} || true').strip()


def unit_show(fleet, host, prop: str) -> str:
    return sh(fleet, host, f"systemctl show -p {prop} --value {SERVICE}").strip()


def put_file(fleet, host, path: str, text: str) -> None:
    """Write text to path in place, as a plain upload (or a hand edit) does."""
    fleet.run_in(host, f"echo {base64.b64encode(text.encode()).decode()} | base64 -d > {path}")


def gpufleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GPUFLEET, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


def wait_for_label(fleet, host, label: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while container_label(fleet, host) != label:
        assert time.monotonic() < deadline, f"no container labelled {label} within {timeout_s} s"
        time.sleep(1)


@pytest.fixture(scope="module")
def good(host, fleet, inventory, pyinfra):
    """The host converged and verified on the good image; its pinned digest."""
    deploy(pyinfra, inventory())
    return committed_ref(fleet, host)


def test_ssh_cut_after_the_unit_upload_before_the_restart(good, host, fleet, inventory, pyinfra):
    # The cut run got as far as the upload: the new unit is on disk, systemd never reloaded, nothing restarted.
    old = container_label(fleet, host)
    new = spec_for(host, fleet, **CHANGED)
    model = json.loads(fleet.read_file(host, f"/var/lib/gpufleet/{new.service}.json"))["committed"]["model"]
    put_file(fleet, host, UNIT, render_unit(new, good, model))
    assert unit_show(fleet, host, "NeedDaemonReload") == "yes" and container_label(fleet, host) == old != new.spec_hash

    out = deploy(pyinfra, inventory(**CHANGED)).stdout
    assert changed_ops(out).get("Enable and start the vLLM service") == 1, changed_ops(out)
    assert "does not run what its unit says (systemd has not loaded the unit file on disk" in out
    assert f"[{host.name}] ready: " in out and "watching it for 5 s" in out  # verified, with the soak
    assert container_label(fleet, host) == new.spec_hash and running_image(fleet, host) == good
    assert unit_show(fleet, host, "NeedDaemonReload") == "no"

    again = deploy(pyinfra, inventory(**CHANGED)).stdout
    assert changes(again) == 0, changed_ops(again)


def test_a_container_started_from_another_spec_fails_verify_and_converge_fixes_it(
    good, host, fleet, inventory, pyinfra
):
    # A unit edited by hand and restarted, then its file put back (systemd reloaded): every file on disk matches,
    # only the running container's label tells.
    spec = spec_for(host, fleet, **CHANGED)
    unit = fleet.read_file(host, UNIT).decode()
    assert f"={spec.spec_hash}" in unit
    put_file(fleet, host, UNIT, unit.replace(f"={spec.spec_hash}", "=handmade"))
    fleet.run_in(host, f"systemctl daemon-reload && systemctl restart {SERVICE}")
    wait_for_label(fleet, host, "handmade")
    put_file(fleet, host, UNIT, unit)
    fleet.run_in(host, "systemctl daemon-reload")

    inv = str(inventory(**CHANGED))
    failed = gpufleet("verify", inv, "--wait", "60")  # until the hand-started server answers: drift is final
    assert failed.returncode == 1, failed.stdout
    assert f"{host.name}: misconfigured: drift: container " in failed.stdout, failed.stdout
    assert f"runs spec handmade, the inventory's spec is {spec.spec_hash} (fix: converge the host)" in failed.stdout
    assert "(drift)" in gpufleet("status", inv).stdout

    out = deploy(pyinfra, inventory(**CHANGED)).stdout
    assert changes(out) > 0 and f"[{host.name}] ready: " in out
    assert container_label(fleet, host) == spec.spec_hash
    passed = gpufleet("verify", inv)
    assert passed.returncode == 0, passed.stdout


def test_reboot_after_a_converge_comes_back_on_the_committed_digest(good, host, fleet, inventory):
    fleet.reboot(host)
    inv = str(inventory(**CHANGED))
    ready = gpufleet("verify", inv, "--wait", "120")
    assert ready.returncode == 0, ready.stdout
    committed = committed_ref(fleet, host)
    assert committed == good and running_image(fleet, host) == committed
    assert container_label(fleet, host) == spec_for(host, fleet, **CHANGED).spec_hash


def test_a_hanging_nvidia_smi_ends_preflight_within_its_bound_with_one_line(good, host, fleet, inventory, pyinfra):
    profile = json.loads(fleet.read_file(host, HOST_PROFILE))
    pid = unit_show(fleet, host, "MainPID")
    put_file(fleet, host, HOST_PROFILE, json.dumps({**profile, "hang": True}) + "\n")
    try:
        start = time.monotonic()
        proc = deploy(pyinfra, inventory(**CHANGED), check=False)
        elapsed = time.monotonic() - start
    finally:
        put_file(fleet, host, HOST_PROFILE, json.dumps(profile) + "\n")
    assert proc.returncode != 0, proc.stdout[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith(f"{host.name}: ")]
    assert len(lines) == 1, proc.stdout[-4000:]
    assert f"nvidia-smi did not answer within {COMMAND_TIMEOUT_S} s" in lines[0]
    assert "nothing was changed" in proc.stdout
    # The bound (plus SSH and pyinfra's start), not the hang: `timeout -k 2` killed the SIGTERM-proof stand-in.
    assert elapsed < COMMAND_TIMEOUT_S + 40, elapsed
    assert unit_show(fleet, host, "MainPID") == pid  # the service was not touched
    assert not sh(fleet, host, "pgrep -f 'gpufleet-standi[n]/nvidia_smi.py' || true").strip()
