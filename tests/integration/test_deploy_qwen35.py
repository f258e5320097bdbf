"""`pyinfra INVENTORY deploys/qwen35.py` on real test hosts (nspawn, SSH, sudo, apt, dockerd; stand-in GPU/image).

Order matters inside this module (pytest keeps file order): the session hosts converge first, later tests build
on the running service. Preflight refusals use fresh hosts so "untouched" can be proven on a pristine host.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpufleet.facts.gpu_health import QUERY_HEALTH
from gpufleet.facts.nvidia import QUERY_GPUS
from gpufleet.sandbox.config import NO_GPU, OLD_DRIVER, H200x1, H200x3
from gpufleet.sandbox.nvidia_smi import HOST_PROFILE
from gpufleet.vllm.operations import nvidia, repo_keys
from gpufleet.vllm.operations.docker import DOCKER_KEY
from gpufleet.vllm.operations.nvidia import KEYRING as NVIDIA_KEYRING
from gpufleet.vllm.operations.nvidia import VERSION_FILE
from tests.integration.pyinfra_results import changed_ops, changes, results
from tests.integration.pyinfra_run import run_deploy

REPO = Path(__file__).resolve().parents[2]
DEPLOY = str(REPO / "deploys" / "qwen35.py")
SERVICE = "vllm-qwen35"
STATE_FILE = f"/var/lib/gpufleet/{SERVICE}.json"
API_KEY = "sk-gf-apikey-7c1e94b2"
HF_TOKEN = "hf_gftoken9d20aa51f3"
# Test-host data under the sandbox's own (which wins): a short readiness deadline (the stand-in is ready in
# seconds, a broken one should fail the test quickly). The profile's docker options run as they are.
TEST_DATA = {"vllm_ready_timeout": 120}

# The verify operation (it rolls back a failed version at once).
VERIFY_OP = "Verify vLLM is ready (/health, /v1/models), else roll back"


# --- helpers -------------------------------------------------------------------------------------------------
def write_inventory(tmp_path: Path, inventory_json: Path, names: list[str], overrides: dict | None = None) -> Path:
    """A pyinfra inventory for `names` only, with per-host data overrides {host: {setting: value}}."""
    path = tmp_path / f"inv-{'-'.join(names)}-{len(list(tmp_path.iterdir()))}.py"
    path.write_text(
        "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
        f"_names = {names!r}\n_over = {overrides or {}!r}\n_test = {TEST_DATA!r}\n"
        f"gpuhosts = [(n, {{**_test, **d, **_over.get(n, {{}})}}) for n, d in pyinfra_hosts({str(inventory_json)!r}) "
        "if n in _names]\n"
    )
    return path


def deploy(pyinfra, inventory: Path, *args: str, check: bool = True):
    return run_deploy(pyinfra, inventory, DEPLOY, *args, check=check)


def sh(fleet, host, command: str) -> str:
    return fleet.run_in(host, command).stdout


def service_pid(fleet, host) -> str:
    return sh(fleet, host, f"systemctl show -p MainPID --value {SERVICE}").strip()


def running_image(fleet, host) -> str:
    # Config.Image is the reference the container was started from (`docker ps` shortens digests away).
    ids = f"$(docker ps -q --filter label=gpufleet.{SERVICE})"
    return sh(fleet, host, f"[ -n \"{ids}\" ] && docker inspect --format '{{{{.Config.Image}}}}' {ids} || true").strip()


def ledger(fleet, host, service: str = SERVICE) -> dict:
    """The host's ledger file (gpufleet.hoststate.ledger's format) as JSON."""
    return json.loads(fleet.read_file(host, f"/var/lib/gpufleet/{service}.json"))


def committed_ref(fleet, host, service: str = SERVICE) -> str:
    """The digest the host's ledger names committed (verified): the rollback target."""
    return ledger(fleet, host, service)["committed"]["ref"]


