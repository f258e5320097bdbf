"""The test-host tier itself: real SSH + sudo + pyinfra, apt from the local mirror, the stand-in NVIDIA toolkit and
vLLM image through a real dockerd, isolation, reboot/cut-off helpers, and a teardown that leaves nothing behind."""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from pathlib import Path

import pytest

from gpufleet.sandbox import image
from gpufleet.sandbox.config import NO_GPU, OLD_DRIVER, FleetConfig, H200x1, H200x3
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.procs import SandboxError, run
from tests.integration.pyinfra_run import EXECUTION_STARTS, failed_to_connect

pytestmark = pytest.mark.integration


def test_pyinfra_exec_as_deploy_with_sudo_writes_only_on_its_host(fleet, test_hosts, pyinfra_inventory, pyinfra):
    token = secrets.token_hex(8)
    first, second = test_hosts
    out = pyinfra(pyinfra_inventory, "exec", "--", "id -un; sudo -n id -un; hostname").stdout
    for h in test_hosts:
        assert f"[{h.name}] deploy" in out and f"[{h.name}] root" in out and f"[{h.name}] {h.name}" in out
    pyinfra(
        pyinfra_inventory,
        "--limit",
        first.name,
        "exec",
        "--",
        f"echo {token} | sudo tee /etc/gpufleet-probe >/dev/null && sudo chmod 600 /etc/gpufleet-probe",
    )
    assert fleet.read_file(first, "/etc/gpufleet-probe") == f"{token}\n".encode()
    assert (first.root / "etc/gpufleet-probe").stat().st_uid == 0  # written through sudo
    with pytest.raises(FileNotFoundError):
        fleet.read_file(second, "/etc/gpufleet-probe")
    assert not Path("/etc/gpufleet-probe").exists()  # not the machine's
    assert fleet.run_in(second, "test -e /etc/gpufleet-probe", check=False).returncode == 1


def test_hosts_reach_only_the_bridge_subnet(fleet, test_hosts):
    for h in test_hosts:
        routes = [r.strip() for r in fleet.run_in(h, "ip -4 route show").stdout.strip().splitlines()]
        assert f"{fleet.cfg.subnet} dev eth0 proto kernel scope link src {h.ip}" in routes, routes
        # Nothing but directly attached links (the bridge subnet; docker0 once a deploy installed Docker):
        # no default route and no route through any gateway.
        assert all("scope link" in r and " via " not in r and not r.startswith("default") for r in routes), routes
        assert fleet.read_file(h, "/etc/resolv.conf") == b""
        unreachable = fleet.run_in(h, "ip route get 1.1.1.1", check=False)
        assert unreachable.returncode != 0 and "unreachable" in unreachable.stderr
        # the bridge is reachable: the local mirror answers on the gateway address
        assert fleet.ssh(h, "curl", "-fsS", "-o", "/dev/null", f"{fleet.cfg.mirror_url}/debian/Release").returncode == 0


def test_nvidia_smi_per_host_profiles(fleet, test_hosts, fresh_hosts):
    assert fleet.ssh(test_hosts[0], "nvidia-smi --query-gpu=count --format=csv,noheader").stdout == "3\n3\n3\n"
    old, none, one = fresh_hosts(OLD_DRIVER, NO_GPU, H200x1)
    assert fleet.ssh(old, "nvidia-smi --version").stdout.splitlines()[-1] == "CUDA Version        : 12.2"
    assert fleet.ssh(none, "command -v nvidia-smi", check=False).returncode == 1
    assert fleet.ssh(one, "nvidia-smi -L").stdout.count("GPU ") == 1
    assert fleet.ssh(one, "nvidia-smi --bogus", check=False).returncode == 2


