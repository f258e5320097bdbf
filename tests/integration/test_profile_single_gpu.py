"""The qwen35-1gpu profile on a fresh 1-GPU test host: the real deploy converges it to exactly what `gpufleet
render` shows, `gpufleet verify` passes over SSH, and a second converge changes nothing.

The host's only profile-related setting is vllm_profile: GPUs, model directory, service name and cache dir all
come from the profile (the sandbox's host data points vllm_model_repo at its stand-in repo, as for every test host).
Last, the same host with its port published on the host's own address only (vllm_publish_address): converged,
verified and a no-op again, the checks reaching it there.
"""

from __future__ import annotations

import json

import pytest

from gpufleet.inventory import load_vllm_hosts
from gpufleet.sandbox.config import H200x1
from gpufleet.vllm.profiles import PROFILES
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.unit import render_unit
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.test_deploy_qwen35 import deploy, sh, write_inventory
from tests.integration.test_health_ssh import gpufleet

PROFILE = PROFILES["qwen35-1gpu"]
SERVICE = PROFILE.service


@pytest.fixture(scope="module")
def converged(fleet, pyinfra, _fresh_numbers, tmp_path_factory):
    """A fresh 1x H200 host converged from bare with vllm_profile qwen35-1gpu: (host, inventory, first output)."""
    (host,) = fleet.add_hosts([H200x1], first=next(_fresh_numbers))
    try:
        inv = write_inventory(
            tmp_path_factory.mktemp("one-gpu"),
            fleet.write_inventory(),
            [host.name],
            {host.name: {"vllm_profile": PROFILE.name}},
        )
        yield host, inv, deploy(pyinfra, inv).stdout
    finally:
        fleet.remove_hosts([host.name])


def test_a_bare_one_gpu_host_serves_the_profile(converged, fleet):
    host, inv, out = converged
    assert changes(out) > 0 and "ready: /health 200" in out
    assert sh(fleet, host, f"systemctl is-active {SERVICE}").strip() == "active"
    ((name, data),) = load_vllm_hosts(inv)
    spec = build_spec(name, data)
    assert spec.gpus == (0,) and spec.arg("pipeline-parallel-size") is None
    # The unit on the host is the render for the digest the deploy pinned, byte for byte.
    committed = json.loads(fleet.read_file(host, f"/var/lib/gpufleet/{SERVICE}.json"))["committed"]
    assert fleet.read_file(host, f"/etc/systemd/system/{SERVICE}.service").decode() == render_unit(
        spec, committed["ref"], committed["model"]
    )
    # The model landed under the profile's directory name, the caches under the profile's cache dir.
    assert sh(fleet, host, f"test -f /srv/vllm/models/{PROFILE.model}/config.json && echo yes").strip() == "yes"
    cache = PROFILE.settings["vllm_cache_dir"]
    assert sh(fleet, host, f"ls {cache}").split() == sorted(["ComputeCache", "huggingface", "torch", "vllm"])
    # Nothing of the qwen35 profile's: it can be added beside this one later.
    assert (
        sh(
            fleet,
            host,
            "ls /etc/systemd/system/vllm-qwen35.service /var/cache/vllm/qwen35 2>&1 | grep -c 'No such file'",
        ).strip()
        == "2"
    )


def test_verify_passes_with_the_profiles_model_and_cache_config(converged):
    _, inv, _ = converged
    result = gpufleet("verify", str(inv), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(result.stdout)["hosts"]
    assert row["state"] == "ready", row["detail"]
    assert row["served_model"] == PROFILE.model and row["max_model_len"] == 262144
    assert row["gpus"] == [0]
    assert row["cache_config"].get("mamba_cache_mode") == "align", row["cache_config"]


def test_second_converge_changes_nothing(converged, pyinfra):
    _, inv, _ = converged
    out = deploy(pyinfra, inv).stdout
    assert changes(out) == 0, changed_ops(out)


def test_a_port_published_on_the_hosts_own_address_is_checked_there(converged, fleet, pyinfra, tmp_path):
    # docker then publishes on that address only: the deploy's checks (and verify's) dialled 127.0.0.1, got
    # "connection refused" from a serving host, and waited out vllm_ready_timeout towards a rollback.
    host, _, _ = converged
    inv = write_inventory(
        tmp_path,
        fleet.write_inventory(),
        [host.name],
        {host.name: {"vllm_profile": PROFILE.name, "vllm_publish_address": host.ip, "vllm_ready_timeout": 120}},
    )
    out = deploy(pyinfra, inv).stdout
    assert "ready: /health 200" in out and "answer check stream: " in out, out[-3000:]
    published = sh(fleet, host, "docker ps --format '{{.Ports}}'").strip()
    assert published.startswith(f"{host.ip}:") and "0.0.0.0" not in published, published
    result = gpufleet("verify", str(inv), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert changes(deploy(pyinfra, inv).stdout) == 0