def fingerprint(fleet, host) -> str:
    """What a deploy could change: packages, apt sources, keyrings, docker config, units, our dirs and files."""
    return sh(
        fleet,
        host,
        "dpkg-query -W -f '${Package} ${Version}\\n' | sha256sum; "
        "ls -la /etc/apt/sources.list.d /usr/share/keyrings /etc/systemd/system /etc; "
        "cat /etc/docker/daemon.json 2>/dev/null; ls -d /etc/gpufleet /var/lib/gpufleet /srv/vllm "
        "/var/cache/vllm 2>&1; find /etc /srv /var/lib/gpufleet /usr -xdev -newer /etc/hostname "
        "-not -path '/etc/ssh/*' 2>/dev/null | sort",
    )


# --- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def names(test_hosts) -> list[str]:
    return [h.name for h in test_hosts]


@pytest.fixture(scope="module")
def converged(test_hosts, inventory_json, names, pyinfra, fleet, tmp_path_factory):
    """The session hosts after a first converge from bare (cold) state; the output of that run."""
    inv = write_inventory(tmp_path_factory.mktemp("inv"), inventory_json, names)
    for host in test_hosts:
        # A foreign key the deploy must keep while merging the nvidia runtime into daemon.json.
        fleet.run_in(
            host,
            "python3 - <<'EOF'\nimport json, os\np='/etc/docker/daemon.json'\n"
            "d=json.load(open(p)) if os.path.exists(p) else {}\nd['log-opts']={'max-size': '10m'}\n"
            "os.makedirs('/etc/docker', exist_ok=True)\njson.dump(d, open(p,'w'))\nEOF",
        )
    return deploy(pyinfra, inv).stdout


# --- tests ---------------------------------------------------------------------------------------------------
def test_two_bare_hosts_converge_to_a_verified_service(converged, test_hosts, fleet):
    assert changes(converged) > 0
    assert "ready: /health 200" in converged
    for host in test_hosts:
        assert sh(fleet, host, f"systemctl is-active {SERVICE}").strip() == "active"
        assert sh(fleet, host, f"systemctl is-enabled {SERVICE}").strip() == "enabled"
        committed = ledger(fleet, host)["committed"]
        ref = committed["ref"]
        assert "@sha256:" in ref and committed["ready_at"] and ledger(fleet, host)["pending"] is None
        assert running_image(fleet, host) == ref  # the container runs the digest, not the tag
        unit = fleet.read_file(host, f"/etc/systemd/system/{SERVICE}.service")
        assert f" {ref} ".encode() in unit and committed["unit_sha256"] == hashlib.sha256(unit).hexdigest()


def test_foreign_daemon_json_keys_survive(converged, test_hosts, fleet):
    for host in test_hosts:
        config = json.loads(fleet.read_file(host, "/etc/docker/daemon.json"))
        assert config["log-opts"] == {"max-size": "10m"}
        assert "nvidia" in config["runtimes"]
        assert config.get("insecure-registries")  # the test hosts' own key, set before the deploy


def test_second_converge_changes_nothing(converged, inventory_json, names, pyinfra, tmp_path):
    out = deploy(pyinfra, write_inventory(tmp_path, inventory_json, names)).stdout
    assert changes(out) == 0, changed_ops(out)
    assert results(out)["Grand total"][0] == str(19 * len(names))


def put_file(fleet, host, path: str, content: bytes) -> None:
    """Write content to path in place (its owner and mode stay), as a hand edit does."""
    fleet.run_in(host, f"echo {base64.b64encode(content).decode()} | base64 -d > {path}")


def set_driver(fleet, host, profile: bytes, driver: str, cuda: str) -> None:
    """The host's stand-in nvidia-smi answers for another driver from now on, as after a driver install."""
    put_file(fleet, host, HOST_PROFILE, json.dumps({**json.loads(profile), "driver": driver, "cuda": cuda}).encode())