def _install_docker_and_toolkit(fleet: Fleet, host) -> str:
    """What the deploy does, by hand: Docker installed the way docs.docker.com documents it for Debian (key, source
    line, the five packages) from the signed stand-in of Docker's repo, the toolkit from the signed stand-in
    NVIDIA repo."""
    repo = fleet.cfg.nvidia_repo_url
    docker = fleet.cfg.docker_repo_url
    script = f"""set -e
sudo install -m 0755 -d /etc/apt/keyrings
sudo curl -fsSL {docker}/debian/gpg -o /etc/apt/keyrings/docker.asc
sudo chmod a+r /etc/apt/keyrings/docker.asc
echo \\
  "deb [arch=$(dpkg --print-architecture) signed-by=/etc/apt/keyrings/docker.asc] {docker}/debian \\
  $(. /etc/os-release && echo "$VERSION_CODENAME") stable" | \\
  sudo tee /etc/apt/sources.list.d/docker.list > /dev/null
curl -fsSL {repo}/gpgkey | sudo gpg --batch --yes --dearmor -o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
curl -fsSL {repo}/stable/deb/nvidia-container-toolkit.list \\
  | sudo tee /etc/apt/sources.list.d/nvidia-container-toolkit.list >/dev/null
sudo apt-get -q update 2>&1
sudo DEBIAN_FRONTEND=noninteractive apt-get -qy install docker-ce docker-ce-cli containerd.io docker-buildx-plugin \\
  docker-compose-plugin nvidia-container-toolkit >/dev/null
sudo nvidia-ctk runtime configure --runtime=docker
sudo systemctl restart docker
nvidia-ctk --version
"""
    return fleet.ssh(host, script).stdout


def test_docker_gpu_run_from_local_registry_and_a_systemd_unit(fleet, fresh_hosts):
    # A fresh host: the session hosts may already carry a deploy's changes (Docker, daemon.json keys).
    (host,) = fresh_hosts(H200x3)
    out = _install_docker_and_toolkit(fleet, host)
    assert "NVIDIA Container Toolkit CLI version 1.17.8" in out
    # both signed stand-in repos verified with their keys (apt refuses an unsigned or unverifiable one)
    assert f"{fleet.cfg.docker_repo_url}/debian bookworm InRelease" in out and "NO_PUBKEY" not in out
    assert (
        fleet.ssh(host, "systemctl is-active docker.socket containerd.service docker.service").stdout.split()
        == ["active"] * 3
    )
    # Docker's packages and paths, Debian's real engine: the daemon that runs is docker-ce's /usr/bin/dockerd
    assert fleet.ssh(host, "dpkg -S /usr/bin/dockerd /usr/bin/runc").stdout.split() == [
        "docker-ce:",
        "/usr/bin/dockerd",
        "containerd.io:",
        "/usr/bin/runc",
    ]
    assert fleet.ssh(host, "sudo readlink /proc/$(systemctl show -p MainPID --value docker)/exe").stdout.strip() == (
        "/usr/bin/dockerd"
    )
    daemon = json.loads(fleet.read_file(host, "/etc/docker/daemon.json"))
    # nvidia-ctk merged: the test setup's insecure-registries entry survived next to the runtime
    assert daemon == {
        "insecure-registries": [fleet.cfg.registry],
        "runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}},
    }
    ref = image.image_ref(fleet.cfg, "nightly")
    fleet.ssh(host, f"sudo docker pull -q {ref}")
    gpus = fleet.ssh(
        host, f"sudo docker run --rm --runtime=nvidia --gpus '\"device=0,1,2\"' --entrypoint nvidia-smi {ref} -L"
    ).stdout
    assert gpus.count("GPU ") == 3
    bad = fleet.ssh(host, f"sudo docker run --rm --runtime=nvidia --gpus '\"device=3\"' {ref}", check=False)
    assert bad.returncode != 0 and "unknown device" in bad.stderr
    env = fleet.ssh(host, f"sudo docker image inspect -f '{{{{json .Config.Env}}}}' {ref}").stdout
    assert "NVIDIA_REQUIRE_CUDA=cuda>=13.0" in env

    # the image's `hf` fetches the model from the stand-in hub; then a systemd unit wraps `docker run` of the server
    dl = fleet.ssh(
        host,
        f"sudo mkdir -p /srv/models && sudo docker run --rm --network host -v /srv/models:/models --entrypoint hf "
        f"-e HF_ENDPOINT={fleet.cfg.hub_url} -e HF_HUB_DISABLE_XET=1 {ref} download {image.MODEL_REPO} "
        "--local-dir /models/tiny",
    )
    assert dl.stdout.strip() == "/models/tiny"
    # the rollout tags: an older vLLM rejects the seed's flag; a dying one exits 1 after a short life
    run_tag = "sudo docker run --rm --runtime=nvidia -v /srv/models:/models -e STANDIN_LOAD_SECONDS=0"
    old = fleet.ssh(
        host,
        f"{run_tag} {image.image_ref(fleet.cfg, 'rejects-flag')} /models/tiny --performance-mode interactivity",
        check=False,
    )
    assert old.returncode == 2 and "unrecognized arguments: --performance-mode" in old.stderr
    dies = fleet.ssh(
        host, f"{run_tag} -e STANDIN_DIE_AFTER=1 {image.image_ref(fleet.cfg, 'dies')} /models/tiny", check=False
    )
    assert dies.returncode == 1 and "EngineDeadError" in dies.stdout
    unit = f"""[Unit]
Description=stand-in vLLM (test)
After=docker.service
Requires=docker.service
[Service]
ExecStartPre=-/usr/bin/docker rm -f gf-vllm-test
ExecStart=/usr/bin/docker run --rm --name gf-vllm-test --runtime=nvidia --gpus '"device=0,1,2"' -p 8000:8000 \\
  -e STANDIN_LOAD_SECONDS=1 -v /srv/models:/models {ref} \\
  --model /models/tiny --served-model-name tiny --performance-mode interactivity
ExecStop=/usr/bin/docker stop gf-vllm-test
[Install]
WantedBy=multi-user.target
"""
    fleet.ssh(
        host,
        f"sudo tee /etc/systemd/system/gf-vllm-test.service >/dev/null <<'EOF'\n{unit}EOF\n"
        "sudo systemctl daemon-reload && sudo systemctl start gf-vllm-test",
    )
    try:

        def models():
            try:
                with urllib.request.urlopen(f"http://{host.ip}:8000/v1/models", timeout=2) as r:
                    return json.load(r)
            except OSError:
                return None

        deadline = time.monotonic() + 60
        while (body := models()) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert body and body["data"][0]["id"] == "tiny" and body["data"][0]["root"] == "/models/tiny"
        assert fleet.ssh(host, "systemctl is-active gf-vllm-test").stdout.strip() == "active"
    finally:
        fleet.ssh(host, "sudo systemctl stop gf-vllm-test", check=False)


