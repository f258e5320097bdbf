"""`gpufleet sandbox` refuses clearly (one line, no traceback) where it cannot run."""

from __future__ import annotations

import shutil

from click.testing import CliRunner

from gpufleet.cli.sandbox import sandbox
from gpufleet.sandbox import fleet


def test_up_without_root_is_one_line(monkeypatch):
    monkeypatch.setattr(fleet.os, "geteuid", lambda: 1000)
    result = CliRunner().invoke(sandbox, ["up", "1"])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "Error: the sandbox needs root (it creates network namespaces, mounts and containers)"
    ]


def test_down_without_systemd_nspawn_names_the_package(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(fleet.os, "geteuid", lambda: 0)
    monkeypatch.setattr(fleet.shutil, "which", lambda t: None if t == "systemd-nspawn" else real_which(t))
    result = CliRunner().invoke(sandbox, ["down"])
    assert result.exit_code == 1
    assert len(result.output.splitlines()) == 1
    assert "apt-get install" in result.output and "systemd-container" in result.output


def test_up_rejects_a_bad_count():
    result = CliRunner().invoke(sandbox, ["up", "0"])
    assert result.exit_code == 2 and "COUNT" in result.output


def test_inventory_points_the_deploy_at_the_local_services(tmp_path):
    import json

    from gpufleet.sandbox.config import H200x3, sandbox_config
    from gpufleet.sandbox.hosts import make
    from gpufleet.sandbox.inventory import inventory_document, pyinfra_hosts

    cfg = sandbox_config()
    doc = inventory_document(cfg, [make(cfg, 1, H200x3), make(cfg, 2, H200x3)], tmp_path / "id_ed25519")
    (tmp_path / "inventory.json").write_text(json.dumps(doc))
    hosts = pyinfra_hosts(tmp_path / "inventory.json")
    assert [(name, data["ssh_hostname"]) for name, data in hosts] == [
        ("gpuhost1", "10.213.0.11"),
        ("gpuhost2", "10.213.0.12"),
    ]
    data = hosts[0][1]
    assert data["vllm_image"] == "10.213.0.1:5000/vllm/vllm-openai:nightly"
    assert data["nvidia_repo_url"] == "http://10.213.0.1:8080/nvidia"
    assert (data["docker_install"], data["docker_repo_url"]) == ("docker-ce", "http://10.213.0.1:8080/docker/linux")
    assert data["vllm_model_repo"] == "gpufleet-sandbox/Qwen3.5-tiny"
    assert (data["ssh_user"], data["ssh_known_hosts_file"], data["ssh_strict_host_key_checking"]) == (
        "deploy",
        "/dev/null",
        "off",
    )


def test_router_hosts_are_their_own_group_with_the_local_package_index(tmp_path):
    import json

    from gpufleet.sandbox.config import NO_GPU, H200x3, sandbox_config
    from gpufleet.sandbox.hosts import make
    from gpufleet.sandbox.inventory import inventory_document, pyinfra_hosts, write_pyinfra_inventory

    cfg = sandbox_config()
    hosts = [make(cfg, 1, H200x3), make(cfg, 2, H200x3), make(cfg, 3, NO_GPU, role="router")]
    (tmp_path / "inventory.json").write_text(json.dumps(inventory_document(cfg, hosts, tmp_path / "id_ed25519")))
    assert [n for n, _ in pyinfra_hosts(tmp_path / "inventory.json")] == ["gpuhost1", "gpuhost2"]
    ((name, data),) = pyinfra_hosts(tmp_path / "inventory.json", routers=True)
    assert name == "gpuhost3" and data["router_index_url"] == "http://10.213.0.1:8080/pypi/simple"
    text = write_pyinfra_inventory(tmp_path / "inventory.json", tmp_path / "inv.py").read_text()
    assert "routers = pyinfra_hosts(" in text and "routers=True" in text


def test_up_offers_router_hosts_and_a_site_cache():
    result = CliRunner().invoke(sandbox, ["up", "--help"])
    assert result.exit_code == 0 and "--routers" in result.output and "--site-cache" in result.output


def test_the_sandbox_inventory_puts_the_site_cache_host_in_its_group(tmp_path, monkeypatch):
    """`gpufleet sandbox up --site-cache` names gpuhost1; inventories/sandbox.py (what the README's commands load)
    gives pyinfra the group, and the rollout's prepare pulls on that host first. Without it: no group member."""
    import json
    from pathlib import Path

    from gpufleet.inventory import load_pyinfra_hosts
    from gpufleet.rollout.prepare import pull_order
    from gpufleet.sandbox.config import H200x3, sandbox_config
    from gpufleet.sandbox.hosts import make
    from gpufleet.sandbox.inventory import inventory_document
    from gpufleet.sitecache.operations import SITE_CACHE_GROUP

    inventory = Path(__file__).parents[2] / "inventories" / "sandbox.py"
    cfg = sandbox_config()
    hosts = [make(cfg, i, H200x3) for i in (1, 2, 3)]
    monkeypatch.setenv("GPUFLEET_SANDBOX_DIR", str(tmp_path))
    for site_cache, members, order in [
        ((), [], [["gpuhost3", "gpuhost2", "gpuhost1"]]),
        (("gpuhost1",), ["gpuhost1"], [["gpuhost1"], ["gpuhost3", "gpuhost2"]]),
    ]:
        doc = inventory_document(cfg, hosts, tmp_path / "id_ed25519", site_cache=site_cache)
        (tmp_path / "inventory.json").write_text(json.dumps(doc))
        loaded = load_pyinfra_hosts(inventory)
        assert [h.name for h in loaded if SITE_CACHE_GROUP in h.groups] == members
        assert [h.name for h in loaded] == ["gpuhost1", "gpuhost2", "gpuhost3"]
        assert pull_order(str(inventory), ["gpuhost3", "gpuhost2", "gpuhost1"]) == order


def test_the_sandbox_inventory_says_when_its_state_is_not_readable(tmp_path, monkeypatch):
    """As a user other than root, the state dir (0700: it holds the fleet's SSH key) cannot be read: the inventory
    says so instead of claiming there is no sandbox."""
    import os
    import runpy
    from pathlib import Path

    import pytest

    inventory = Path(__file__).parents[2] / "inventories" / "sandbox.py"
    monkeypatch.setenv("GPUFLEET_SANDBOX_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match=r"no sandbox inventory at .*: run `gpufleet sandbox up` \(as root\) first"):
        runpy.run_path(str(inventory))
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(
        SystemExit, match="is root's \\(it holds the sandbox's SSH key\\): run pyinfra in the root shell"
    ):
        runpy.run_path(str(inventory))