def test_the_driver_version_file_spares_a_call_and_follows_the_driver(
    converged, test_hosts, inventory_json, names, pyinfra, fleet, tmp_path
):
    a = test_hosts[0]
    for host in test_hosts:  # written by the first converge: what the stand-in answers, root's, 0644
        assert fleet.read_file(host, VERSION_FILE).decode() == sh(fleet, host, "nvidia-smi --version")
        assert sh(fleet, host, f"stat -c '%U %G %a' {VERSION_FILE}").strip() == "root root 644"
    inv = write_inventory(tmp_path, inventory_json, [a.name])
    profile, recorded = fleet.read_file(a, HOST_PROFILE), fleet.read_file(a, VERSION_FILE)
    calls = "/tmp/nvidia-smi-calls"
    # Each nvidia-smi call logged on the host: a no-op converge asks for the GPUs and their health, never again for the
    # version.
    fleet.run_in(a, f"rm -f {calls}; sed -i '1a echo \"$1\" >> {calls}' /usr/bin/nvidia-smi")
    try:
        assert changes(deploy(pyinfra, inv).stdout) == 0
        assert sh(fleet, a, f"cat {calls}").split() == [QUERY_GPUS.split()[1], QUERY_HEALTH.split()[1]]
        # A driver too old for the image, on a host whose file names the newer one: preflight sees the old one.
        set_driver(fleet, a, profile, "535.104.05", "12.2")
        proc = deploy(pyinfra, inv, check=False)
        assert proc.returncode != 0
        assert re.search(
            rf"{a.name}: driver 535\.104\.05 supports CUDA 12\.2, the image needs CUDA >= 13\.0", proc.stdout
        ), proc.stdout[-2000:]
        assert fleet.read_file(a, VERSION_FILE) == recorded  # refused: nothing changed
        # A newer driver: the run proceeds and records it; the next converge is a no-op again.
        set_driver(fleet, a, profile, "590.48.01", "13.1")
        out = deploy(pyinfra, inv).stdout
        assert changed_ops(out) == {"Record the NVIDIA driver's CUDA version": 1}, changed_ops(out)
        assert "CUDA Version        : 13.1" in fleet.read_file(a, VERSION_FILE).decode()
        assert fleet.read_file(a, VERSION_FILE).decode() == sh(fleet, a, "nvidia-smi --version")
        assert changes(deploy(pyinfra, inv).stdout) == 0
    finally:  # the module's later tests expect the converged host as it was
        fleet.run_in(a, f"sed -i '2d' /usr/bin/nvidia-smi; rm -f {calls}")
        put_file(fleet, a, HOST_PROFILE, profile)
        put_file(fleet, a, VERSION_FILE, recorded)


# --- repo keys: the installed keyring stands; gpufleet_refresh_keys fetches and compares ----------------------------
KEY_PATHS = ("nvidia/gpgkey", "docker/linux/debian/gpg")  # under the fleet's web root (gpufleet.sandbox.services)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextmanager
def key_server(fleet, keys: dict[str, bytes | None]):
    """The fleet's stand-in repos answer `keys` (path under the web root -> content, None: 404) for their keys while
    everything else they serve stays: each repo's link in the web root is swapped for a tree of links to its files
    (the shared cache the links point into is never written), and put back after."""
    www = fleet.cfg.state_dir / "www"
    tops = {path.split("/", 1)[0] for path in keys}
    saved = {top: os.readlink(www / top) for top in tops}
    shadow = fleet.cfg.state_dir / "www-keys"
    shutil.rmtree(shadow, ignore_errors=True)

    def mirror(real: Path, at: Path, prefix: str) -> None:
        at.mkdir(parents=True)
        for entry in real.iterdir():
            path = f"{prefix}/{entry.name}"
            if path in keys:
                if keys[path] is not None:
                    (at / entry.name).write_bytes(keys[path])
            elif any(key.startswith(path + "/") for key in keys):
                mirror(entry, at / entry.name, path)
            else:
                (at / entry.name).symlink_to(entry)

    try:
        for top, target in saved.items():
            mirror(Path(target), shadow / top, top)
            (www / top).unlink()
            (www / top).symlink_to(shadow / top)
        yield
    finally:
        for top, target in saved.items():
            (www / top).unlink(missing_ok=True)
            (www / top).symlink_to(target)
        shutil.rmtree(shadow, ignore_errors=True)


