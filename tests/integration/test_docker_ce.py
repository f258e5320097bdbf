"""The default Docker path (`docker_install: docker-ce`, from the signed stand-in of Docker's repo: Debian's real
dockerd, containerd and runc under Docker's package names) on fresh hosts, and preflight refusing what a deploy would
damage: another Docker engine under running containers, a unit gpufleet did not create.

Each refusal is checked the way the other preflight refusals are: one line naming host, setting and fix, no
operation started, and the host's fingerprint (packages, sources, keyrings, units, files) unchanged.
"""

from __future__ import annotations

import json
import re
import shlex
import urllib.request

import pytest

from gpufleet.sandbox.config import H200x3
from gpufleet.vllm.operations.docker import DOCKER_KEY, DOCKER_LIST
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.test_deploy_qwen35 import (
    SERVICE,
    STATE_FILE,
    deploy,
    fingerprint,
    running_image,
    service_pid,
    sh,
    write_inventory,
)

# The soak is proven in test_deploy_rollback; here a ready service is enough.
QUICK = {"vllm_ready_soak_s": 0}
FOREIGN = "billing"  # an operator's own unit, a name settings cannot know


def refused(proc, host) -> str:
    """The host's one refusal line, after checking the run stopped before any operation."""
    assert proc.returncode != 0
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith(f"{host.name}:")]
    assert len(lines) == 1, proc.stdout[-3000:]
    assert "nothing was changed on any host" in proc.stdout and "Starting operation" not in proc.stdout
    return lines[0]


def packages(fleet, host) -> dict[str, str]:
    out = sh(
        fleet,
        host,
        "dpkg-query -W -f '${Package} ${db:Status-Abbrev}${Version}\\n' docker.io containerd "
        "docker-ce docker-ce-cli containerd.io 2>/dev/null || true",
    )
    return {p: v for p, status, v in (line.split(" ", 2) for line in out.splitlines()) if status.strip() == "ii"}


@pytest.fixture(scope="module")
def ce_inventory(module_host, fleet, tmp_path_factory):
    def inventory(**overrides):
        return write_inventory(
            tmp_path_factory.mktemp("inv"),
            fleet.write_inventory(),
            [module_host.name],
            {module_host.name: {**QUICK, **overrides}},
        )

    return inventory


@pytest.fixture(scope="module")
def ce_converged(module_host, ce_inventory, pyinfra) -> str:
    """The first converge of a bare host on the default path (the inventory's docker_install is docker-ce)."""
    return deploy(pyinfra, ce_inventory()).stdout


def test_docker_ce_from_the_signed_repo_converges_a_bare_host(ce_converged, module_host, fleet):
    host, url = module_host, fleet.cfg.docker_repo_url
    assert "Install the Docker engine" in changed_ops(ce_converged) and "ready: /health 200" in ce_converged
    installed = packages(fleet, host)
    assert set(installed) == {"docker-ce", "docker-ce-cli", "containerd.io"}, installed
    # Docker's documented source line and key, and apt installed docker-ce from that repo
    assert fleet.read_file(host, DOCKER_LIST).decode() == (
        f"deb [arch=amd64 signed-by={DOCKER_KEY}] {url}/debian bookworm stable\n"
    )
    with urllib.request.urlopen(f"{url}/debian/gpg", timeout=5) as served:
        assert fleet.read_file(host, DOCKER_KEY) == served.read()
    policy = sh(fleet, host, "apt-cache policy docker-ce")
    assert re.search(
        rf"\*\*\* {re.escape(installed['docker-ce'])} 500\n\s+500 {re.escape(url)}/debian bookworm/stable "
        r"amd64 Packages",
        policy,
    ), policy
    # the engine that runs is docker-ce's, with Docker's unit names, and it runs the service's container
    assert (
        sh(fleet, host, "systemctl is-active docker.socket containerd.service docker.service").split() == ["active"] * 3
    )
    assert sh(fleet, host, "readlink /proc/$(systemctl show -p MainPID --value docker.service)/exe").strip() == (
        "/usr/bin/dockerd"
    )
    assert "nvidia" in json.loads(sh(fleet, host, "docker info --format '{{json .Runtimes}}'"))
    assert running_image(fleet, host) == json.loads(fleet.read_file(host, STATE_FILE))["committed"]["ref"]


