"""The pending/commit ledger on a real test host (nspawn, SSH, systemd, dockerd, the stand-in images): each named
fault of docs/crash-safety.md that the ledger settles, injected as it happens in a fleet.

One fresh host, steps in file order (pytest keeps it): converge on `good` -> a corrupt ledger -> a pull whose model
step fails -> gpufleet_image_ref pins a digest -> gpufleet_stage=prepare -> the controller killed during the soak
of an image that dies -> gpufleet_verify_probe -> a port change that fails verification -> a service rename that
fails verification (the host ends on its old name) -> a service rename -> a rename back cut during its soak (the
host ends on its first name).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest

from gpufleet.sandbox.image import REPOSITORY, image_ref
from gpufleet.sandbox.inventory import pyinfra_hosts
from gpufleet.vllm.layout import Layout
from gpufleet.vllm.settings import build_spec
from tests.integration.conftest import PYINFRA
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.test_deploy_qwen35 import (
    DEPLOY,
    SERVICE,
    STATE_FILE,
    TEST_DATA,
    committed_ref,
    deploy,
    ledger,
    running_image,
    sh,
    write_inventory,
)  # fmt: skip

UNIT = f"/etc/systemd/system/{SERVICE}.service"
DATA = {"vllm_ready_timeout": 60, "vllm_ready_soak_s": 5}
PORT = 5000  # the sandbox's vllm_port (the default)


@pytest.fixture(scope="module")
def host(module_host):
    return module_host


@pytest.fixture(scope="module")
def inventory(host, fleet, tmp_path_factory):
    """inventory(**settings) -> a pyinfra inventory of the host with these settings over DATA (vllm_image: good)."""
    tmp = tmp_path_factory.mktemp("ledger")

    def write(**settings):
        data = {**DATA, "vllm_image": image_ref(fleet.cfg, "good"), **settings}
        return write_inventory(tmp, fleet.write_inventory(), [host.name], {host.name: data})

    return write


def digest_of(fleet, tag: str) -> str:
    """repo@sha256:... of a stand-in tag, from the fleet's registry (what `docker pull` would resolve it to)."""
    request = urllib.request.Request(
        f"http://{fleet.cfg.registry}/v2/{REPOSITORY}/manifests/{tag}",
        method="HEAD",
        headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"
        },
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return f"{fleet.cfg.registry}/{REPOSITORY}@{answer.headers['Docker-Content-Digest']}"


def container_ids(fleet, host) -> list[str]:
    """Every running container gpufleet started (any service's label)."""
    out = sh(fleet, host, "docker ps --no-trunc --format '{{.ID}} {{.Labels}}'")
    return sorted(line.split()[0] for line in out.splitlines() if "gpufleet." in line)


def main_pid(fleet, host, service: str = SERVICE) -> str:
    return sh(fleet, host, f"systemctl show -p MainPID --value {service}").strip()


def health_on(fleet, host, port: int) -> str:
    return sh(
        fleet, host, f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 3 http://127.0.0.1:{port}/health || true"
    ).strip()


def one_line(out: str, host, *parts: str) -> str:
    lines = [
        line.strip()
        for line in out.splitlines()
        if line.strip().startswith(f"{host.name}: ") and all(p in line for p in parts)
    ]
    assert len(lines) == 1, out[-4000:]
    return lines[0]


@pytest.fixture(scope="module")
def good(host, fleet, inventory, pyinfra):
    """The host converged and verified on the good image; its committed digest."""
    deploy(pyinfra, inventory())
    return committed_ref(fleet, host)