def mirror_log(fleet) -> Path:
    return fleet.cfg.state_dir / "logs" / "mirror.log"


def key_requests(fleet, since: int) -> list[str]:
    """The key requests the fleet's web server logged after byte `since` of its log."""
    with mirror_log(fleet).open("rb") as log:
        log.seek(since)
        return [
            line
            for line in log.read().decode(errors="replace").splitlines()
            if any(f"GET /{path} " in line for path in KEY_PATHS)
        ]


def test_a_no_op_converge_asks_no_key_server(converged, test_hosts, inventory_json, pyinfra, fleet, tmp_path):
    """An offline fleet: the keys answer 404. A converged host keeps its keyrings and sends no key request."""
    a = test_hosts[0]
    before = {path: fleet.read_file(a, path) for path in (NVIDIA_KEYRING, DOCKER_KEY)}
    with key_server(fleet, dict.fromkeys(KEY_PATHS)):
        since = mirror_log(fleet).stat().st_size
        out = deploy(pyinfra, write_inventory(tmp_path, inventory_json, [a.name])).stdout
        assert changes(out) == 0, changed_ops(out)
        assert key_requests(fleet, since) == []
    assert {path: fleet.read_file(a, path) for path in before} == before


def test_a_rotated_key_is_picked_up_with_refresh_keys_only(
    converged, test_hosts, inventory_json, pyinfra, fleet, tmp_path
):
    """NVIDIA rotates its key (the stand-in serves another armored key): a plain converge keeps the installed
    keyring, gpufleet_refresh_keys=True replaces it (one change), and the next refresh changes nothing."""
    a = test_hosts[0]
    good = fleet.read_file(a, NVIDIA_KEYRING)
    rotated = fleet.read_file(a, DOCKER_KEY)  # another real key, armored as NVIDIA serves its own
    plain = write_inventory(tmp_path, inventory_json, [a.name])
    refresh = write_inventory(tmp_path, inventory_json, [a.name], {a.name: {"gpufleet_refresh_keys": True}})
    try:
        with key_server(fleet, {"nvidia/gpgkey": rotated}):
            assert changes(deploy(pyinfra, plain).stdout) == 0
            assert fleet.read_file(a, NVIDIA_KEYRING) == good
            out = deploy(pyinfra, refresh).stdout
            assert changed_ops(out) == {"Add the NVIDIA container toolkit apt repository": 1}, changed_ops(out)
            assert fleet.read_file(a, NVIDIA_KEYRING) == repo_keys.dearmor(rotated.decode())
            assert sh(fleet, a, f"stat -c '%U %G %a' {NVIDIA_KEYRING}").strip() == "root root 644"
            assert changes(deploy(pyinfra, refresh).stdout) == 0
        # the key served again: a refresh puts it back; a plain converge is a no-op after it
        out = deploy(pyinfra, refresh).stdout
        assert changed_ops(out) == {"Add the NVIDIA container toolkit apt repository": 1}, changed_ops(out)
        assert fleet.read_file(a, NVIDIA_KEYRING) == good
        assert changes(deploy(pyinfra, plain).stdout) == 0
    finally:  # the module's later tests expect the converged host as it was
        put_file(fleet, a, NVIDIA_KEYRING, good)


