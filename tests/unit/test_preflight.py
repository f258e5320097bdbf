"""Preflight decisions: a snapshot + settings -> one line per problem (host, what, fix), or nothing."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from gpufleet.facts.nvidia import Gpu, NvidiaVersion
from gpufleet.vllm.checks import MANAGED_HEADER, check
from gpufleet.vllm.facts import HostSnapshot, ServiceUnit
from gpufleet.vllm.settings import build_spec, resolve_host
from gpufleet.vllm.unit import render_unit

GIB = 1024 * 1024


def gpu(i: int) -> Gpu:
    return Gpu(
        i, f"GPU-{i}", "NVIDIA H200", 143771, 0, 143156, "580.159.04", f"0:{i}", "9.0", "Enabled", 30, 0, 80.0, 700.0
    )


def host(count: int = 3, cuda: str = "13.0", **over) -> HostSnapshot:
    snap = HostSnapshot(
        os={"ID": "debian", "VERSION_ID": "12", "PRETTY_NAME": "Debian 12"},
        arch="amd64",
        nvidia_smi=count > 0,
        gpus=[gpu(i) for i in range(count)],
        driver=NvidiaVersion("580.159.04", cuda) if count else None,
        free_kib={"docker": 200 * GIB, "models": 200 * GIB},
        free_path={"docker": "/var/lib/docker", "models": "/srv"},
    )
    return replace(snap, **over)


def settings(**over):
    return resolve_host("gpu1", over)[1]


def test_healthy_host_passes():
    assert check("gpu1", host(), settings(), (0, 1, 2)) == []


def test_too_few_gpus_one_line_with_fix():
    (line,) = check("gpu1", host(count=1), settings(), (0, 1, 2))
    assert line.startswith("gpu1: vllm_gpus [0, 1, 2] needs GPU index 2, the host has 1 GPU(s)")
    assert "(fix: list GPU indexes below 1" in line and "\n" not in line


def test_old_driver():
    (line,) = check("gpu1", host(cuda="12.2", driver=NvidiaVersion("535.104.05", "12.2")), settings(), (0, 1, 2))
    assert "driver 535.104.05 supports CUDA 12.2, the image needs CUDA >= 13.0" in line and "(fix: upgrade" in line


def test_cuda_compares_numerically_not_as_text():
    assert (
        check("g", host(cuda="13.10", driver=NvidiaVersion("x", "13.10")), settings(gpufleet_min_cuda="13.9"), (0,))
        == []
    )


def test_no_gpu_refused_unless_allowed():
    (line,) = check("vm", host(count=0), settings(), (0, 1, 2))
    assert "no NVIDIA driver (nvidia-smi not found)" in line and "gpufleet_allow_no_gpu=True" in line
    assert check("vm", host(count=0), settings(gpufleet_allow_no_gpu=True), (0, 1, 2)) == []


def test_broken_driver():
    (line,) = check("g", host(nvidia_error="nvidia-smi failed: NVIDIA-SMI has failed"), settings(), (0,))
    assert "nvidia-smi does not work" in line


@pytest.mark.parametrize(
    ("key", "setting"), [("docker", "gpufleet_min_free_gb_docker"), ("models", "gpufleet_min_free_gb_models")]
)
def test_low_disk(key, setting):
    snap = host()
    snap.free_kib[key] = 5 * GIB
    (line,) = check("g", snap, settings(), (0, 1, 2))
    assert f"5.0 GiB free at {snap.free_path[key]}" in line and f"{setting} asks for" in line


def test_disk_not_required_for_what_is_already_there():
    ref = "vllm/vllm-openai@sha256:" + "a" * 64
    snap = host(
        images=[("vllm/vllm-openai", "nightly", "sha256:" + "a" * 64)],
        model_files={"config.json": 1, "tokenizer.json": 1, "model.safetensors": 9},
    )
    snap.free_kib.update(docker=GIB, models=GIB)
    assert check("g", snap, settings(), (0, 1, 2), ref) == []


def test_a_model_commit_asked_for_needs_room_before_its_prepare_starts():
    snap = host(
        model_files={"config.json": 1, "tokenizer.json": 1, "model.safetensors": 9}, model_checked="org/m@" + "c" * 40
    )
    snap.free_kib.update(models=GIB)
    assert check("g", snap, settings(vllm_model_repo="org/m"), (0, 1, 2)) == []
    assert check("g", snap, settings(vllm_model_repo="org/m", gpufleet_model_sha="c" * 40), (0, 1, 2)) == []
    (line,) = check("g", snap, settings(vllm_model_repo="org/m", gpufleet_model_sha="d" * 40), (0, 1, 2))
    assert "gpufleet_min_free_gb_models asks for" in line


def test_the_site_cache_host_needs_room_for_the_cache_to_grow_to_its_bound():
    # 30 GiB held of site_cache_max_gb 100: 70 more may land, beside Docker's own room when they share a disk.
    snap = host(
        site_cache_used_kib=30 * GIB,
        free_kib={"docker": 200 * GIB, "models": 200 * GIB, "site_cache": 90 * GIB},
        free_path={"docker": "/var/lib/docker", "models": "/srv", "site_cache": "/var/lib/docker-registry"},
    )
    assert check("g", snap, settings(), (0, 1, 2)) == []
    shared = replace(snap, site_cache_shares_docker=True)
    (line,) = check("g", shared, settings(), (0, 1, 2))  # 70 + gpufleet_min_free_gb_docker 60 > 90
    assert line == (
        "g: 90.0 GiB free at /var/lib/docker-registry (the site cache, holding 30.0 GiB), site_cache_max_gb "
        "asks for 100 and gpufleet_min_free_gb_docker 60 beside it (fix: free space there, or lower "
        "site_cache_max_gb)"
    )
    # Over its bound, the cache is emptied by this run: what it holds counts as room.
    over = replace(snap, site_cache_used_kib=120 * GIB, free_kib={**snap.free_kib, "site_cache": 10 * GIB})
    assert check("g", over, settings(), (0, 1, 2)) == []
    assert check("g", replace(over, site_cache_used_kib=80 * GIB), settings(), (0, 1, 2)) != []
    assert check("g", replace(snap, site_cache_used_kib=None), settings(site_cache_max_gb=10**6), (0, 1, 2)) == []


def test_missing_model_without_repo():
    lines = check("g", host(), settings(vllm_model_repo=None), (0, 1, 2))
    assert any("lacks config.json and vllm_model_repo is None" in line for line in lines)


def test_unsupported_os_and_arch():
    lines = check("g", host(os={"ID": "fedora", "PRETTY_NAME": "Fedora 40"}, arch="riscv64"), settings(), (0, 1, 2))
    assert len(lines) == 2 and "Fedora 40" in lines[0] and "riscv64" in lines[1]


def test_ubuntu_derivative_accepted():
    assert check("g", host(os={"ID": "pop", "ID_LIKE": "ubuntu debian"}), settings(), (0, 1, 2)) == []


def test_invalid_daemon_json():
    (line,) = check("g", host(daemon_json_error="/etc/docker/daemon.json is not valid JSON (x)"), settings(), (0,))
    assert "never replaces it" in line


# --- a Docker engine the deploy would swap out ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("install", "packages", "expected"),
    [
        (
            "docker-ce",
            {"docker.io": "20.10.24+dfsg1-1+deb12u1+b6", "containerd": "1.6.20~ds1-1+deb12u3"},
            "g: docker_install is 'docker-ce', but docker.io 20.10.24+dfsg1-1+deb12u1+b6, containerd 1.6.20~ds1-1+deb12u3 "
            "are installed: apt would remove them to install docker-ce, stopping every container on this host "
            "(fix: set docker_install to 'distro' for this host to keep them, or remove docker.io containerd by hand first)",
        ),
        (
            "distro",
            {
                "docker-ce": "5:28.3.3-1~debian.12~bookworm",
                "docker-ce-cli": "5:28.3.3-1~debian.12~bookworm",
                "containerd.io": "1.7.27-1",
            },
            "g: docker_install is 'distro', but docker-ce 5:28.3.3-1~debian.12~bookworm, containerd.io 1.7.27-1 are "
            "installed: apt would remove them to install docker.io, stopping every container on this host "
            "(fix: set docker_install to 'docker-ce' for this host to keep them, or remove docker-ce containerd.io by hand "
            "first)",
        ),
        # A Kubernetes node's containerd alone: containerd.io conflicts with it just the same.
        (
            "docker-ce",
            {"containerd": "1.6.20~ds1-1+deb12u3"},
            "g: docker_install is 'docker-ce', but containerd 1.6.20~ds1-1+deb12u3 is installed: apt would remove it to "
            "install docker-ce, stopping every container on this host (fix: set docker_install to 'distro' for this host "
            "to keep it, or remove containerd by hand first)",
        ),
    ],
    ids=["distro-docker-under-docker-ce", "docker-ce-under-distro", "distro-containerd-under-docker-ce"],
)
def test_another_docker_engine_is_refused_with_the_fix(install, packages, expected):
    assert check("g", host(packages=packages), settings(docker_install=install), (0, 1, 2)) == [expected]


@pytest.mark.parametrize(
    ("install", "packages"),
    [
        (
            "docker-ce",
            {
                "docker-ce": "5:20.10.24-1~debian.12~bookworm",
                "docker-ce-cli": "5:20.10.24-1~debian.12~bookworm",
                "containerd.io": "1.6.20-1",
            },
        ),
        ("distro", {"docker.io": "20.10.24+dfsg1-1+deb12u1+b6", "containerd": "1.6.20~ds1-1+deb12u3"}),
        ("docker-ce", {"docker-ce-cli": "5:20.10.24-1~debian.12~bookworm"}),  # a CLI alone runs no containers
        ("distro", {}),
    ],
    ids=["docker-ce-kept", "distro-kept", "cli-only", "bare"],
)
def test_the_engine_docker_install_asks_for_or_none_passes(install, packages):
    assert check("g", host(packages=packages), settings(docker_install=install), (0, 1, 2)) == []


# --- vllm_service naming a unit gpufleet did not create ------------------------------------------------------
def unit(name: str, load_state: str = "loaded", path: str = "", first_line: str = "") -> ServiceUnit:
    return ServiceUnit(name=name, load_state=load_state, fragment_path=path, first_line=first_line)


def test_a_foreign_unit_is_refused_with_the_fix():
    snap = host(service_unit=unit("billing.service", path="/etc/systemd/system/billing.service", first_line="[Unit]"))
    assert check("g", snap, settings(vllm_service="billing"), (0, 1, 2)) == [
        "g: vllm_service 'billing' is billing.service, a unit gpufleet did not create "
        "(/etc/systemd/system/billing.service): the deploy would replace and restart it "
        "(fix: set vllm_service to a name no unit on this host uses yet (gpufleet then creates that unit))"
    ]


@pytest.mark.parametrize(
    ("service_unit", "origin"),
    [
        # an alias resolves to the unit it points at: systemd's Id, not the name asked for
        (
            unit("ssh.service", path="/lib/systemd/system/ssh.service", first_line="[Unit]"),
            "/lib/systemd/system/ssh.service",
        ),
        (
            unit("old.service", load_state="masked", path="/etc/systemd/system/old.service"),
            "masked at /etc/systemd/system/old.service",
        ),
        # an init script wrapped by systemd-sysv-generator
        (
            unit(
                "legacy.service",
                path="/run/systemd/generator.late/legacy.service",
                first_line="# Automatically generated by systemd-sysv-generator",
            ),
            "/run/systemd/generator.late/legacy.service",
        ),
    ],
    ids=["alias", "masked", "sysv"],
)
def test_foreign_units_of_every_kind_are_refused(service_unit, origin):
    (line,) = check("g", host(service_unit=service_unit), settings(vllm_service="x"), (0, 1, 2))
    assert f"is {service_unit.name}, a unit gpufleet did not create ({origin})" in line


@pytest.mark.parametrize(
    "service_unit",
    [
        None,  # the snapshot had no such section (older output)
        unit("vllm-qwen35.service", load_state="not-found"),
        unit(
            "vllm-qwen35.service",
            path="/etc/systemd/system/vllm-qwen35.service",
            first_line="# Managed by gpufleet (gpu1): changes here are overwritten by the next deploy.",
        ),
    ],
    ids=["unknown", "not-found", "ours"],
)
def test_a_missing_unit_or_one_gpufleet_wrote_passes(service_unit):
    assert check("g", host(service_unit=service_unit), settings(), (0, 1, 2)) == []


def test_the_header_preflight_trusts_is_the_one_every_rendered_unit_starts_with():
    assert render_unit(build_spec("gpu1", {})).startswith(MANAGED_HEADER + " ")


# --- the harness: every host read at once, bounded in time ------------------------------------------------------
def test_a_host_that_never_answers_gets_one_line_within_the_bound_and_the_others_their_readings():
    import gevent
    from pyinfra.api import Config, Inventory, State

    from gpufleet.errors import SettingError, SettingErrors
    from gpufleet.harness.preflight import read_fleet
    from gpufleet.vllm.host_read import HOST_READ

    inventory = Inventory(([("wedged", {}), ("bad", {})], {}))
    state = State(inventory, Config())
    for target in inventory:
        state.activate_host(target)

    def plan_for(name, data):
        if name == "wedged":
            gevent.sleep(60)  # a read that never comes back (a hung SSH channel, a stuck nvidia-smi)
        raise SettingErrors([SettingError(name, "vllm_port", "is 0", "use 1-65535")])

    start = time.monotonic()
    readings = read_fleet(state, plan_for, lambda name, snap, plan: [], HOST_READ, timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert readings["wedged"].problems == [
        "wedged: the host did not answer preflight's read within 0.5 s (fix: check that SSH, sudo, nvidia-smi, "
        "docker and systemctl answer on it, or leave it out with --limit)"
    ]
    assert readings["bad"].problems == [str(SettingError("bad", "vllm_port", "is 0", "use 1-65535"))]


def test_bad_lock_settings_are_refused_in_one_line_before_the_host_is_locked():
    from pyinfra.api import Config, Inventory, State

    from gpufleet.harness.preflight import read_host
    from gpufleet.hostlock import lock_timings
    from gpufleet.vllm.host_read import HOST_READ

    inventory = Inventory(([("router1", {"gpufleet_lock_wait_s": "soon"})], {}))
    state = State(inventory, Config())
    (target,) = inventory

    def plan_for(name, data):
        lock_timings(name, data)  # as the router's plan_for reads the lock's settings
        raise AssertionError("not reached")

    reading = read_host(state, target, plan_for, lambda name, snap, plan: [], HOST_READ)
    assert (reading.plan, reading.snapshot) == (None, None)
    assert reading.problems == [
        "router1: gpufleet_lock_wait_s and gpufleet_lock_lease_s must be numbers of seconds, got 'soon' and None "
        "(fix: set them to numbers)"
    ]


# --- the host lock: another run's lock is one line per host, before the host is read -----------------------------
def test_hosts_another_run_holds_are_refused_with_one_line_each_naming_it(sshd, tmp_path):
    from pyinfra.api import Config, Inventory, State

    from gpufleet.harness.preflight import read_fleet
    from gpufleet.hostlock import Holder, HostLock, LockLost
    from gpufleet.operations.run import check_lock, release_locks
    from gpufleet.vllm.deploy import plan_for
    from gpufleet.vllm.host_read import HOST_READ

    ssh = {
        "ssh_hostname": "127.0.0.1",
        "ssh_port": sshd.port,
        "ssh_user": sshd.user,
        "ssh_key": str(sshd.client_key),
        "ssh_known_hosts_file": str(tmp_path / "known_hosts"),
    }
    # Two inventory names for the one sshd: both are the same machine, so both find the other run's lock.
    inventory = Inventory(([("gft-a", ssh), ("gft-b", {**ssh, "gpufleet_lock_wait_s": 0.5})], {}))
    state = State(inventory, Config())
    for target in inventory:
        target.connect(raise_exceptions=True)
        state.activate_host(target)
    path = str(tmp_path / "host.lock")
    alice = Holder(user="alice", controller="laptop", pid=4242, since="2026-12-01T03:00:00Z")
    read: list[str] = []

    def check_host(name, snap, plan):
        read.append(name)
        return []

    try:
        with HostLock(sshd.client(), "other-run", path=path, holder=alice).acquire():
            readings = read_fleet(state, plan_for, check_host, HOST_READ, lock_path=path)
        fix = "(fix: wait for that run to end, or pass --data gpufleet_lock_wait_s=SECONDS to wait for it)"
        assert readings["gft-a"].problems == [
            f"gft-a: locked by alice@laptop pid 4242 since 2026-12-01T03:00:00Z {fix}"
        ]
        assert readings["gft-b"].problems == [
            f"gft-b: locked by alice@laptop pid 4242 since 2026-12-01T03:00:00Z after waiting 0.5 s {fix}"
        ]
        assert read == [] and all(r.snapshot is None for r in readings.values())
        # The refused runs hold nothing: a restart step of theirs would stop there.
        for target in inventory:
            with pytest.raises(LockLost):
                check_lock(target)
    finally:
        release_locks(state)
        for target in inventory:
            target.disconnect()
            target.connector.client.close()


def test_the_lock_settings_are_validated_like_the_other_numbers():
    from gpufleet.errors import SettingErrors

    for setting, value, problem in [
        ("gpufleet_lock_wait_s", -1, "-1 is not a finite non-negative number"),
        ("gpufleet_lock_wait_s", float("inf"), "inf is not a finite non-negative number"),
        ("gpufleet_lock_lease_s", True, "True is not a finite non-negative number"),
        ("gpufleet_lock_lease_s", 0.5, "0.5 is below 2 s"),
    ]:
        with pytest.raises(SettingErrors) as bad:
            build_spec("gpu1", {setting: value})
        assert [str(e) for e in bad.value.errors] == [
            f"gpu1: {setting}: {problem} (fix: e.g. {0 if setting == 'gpufleet_lock_wait_s' else 90})"
        ]