def test_image_tags_have_distinct_digests(fleet):
    digests = {}
    for tag in [*image.TAGS, *image.ALIASES]:
        req = urllib.request.Request(
            f"http://{fleet.cfg.registry}/v2/{image.REPOSITORY}/manifests/{tag}",
            headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
            method="HEAD",
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            digests[tag] = r.headers["Docker-Content-Digest"]
    assert digests["nightly"] == digests["good"]
    assert len({digests["good"], digests["rejects-flag"], digests["dies"]}) == 3


def test_reboot_keeps_the_disk_and_cut_off_isolates(fleet, fresh_hosts):
    (host,) = fresh_hosts(H200x1)
    fleet.ssh(host, "echo kept | sudo tee /var/lib/gpufleet-kept >/dev/null")
    boot_id = fleet.ssh(host, "cat /proc/1/stat").stdout.split()[21]  # PID 1's start time: new on each boot
    assert (host.dir / "upper/var/lib/gpufleet-kept").read_text() == "kept\n"  # on the overlay's disk
    took = fleet.reboot(host)
    assert fleet.ssh(host, "cat /proc/1/stat").stdout.split()[21] != boot_id
    kept = fleet.ssh(host, "cat /var/lib/gpufleet-kept", check=False)
    assert kept.stdout == "kept\n", (took, kept.stderr, (host.dir / "console.log").read_text()[-2000:])
    assert took < 60
    fleet.set_connected(host, False)
    try:
        assert fleet.ssh(host, "true", check=False).returncode == 255  # ssh: connection timed out
        assert fleet.read_file(host, "/var/lib/gpufleet-kept") == b"kept\n"  # the test can still look inside
    finally:
        fleet.set_connected(host, True)
    assert fleet.ssh(host, "true").returncode == 0


# --------------------------------------------------------------------------------------------- teardown / leftovers
def _snapshot(prefixes: tuple[str, ...], paths: tuple[str, ...]) -> dict:
    """Our names only: processes, mounts, netns and links that match this fleet's names or paths, plus iptables."""
    ps = run(["ps", "-ww", "-eo", "pid=,args="]).stdout.splitlines()
    return {
        "procs": sorted(line for line in ps if any(p in line for p in paths)),
        "mounts": sorted(m for m in Path("/proc/mounts").read_text().splitlines() if any(p in m for p in paths)),
        "netns": sorted(n for n in run(["ip", "netns", "list"]).stdout.split() if n.startswith(prefixes)),
        "links": sorted(
            line.split(": ")[1]
            for line in run(["ip", "-o", "link", "show"]).stdout.splitlines()
            if line.split(": ")[1].startswith(prefixes)
        ),
        # the whole ruleset (comments carry timestamps): hosts' dockerds keep their rules in their own netns
        "iptables": [r for r in run(["iptables-save"]).stdout.splitlines() if not r.startswith("#")],
    }


def test_teardown_leaves_nothing_and_a_start_clears_a_killed_run(fleet, tmp_path):
    # A fleet of its own (bridge gf-tdown, 10.213.2.0/24) so the session's hosts stay up meanwhile.
    cfg = FleetConfig(
        name="tdown",
        bridge="gf-tdown",
        net="10.213.2",
        host_prefix="gfd",
        state_dir=tmp_path / "state",
        cache_dir=fleet.cfg.cache_dir,
    )
    prefixes, paths = ("gf-tdown", "gf-tdown-"), (str(cfg.state_dir),)
    before = _snapshot(prefixes, paths)
    assert not before["procs"] and not before["netns"] and not before["links"]

    killed, again = Fleet(cfg), Fleet(cfg)
    try:
        killed.start()  # a run that is "killed": it never gets to stop()
        (host,) = killed.add_hosts([H200x1])
        killed.ssh(host, "true")
        assert _snapshot(prefixes, paths)["procs"]
        killed.unlock()  # what its death would do: the kernel drops a dead process's lock

        again.start()  # the next start clears that run's leftovers instead of failing on them
        hosts = again.add_hosts([H200x1, NO_GPU])
        assert [again.ssh(h, "hostname").stdout.strip() for h in hosts] == ["gfd1", "gfd2"]
        during = _snapshot(prefixes, paths)
        assert len(during["netns"]) == 2 and "gf-tdown" in during["links"]

        t0 = time.monotonic()
        again.stop()
        after = _snapshot(prefixes, paths)
        assert after == before, f"left behind after {time.monotonic() - t0:.1f}s: {after}"
    finally:
        killed.unlock()
        again.unlock()
        Fleet(cfg).stop()  # whatever an assertion above left running


def test_a_live_run_of_the_same_fleet_is_waited_for_not_cleared(fleet, test_hosts, tmp_path):
    """Two pytest sessions on one machine share the fleet's names: the second waits for the first."""
    rival = Fleet(fleet.cfg)
    with pytest.raises(SandboxError, match="in use by another run"):
        rival.lock(timeout=1)
    assert fleet.ssh(test_hosts[0], "true").returncode == 0  # untouched


def test_a_deploy_is_repeated_only_for_an_ssh_failure_before_anything_executed():
    connect = "--> Connecting to hosts...\n    [gft11] Could not connect (Error reading SSH protocol banner)\n"
    facts = "--> Preparing operation files...\n    [gft11] Command socket/SSH error: Connection reset by peer\n"
    executed = (
        "--> Connecting to hosts...\n    [gft11] Connected\n--> Beginning operation run...\n"
        "    [gft11] Command socket/SSH error: [Errno 104] Connection reset by peer\n"
    )
    assert failed_to_connect(connect) and failed_to_connect(facts + EXECUTION_STARTS)
    # Once operations ran, a repeat would meet what the first run left on the host (a version marked failed).
    assert not failed_to_connect(executed)
    assert not failed_to_connect("--> Connecting to hosts...\n    [gft11] Connected\n")