def test_docker_ce_second_converge_changes_nothing(ce_converged, ce_inventory, pyinfra):
    out = deploy(pyinfra, ce_inventory()).stdout
    assert changes(out) == 0, changed_ops(out)


def test_distro_docker_on_a_docker_ce_host_is_refused(ce_converged, module_host, ce_inventory, fleet, pyinfra):
    before, pid = fingerprint(fleet, module_host), service_pid(fleet, module_host)
    line = refused(deploy(pyinfra, ce_inventory(docker_install="distro"), check=False), module_host)
    assert re.fullmatch(
        rf"{module_host.name}: docker_install is 'distro', but docker-ce \S+, containerd\.io \S+ are installed: apt would "
        r"remove them to install docker\.io, stopping every container on this host \(fix: set docker_install to "
        r"'docker-ce' for this host to keep them, or remove docker-ce containerd\.io by hand first\)",
        line,
    ), line
    assert fingerprint(fleet, module_host) == before and service_pid(fleet, module_host) == pid


def test_a_unit_gpufleet_did_not_create_is_refused(ce_converged, module_host, ce_inventory, fleet, pyinfra):
    unit = f"/etc/systemd/system/{FOREIGN}.service"
    text = "[Unit]\nDescription=an operator's own service\n[Service]\nExecStart=/bin/sleep infinity\n"
    fleet.run_in(
        module_host, f"printf %s {shlex.quote(text)} > {unit} && systemctl daemon-reload && systemctl start {FOREIGN}"
    )
    try:
        before = fingerprint(fleet, module_host)
        pid = sh(fleet, module_host, f"systemctl show -p MainPID --value {FOREIGN}").strip()
        line = refused(deploy(pyinfra, ce_inventory(vllm_service=FOREIGN), check=False), module_host)
        assert line == (
            f"{module_host.name}: vllm_service '{FOREIGN}' is {FOREIGN}.service, a unit gpufleet did not "
            f"create ({unit}): the deploy would replace and restart it (fix: set vllm_service to a name "
            "no unit on this host uses yet (gpufleet then creates that unit))"
        )
        assert fingerprint(fleet, module_host) == before
        assert fleet.read_file(module_host, unit).decode() == text
        assert sh(fleet, module_host, f"systemctl show -p MainPID --value {FOREIGN}").strip() == pid != "0"
    finally:
        fleet.run_in(module_host, f"systemctl stop {FOREIGN}; rm -f {unit}; systemctl daemon-reload")


def test_distro_docker_under_docker_ce_is_refused_and_its_service_keeps_running(fresh_hosts, fleet, pyinfra, tmp_path):
    """A host that runs the service on the distribution's Docker (the distro path, converged for real here) is not
    switched to docker-ce behind its back: apt would remove docker.io with the service's container on it."""
    (host,) = fresh_hosts(H200x3)
    inventory = fleet.write_inventory()
    out = deploy(
        pyinfra, write_inventory(tmp_path, inventory, [host.name], {host.name: {**QUICK, "docker_install": "distro"}})
    ).stdout
    assert "ready: /health 200" in out
    assert set(packages(fleet, host)) == {"docker.io", "containerd"}
    before, pid, image = fingerprint(fleet, host), service_pid(fleet, host), running_image(fleet, host)

    line = refused(
        deploy(pyinfra, write_inventory(tmp_path, inventory, [host.name], {host.name: QUICK}), check=False), host
    )
    assert re.fullmatch(
        rf"{host.name}: docker_install is 'docker-ce', but docker\.io \S+, containerd \S+ are installed: apt would "
        r"remove them to install docker-ce, stopping every container on this host \(fix: set docker_install to "
        r"'distro' for this host to keep them, or remove docker\.io containerd by hand first\)",
        line,
    ), line
    assert fingerprint(fleet, host) == before
    assert service_pid(fleet, host) == pid and running_image(fleet, host) == image
    assert sh(fleet, host, f"systemctl is-active {SERVICE}").strip() == "active"