def test_a_refresh_with_the_key_server_down_keeps_the_installed_keys_and_warns(
    converged, test_hosts, inventory_json, pyinfra, fleet, tmp_path
):
    a = test_hosts[0]
    before = {path: fleet.read_file(a, path) for path in (NVIDIA_KEYRING, DOCKER_KEY)}
    refresh = write_inventory(tmp_path, inventory_json, [a.name], {a.name: {"gpufleet_refresh_keys": True}})
    with key_server(fleet, dict.fromkeys(KEY_PATHS)):
        since = mirror_log(fleet).stat().st_size
        out = deploy(pyinfra, refresh).stdout  # succeeds
        assert len(key_requests(fleet, since)) == 2  # asked for both, answered 404
    assert changes(out) == 0, changed_ops(out)
    cfg = fleet.cfg
    warnings = [
        ANSI.sub("", line).split("] ", 1)[-1].strip()
        for line in out.splitlines()
        if "to check for a rotated key" in line
    ]
    assert warnings == [
        f"{a.name}: could not fetch {cfg.docker_repo_url}/debian/gpg to check for a rotated key; kept the installed "
        f"{DOCKER_KEY}",
        f"{a.name}: could not fetch {cfg.nvidia_repo_url}/gpgkey to check for a rotated key; kept the installed "
        f"{NVIDIA_KEYRING}",
    ], out[-3000:]
    assert {path: fleet.read_file(a, path) for path in before} == before


def test_a_package_to_install_fetches_the_key_first_and_fails_the_host_on_one_line_without_it(
    converged, test_hosts, inventory_json, pyinfra, fleet, tmp_path
):
    """apt is about to read NVIDIA's repo (the toolkit is missing): the key is fetched first, while executing; with the
    key server down that fails the host on one line, and with it back the toolkit is installed under the same key."""
    a = test_hosts[0]
    good = fleet.read_file(a, NVIDIA_KEYRING)
    inv = write_inventory(tmp_path, inventory_json, [a.name])
    url = f"{fleet.cfg.nvidia_repo_url}/gpgkey"
    fleet.run_in(a, f"dpkg -r {nvidia.PACKAGE}")
    try:
        with key_server(fleet, {"nvidia/gpgkey": None}):
            proc = deploy(pyinfra, inv, check=False)
        assert proc.returncode != 0
        lines = [
            ANSI.sub("", line).split("] ", 1)[-1].strip()
            for line in proc.stdout.splitlines()
            if "could not fetch the repo key" in line
        ]
        assert lines == [
            f"{a.name}: could not fetch the repo key {url}: curl: (22) The requested URL returned error: "
            f"404 (fix: make {url} reachable from {a.name}, or set nvidia_repo_url to a mirror that "
            "serves it)"
        ], proc.stdout[-3000:]
        out = deploy(pyinfra, inv).stdout
        assert changed_ops(out) == {
            "Add the NVIDIA container toolkit apt repository": 1,
            "Install the NVIDIA container toolkit": 1,
        }, changed_ops(out)
        assert fleet.read_file(a, NVIDIA_KEYRING) == good
        assert changes(deploy(pyinfra, inv).stdout) == 0
    finally:  # the module's later tests expect the converged host as it was
        fleet.run_in(a, f"dpkg -s {nvidia.PACKAGE} >/dev/null 2>&1 || apt-get install -y -q {nvidia.PACKAGE}")


def test_a_host_whose_committed_version_changed_since_a_rollout_read_it_is_refused(
    converged, test_hosts, inventory_json, names, pyinfra, fleet, tmp_path
):
    # What a rollout's swap run passes (gpufleet.rollout.swap): each host's committed digest as it read it.
    inv = write_inventory(tmp_path, inventory_json, names)
    first, *others = test_hosts
    read = {h.name: committed_ref(fleet, h) for h in test_hosts}
    before = {h.name: fingerprint(fleet, h) for h in test_hosts}
    stale = {**read, first.name: read[first.name].rsplit(":", 1)[0] + ":" + "0" * 64}
    refused = deploy(pyinfra, inv, "--data", f"gpufleet_expect_committed={json.dumps(stale)}", check=False)
    assert refused.returncode != 0
    out = refused.stdout
    assert f"{first.name}: its ledger has {read[first.name]} committed, the rollout read {stale[first.name]}" in out
    assert not any(f"{h.name}: its ledger has" in out for h in others)
    assert {h.name: fingerprint(fleet, h) for h in test_hosts} == before  # refused before anything changed
    agreed = deploy(pyinfra, inv, "--data", f"gpufleet_expect_committed={json.dumps(read)}").stdout
    assert changes(agreed) == 0, changed_ops(agreed)