def test_a_corrupt_ledger_is_refused_before_any_change_and_left_untouched(good, host, fleet, inventory, pyinfra):
    whole = fleet.read_file(host, STATE_FILE)
    cut = whole[: len(whole) // 2]  # a write cut in half, as by a full disk or an editor
    fleet.run_in(host, f"head -c {len(cut)} {STATE_FILE} > /tmp/cut && cat /tmp/cut > {STATE_FILE}")
    pid = main_pid(fleet, host)
    try:
        proc = deploy(pyinfra, inventory(vllm_args={"max-num-seqs": 8}), check=False)
        assert proc.returncode != 0, proc.stdout[-4000:]
        line = one_line(proc.stdout, host, f"{STATE_FILE} is corrupt: not JSON")
        assert "(fix: repair it by hand, or move it away" in line and "nothing was changed" in proc.stdout
        assert fleet.read_file(host, STATE_FILE) == cut  # byte for byte
        assert main_pid(fleet, host) == pid and f" {good} " in fleet.read_file(host, UNIT).decode()
    finally:
        put_back(fleet, host, STATE_FILE, whole)
    assert changes(deploy(pyinfra, inventory()).stdout) == 0


def put_back(fleet, host, path: str, content: bytes) -> None:
    fleet.run_in(host, f"echo {base64.b64encode(content).decode()} | base64 -d > {path}")
    assert fleet.read_file(host, path) == content


def test_a_pull_whose_model_step_fails_leaves_the_ledger_naming_the_running_digest(
    good, host, fleet, inventory, pyinfra
):
    other = digest_of(fleet, "not-http")  # any digest not on the host yet: the pull must run
    spec = build_spec(
        host.name,
        {
            **TEST_DATA,
            **dict(pyinfra_hosts(str(fleet.write_inventory())))[host.name],
            **DATA,
            "vllm_image": image_ref(fleet.cfg, "good"),
        },
    )
    model_dir = Layout.of(spec, "/var/cache/vllm").model_dir
    before, pid = fleet.read_file(host, STATE_FILE), main_pid(fleet, host)
    fleet.run_in(host, f"mv {model_dir}/config.json /tmp/config.json.kept")
    try:
        proc = deploy(pyinfra, inventory(gpufleet_image_ref=other, vllm_model_repo="nobody/no-such-model"), check=False)
        assert proc.returncode != 0, proc.stdout[-4000:]
        assert f"pinned {image_ref(fleet.cfg, 'good')} -> {other}" in proc.stdout  # the pull ran
        assert "cannot read nobody/no-such-model at its default branch from the hub" in proc.stdout
        assert fleet.read_file(host, STATE_FILE) == before and committed_ref(fleet, host) == good
        assert main_pid(fleet, host) == pid and running_image(fleet, host) == good
    finally:
        fleet.run_in(host, f"mv /tmp/config.json.kept {model_dir}/config.json")
    assert changes(deploy(pyinfra, inventory()).stdout) == 0


def test_gpufleet_image_ref_installs_that_digest_and_a_plain_converge_then_changes_nothing(
    good, host, fleet, inventory, pyinfra
):
    nxt = digest_of(fleet, "good-next")
    assert nxt != good
    out = deploy(pyinfra, inventory(gpufleet_image_ref=nxt)).stdout
    assert f"committed {nxt}" in out and running_image(fleet, host) == nxt
    doc = ledger(fleet, host)
    assert doc["committed"]["image"] == image_ref(fleet.cfg, "good") and doc["committed"]["ref"] == nxt
    assert [h["ref"] for h in doc["history"]] == [good]
    again = deploy(pyinfra, inventory()).stdout  # without the setting: the pin is the installed digest
    assert changes(again) == 0, changed_ops(again)
    assert running_image(fleet, host) == nxt


def test_prepare_pulls_and_checks_without_restarting_or_touching_the_ledger(good, host, fleet, inventory, pyinfra):
    dies = digest_of(fleet, "dies")
    containers, before, unit = (
        container_ids(fleet, host),
        fleet.read_file(host, STATE_FILE),
        fleet.read_file(host, UNIT),
    )
    out = deploy(pyinfra, inventory(gpufleet_image_ref=dies, gpufleet_stage="prepare")).stdout
    ops = changed_ops(out)
    assert "Pull the vLLM image and pin its digest" in ops and "Check the image accepts the serve flags" in ops
    assert not {"Install the vLLM systemd unit", "Enable and start the vLLM service"} & set(ops), ops
    assert dies.split("@")[1] in sh(fleet, host, "docker images --digests --no-trunc")
    assert container_ids(fleet, host) == containers
    assert fleet.read_file(host, STATE_FILE) == before and fleet.read_file(host, UNIT) == unit
    # Up to date: a prepare of what runs changes nothing.
    again = deploy(pyinfra, inventory(gpufleet_stage="prepare")).stdout
    assert changes(again) == 0, changed_ops(again)


def at_rest_and_refusing_again(
    fleet, host, pyinfra, plain_inventory, failed_inventory, failed: str, committed: str
) -> str:
    """After a rollback: a plain converge changes nothing, and the failed version asked for again is refused at
    preflight with the service untouched. Returns the refusal line."""
    plain = deploy(pyinfra, plain_inventory).stdout
    assert changes(plain) == 0, changed_ops(plain)
    pid = main_pid(fleet, host)
    again = deploy(pyinfra, failed_inventory, check=False)
    assert again.returncode != 0
    refused = one_line(again.stdout, host, f"{failed} with spec ", " failed at ")
    assert "gpufleet_retry_failed=true" in refused and "nothing was changed" in again.stdout
    assert main_pid(fleet, host) == pid and running_image(fleet, host) == committed
    return refused


def killed_during_the_soak(inv, soak_s: int) -> None:
    """Converge `inv` and SIGKILL the controller once the new version is on probation (its soak began)."""
    proc = subprocess.Popen(
        [PYINFRA, "-y", str(inv), DEPLOY], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if f"watching it for {soak_s} s" in line:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-4000:]


def test_killed_during_the_soak_of_an_image_that_dies_is_rolled_back_by_the_next_run(
    good, host, fleet, inventory, pyinfra
):
    committed, dies = committed_ref(fleet, host), digest_of(fleet, "dies")  # `dies`: ready ~8 s, then exits 1
    inv = inventory(gpufleet_image_ref=dies, vllm_ready_soak_s=120)
    killed_during_the_soak(inv, 120)
    doc = ledger(fleet, host)
    assert doc["pending"]["ref"] == dies and doc["committed"]["ref"] == committed
    # The engine dies and systemd restarts it: the unverified version is failing on its own.
    deadline = time.monotonic() + 90
    while int(sh(fleet, host, f"systemctl show -p NRestarts --value {SERVICE}").strip() or 0) < 1:
        assert time.monotonic() < deadline, "the dying image was never restarted by systemd"
        time.sleep(2)

    rerun = deploy(pyinfra, inv, check=False)
    assert rerun.returncode != 0, rerun.stdout[-4000:]
    # Settled first: rolled back at once (systemd restarted it), or finished (verified again) and then rolled back.
    settled = re.search(
        r"cut change by \S+ pid \d+ since \S+: .*(rolling it back|restarting and verifying it)", rerun.stdout
    )
    assert settled, rerun.stdout[-4000:]
    line = one_line(rerun.stdout, host, f"new image {dies} failed verification")
    assert re.search(rf"; rolled back to {re.escape(committed)}, which is ready \(fix: ", line), line
    assert running_image(fleet, host) == committed and health_on(fleet, host, PORT) == "200"
    doc = ledger(fleet, host)
    assert doc["pending"] is None and doc["committed"]["ref"] == committed and doc["failed"][-1]["ref"] == dies

    at_rest_and_refusing_again(fleet, host, pyinfra, inventory(), inv, dies, committed)


def test_verify_probe_rolls_back_a_version_whose_prefix_cache_does_not_work(good, host, fleet, inventory, pyinfra):
    committed, unit = committed_ref(fleet, host), fleet.read_file(host, UNIT)
    out = deploy(
        pyinfra, inventory(gpufleet_verify_probe=True, vllm_args={"enable-prefix-caching": False}), check=False
    ).stdout
    line = one_line(
        out,
        host,
        f"new settings (same image {committed}) failed verification (misconfigured: check "
        "prefix-cache: probe ineffective",
    )
    assert f"rolled back to {committed}, which is ready" in line
    mark = ledger(fleet, host)["failed"][-1]
    assert (
        fleet.read_file(host, UNIT) == unit
        and mark["reason"].startswith("misconfigured: check prefix-cache: probe ineffective")
        and mark["check"] == "prefix-cache"
    )
    passed = deploy(pyinfra, inventory(gpufleet_verify_probe=True, vllm_args={"max-num-seqs": 6})).stdout
    assert f"[{host.name}] serving check prefix-cache: probe effective" in passed
    assert f"committed {committed}" in passed


def test_a_port_change_that_fails_verification_rolls_back_to_the_old_ports_unit(good, host, fleet, inventory, pyinfra):
    committed, dies = committed_ref(fleet, host), digest_of(fleet, "dies")
    unit = fleet.read_file(host, UNIT)
    out = deploy(
        pyinfra, inventory(vllm_port=PORT + 1, gpufleet_image_ref=dies, vllm_ready_soak_s=20), check=False
    ).stdout
    line = one_line(out, host, f"new image {dies} failed verification")
    assert f"rolled back to {committed}, which is ready" in line
    assert fleet.read_file(host, UNIT) == unit and f"port {PORT})" in unit.decode()
    assert health_on(fleet, host, PORT) == "200" and health_on(fleet, host, PORT + 1) != "200"
    assert running_image(fleet, host) == committed
    assert ledger(fleet, host)["committed"]["port"] == PORT and ledger(fleet, host)["pending"] is None


def test_a_renamed_service_that_fails_verification_puts_the_old_service_back(good, host, fleet, inventory, pyinfra):
    """vllm_service renamed together with an image that dies after ready: the old service serves again from its
    own unit, the new one is gone, the old ledger marks the failed version, and asking for it again is refused."""
    deploy(pyinfra, inventory())  # the inventory's own settings committed (earlier steps leave others)
    committed, dies, renamed = committed_ref(fleet, host), digest_of(fleet, "dies"), "vllm-renamed"
    unit, before = fleet.read_file(host, UNIT), ledger(fleet, host)
    new_unit = f"/etc/systemd/system/{renamed}.service"
    inv = inventory(vllm_service=renamed, gpufleet_image_ref=dies, vllm_ready_soak_s=20)
    proc = deploy(pyinfra, inv, check=False)
    assert proc.returncode != 0, proc.stdout[-4000:]
    line = one_line(proc.stdout, host, f"new image {dies} failed verification")
    assert f"rolled back to {committed}, which is ready" in line
    # The old service serves again: its own unit byte for byte, enabled and active, the committed digest on its port.
    assert fleet.read_file(host, UNIT) == unit
    assert sh(fleet, host, f"systemctl is-enabled {SERVICE}; systemctl is-active {SERVICE}").split() == [
        "enabled",
        "active",
    ]
    assert running_image(fleet, host) == committed and health_on(fleet, host, PORT) == "200"
    # The new service is gone: no unit file, nothing systemd still loads or runs of it; one vLLM container runs.
    assert sh(fleet, host, f"test -e {new_unit} && echo left || echo gone").strip() == "gone"
    assert sh(fleet, host, f"systemctl show -p LoadState -p ActiveState {renamed}").split() == [
        "LoadState=not-found",
        "ActiveState=inactive",
    ]
    assert len(container_ids(fleet, host)) == 1
    doc = ledger(fleet, host)
    assert doc["committed"] == before["committed"] and doc["pending"] is None

    refused = at_rest_and_refusing_again(fleet, host, pyinfra, inventory(), inv, dies, committed)  # the old name
    assert sh(fleet, host, f"test -e {new_unit} && echo left || echo gone").strip() == "gone"
    # The failure is marked where the committed version lives, and the new service keeps no file of its own (it
    # never committed anything): a later run of either name reads the one ledger.
    failed = ledger(fleet, host)["failed"]  # earlier steps marked dies under the old name's specs: one mark more
    assert failed[:-1] == before["failed"] and [f["ref"] for f in failed[len(before["failed"]) :]] == [dies], failed
    assert f"{dies} with spec {failed[-1]['spec_hash']} and model {failed[-1]['model']} failed at " in refused
    assert sh(fleet, host, f"ls /var/lib/gpufleet/{renamed}.* /etc/gpufleet/{renamed}.* 2>/dev/null || true") == ""


def test_a_renamed_service_replaces_the_old_unit_once_verified_and_one_container_runs(
    good, host, fleet, inventory, pyinfra
):
    committed, renamed = committed_ref(fleet, host), "vllm-renamed"
    out = deploy(pyinfra, inventory(vllm_service=renamed)).stdout
    assert f"{SERVICE}.service replaced by {renamed}.service: stopped, disabled and removed" in out
    assert sh(fleet, host, f"systemctl is-active {renamed}").strip() == "active"
    assert sh(fleet, host, f"systemctl show -p LoadState --value {SERVICE}").strip() == "not-found"
    assert sh(fleet, host, f"test -e {UNIT} && echo left || echo gone").strip() == "gone"
    assert sh(fleet, host, f"test -e {STATE_FILE} && echo left || echo gone").strip() == "gone"
    # Nothing of the old service is left: its secrets file and flag check note go with its unit and ledger.
    assert sh(fleet, host, f"ls /var/lib/gpufleet/{SERVICE}.* /etc/gpufleet/{SERVICE}.* 2>/dev/null || true") == ""
    assert len(container_ids(fleet, host)) == 1 and running_image(fleet, host) == ""  # none under the old label
    doc = ledger(fleet, host, renamed)
    assert doc["committed"]["service"] == renamed and doc["committed"]["ref"] == committed
    assert doc["history"][-1]["service"] == SERVICE  # the rollback point it replaced
    unit = fleet.read_file(host, f"/etc/systemd/system/{renamed}.service")
    assert doc["committed"]["unit_sha256"] == hashlib.sha256(unit).hexdigest()
    again = deploy(pyinfra, inventory(vllm_service=renamed)).stdout
    assert changes(again) == 0, changed_ops(again)


def test_a_cut_rename_is_refused_for_the_name_it_left_and_finished_by_the_new_one(
    good, host, fleet, inventory, pyinfra
):
    # The host runs vllm-renamed (the step above). Renaming back to SERVICE is cut while SERVICE is on probation:
    # SERVICE's ledger (the old one taken over) holds vllm-renamed committed and SERVICE pending.
    renamed = "vllm-renamed"
    committed = committed_ref(fleet, host, renamed)
    killed_during_the_soak(inventory(vllm_ready_soak_s=120), 120)
    doc = ledger(fleet, host)
    assert (doc["committed"]["service"], doc["pending"]["service"]) == (renamed, SERVICE)
    assert sh(fleet, host, f"systemctl is-active {SERVICE} {renamed} || true").split() == ["active", "inactive"]

    # Converging the name the rename left would start it next to SERVICE, on the same GPUs: refused.
    refused = deploy(pyinfra, inventory(vllm_service=renamed), check=False)
    assert refused.returncode != 0 and "nothing was changed" in refused.stdout
    line = one_line(refused.stdout, host, f"a run renaming vllm_service '{renamed}' to '{SERVICE}' was cut")
    assert f"converge once with vllm_service='{SERVICE}'" in line
    assert sh(fleet, host, f"systemctl is-active {SERVICE} {renamed} || true").split() == ["active", "inactive"]
    assert len(container_ids(fleet, host)) == 1

    # The new name finishes it: verified, committed, the old service removed; then nothing to do.
    deploy(pyinfra, inventory())
    doc = ledger(fleet, host)
    assert doc["committed"]["service"] == SERVICE and doc["committed"]["ref"] == committed and doc["pending"] is None
    assert sh(fleet, host, f"ls /var/lib/gpufleet/{renamed}.* /etc/gpufleet/{renamed}.* 2>/dev/null || true") == ""
    assert len(container_ids(fleet, host)) == 1 and health_on(fleet, host, PORT) == "200"
    again = deploy(pyinfra, inventory()).stdout
    assert changes(again) == 0, changed_ops(again)