def test_changing_one_hosts_setting_restarts_only_that_host(
    converged, test_hosts, inventory_json, names, pyinfra, fleet, tmp_path
):
    a, b = test_hosts
    before = {h.name: service_pid(fleet, h) for h in test_hosts}
    inv = write_inventory(tmp_path, inventory_json, names, {b.name: {"vllm_args": {"max-num-seqs": 4}}})
    out = deploy(pyinfra, inv).stdout
    assert changed_ops(out) == {
        "Install the vLLM systemd unit": 1,
        "Enable and start the vLLM service": 1,
        VERIFY_OP: 1,
        "Commit the verified vLLM version": 1,
    }
    assert service_pid(fleet, a) == before[a.name]
    assert service_pid(fleet, b) != before[b.name]
    assert "--max-num-seqs 4" in fleet.read_file(b, f"/etc/systemd/system/{SERVICE}.service").decode()
    assert changes(deploy(pyinfra, inv).stdout) == 0


def test_secrets_stay_out_of_unit_ps_and_output(converged, test_hosts, inventory_json, names, pyinfra, fleet, tmp_path):
    a = test_hosts[0]
    inv = write_inventory(
        tmp_path, inventory_json, [a.name], {a.name: {"vllm_api_key": API_KEY, "vllm_hf_token": HF_TOKEN}}
    )
    out = deploy(pyinfra, inv, "-vv").stdout + deploy(pyinfra, inv, "-vv").stdout
    assert "ready: /health 200" in out  # verified through the key-guarded /v1/models
    unit_text = fleet.read_file(a, f"/etc/systemd/system/{SERVICE}.service").decode()
    systemctl_cat = sh(fleet, a, f"systemctl cat {SERVICE}")
    # Every process's argv, read from /proc inside the host (a `ps | grep` would match its own command line).
    argvs = sh(fleet, a, "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done")
    for secret in (API_KEY, HF_TOKEN):
        for where, text in (
            ("pyinfra output", out),
            ("unit", unit_text),
            ("systemctl cat", systemctl_cat),
            ("process argv", argvs),
        ):
            assert secret not in text, f"secret found in {where}"
    assert "-e VLLM_API_KEY " in unit_text  # passed by name, value from the env file
    assert sh(fleet, a, f"stat -c '%U %G %a' /etc/gpufleet/{SERVICE}.env").strip() == "root root 600"
    env = fleet.read_file(a, f"/etc/gpufleet/{SERVICE}.env").decode()
    assert f"VLLM_API_KEY={API_KEY}" in env and f"HF_TOKEN={HF_TOKEN}" in env


def test_reboot_brings_the_service_back_on_the_same_digest(
    converged, test_hosts, fleet, inventory_json, pyinfra, tmp_path
):
    b = test_hosts[1]
    ref = committed_ref(fleet, b)
    fleet.reboot(b)
    out = ""
    for _ in range(60):  # the unit starts at boot; the stand-in takes a few seconds to listen
        if running_image(fleet, b) == ref:
            break
        fleet.run_in(b, "sleep 1")
    assert running_image(fleet, b) == ref
    out = deploy(
        pyinfra, write_inventory(tmp_path, inventory_json, [b.name], {b.name: {"vllm_args": {"max-num-seqs": 4}}})
    ).stdout
    # Nothing to redo after a reboot; at most the readiness wait if the stand-in was still loading.
    assert set(changed_ops(out)) <= {VERIFY_OP}, changed_ops(out)
    assert committed_ref(fleet, b) == ref


@pytest.mark.parametrize(
    ("gpus", "overrides", "expected"),
    [
        (H200x1, {}, r"vllm_gpus \[0, 1, 2\] needs GPU index 2, the host has 1 GPU"),
        (OLD_DRIVER, {}, r"driver 535\.104\.05 supports CUDA 12\.2, the image needs CUDA >= 13\.0"),
        (NO_GPU, {}, r"no NVIDIA driver \(nvidia-smi not found\).*gpufleet_allow_no_gpu=True"),
        (H200x3, {"gpufleet_min_free_gb_docker": 10**6}, r"GiB free at /var/lib/docker \(Docker images\)"),
    ],
    ids=["too-few-gpus", "old-driver", "no-gpu", "low-disk"],
)
def test_preflight_refuses_before_any_change(
    gpus, overrides, expected, fresh_hosts, fleet, fleet_inventory_json, pyinfra, tmp_path
):
    bad, good = fresh_hosts(gpus, H200x3)
    before = {h.name: fingerprint(fleet, h) for h in (bad, good)}
    inv = write_inventory(tmp_path, fleet_inventory_json(), [bad.name, good.name], {bad.name: overrides})
    proc = deploy(pyinfra, inv, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith(f"{bad.name}:")]
    assert len(lines) == 1 and re.search(expected, lines[0]), proc.stdout[-2000:]
    assert "(fix: " in lines[0]
    assert "nothing was changed on any host" in proc.stdout
    assert "Starting operation" not in proc.stdout
    assert not any(line.strip().startswith(f"{good.name}:") for line in proc.stdout.splitlines())
    for host in (bad, good):  # neither the failing host nor its healthy peer was touched
        assert fingerprint(fleet, host) == before[host.name]


def test_no_gpu_host_allowed_installs_everything_but_does_not_start(
    fresh_hosts, fleet, fleet_inventory_json, pyinfra, tmp_path
):
    (host,) = fresh_hosts(NO_GPU)
    inv = write_inventory(tmp_path, fleet_inventory_json(), [host.name], {host.name: {"gpufleet_allow_no_gpu": True}})
    out = deploy(pyinfra, inv).stdout
    changed = changed_ops(out)
    assert "Install the NVIDIA container toolkit" in changed and "Install the vLLM systemd unit" in changed
    assert "Enable and start the vLLM service" not in changed and VERIFY_OP not in changed
    assert sh(fleet, host, "dpkg-query -W -f '${Status}' nvidia-container-toolkit") == "install ok installed"
    assert fleet.read_file(host, f"/etc/systemd/system/{SERVICE}.service")
    assert fleet.run_in(host, f"systemctl is-active {SERVICE}", check=False).stdout.strip() != "active"
    assert changes(deploy(pyinfra, inv).stdout) == 0


@pytest.fixture
def fleet_inventory_json(fleet):
    """The inventory.json rewritten now (fresh hosts join the document when they boot)."""
    return fleet.write_inventory


def test_a_first_install_that_dies_fails_the_host_with_its_last_log_lines(
    fresh_hosts, fleet, fleet_inventory_json, pyinfra, tmp_path
):
    (host,) = fresh_hosts(H200x3)
    doc = json.loads(Path(fleet_inventory_json()).read_text())
    image = doc["host_data"]["vllm_image"].rsplit(":", 1)[0] + ":dies"  # ready ~8 s, then its engine dies
    inv = write_inventory(
        tmp_path, fleet_inventory_json(), [host.name], {host.name: {"vllm_image": image, "vllm_ready_timeout": 60}}
    )
    proc = deploy(pyinfra, inv, check=False)
    assert proc.returncode != 0
    # dead, or caught by the soak while its container was going away (the engine dies ~8 s after ready): either way
    # not ready, with the engine's own last words from its log.
    assert re.search(rf"\[{host.name}\] {host.name}: vllm-qwen35 not ready \((dead|starting): ", proc.stdout), (
        proc.stdout[-3000:]
    )
    log_lines = [line for line in proc.stdout.splitlines() if f"[{host.name}]   | " in line]
    assert any("EngineDeadError" in line for line in log_lines), proc.stdout[-3000:]
    # Nothing verified to go back to: no committed version, the digest marked failed (not retried by a re-run).
    doc = ledger(fleet, host)
    assert (
        doc["committed"] is None
        and doc["pending"] is None
        and re.match(r"(dead|starting): ", doc["failed"][0]["reason"])
    )
