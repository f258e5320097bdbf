"""The site cache (docs/site-cache.md) without hosts: docker's pull output read into bytes, the cache's config, the
daemon.json merge, the operations' decisions, how a host finds its cache, settings refused on one line, and the
order prepare pulls in."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State, StringCommand
from pyinfra.context import ctx_host, ctx_state

from gpufleet.errors import SettingErrors
from gpufleet.facts import pull
from gpufleet.facts.pull import PullStats
from gpufleet.inventory import load_pyinfra_hosts
from gpufleet.operations.files import sha256
from gpufleet.operations.run import remember
from gpufleet.rollout.prepare import pull_order, pull_stats
from gpufleet.sitecache import operations as site_cache
from gpufleet.sitecache.deploy import cache_pull, check_port, serves_site
from gpufleet.sitecache.facts import SiteCacheHost
from gpufleet.sitecache.facts import parse as parse_cache_host
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.operations import docker
from gpufleet.vllm.settings import build_spec

BIG = "9f3c2a7d1e55"
# docker pull of a digest (20.10, not on a terminal) through the cache: one layer present, one fetched.
CACHE_PULL = f"""10.0.0.5:5001/vllm/vllm-openai@sha256:{'7' * 64}: Pulling from vllm/vllm-openai
682958b6cb03: Already exists
{BIG}: Pulling fs layer
{BIG}: Verifying Checksum
{BIG}: Download complete
{BIG}: Pull complete
Digest: sha256:{'7' * 64}
Status: Downloaded newer image for 10.0.0.5:5001/vllm/vllm-openai@sha256:{'7' * 64}
""".splitlines()
# ... then from upstream: every layer present, the manifest only.
UPSTREAM_AFTER = f"""reg:5000/vllm/vllm-openai@sha256:{'7' * 64}: Pulling from vllm/vllm-openai
Digest: sha256:{'7' * 64}
Status: Downloaded newer image for reg:5000/vllm/vllm-openai@sha256:{'7' * 64}
""".splitlines()
# What docker 20.10 printed for a blob the cache had tampered with (recorded on a test host).
TAMPERED = ("filesystem layer verification failed for digest "
            "sha256:682958b6cb031ed384534a3eff3629e02082dabf3c84e006c190f667511b561b")


def manifest(sizes: dict[str, int]) -> bytes:
    layers = [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "size": size,
               "digest": "sha256:" + short + "0" * 52} for short, size in sizes.items()]
    return json.dumps({"schemaVersion": 2, "mediaType": pull.MANIFEST_TYPES[0], "layers": layers}).encode()


def digest_of(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def test_the_bytes_of_each_pull_are_the_manifest_sizes_of_the_layers_it_fetched():
    body = manifest({"682958b6cb03": 13_327_361, BIG: 104_900_000})
    sizes = pull.layer_sizes(pull.verified_manifest(body, digest_of(body)) or {})
    assert pull.downloaded(CACHE_PULL) == {BIG}
    assert pull.pulled_bytes(pull.downloaded(CACHE_PULL), sizes) == 104_900_000
    assert pull.pulled_bytes(pull.downloaded(UPSTREAM_AFTER), sizes) == 0
    assert pull.pulled_bytes({BIG}, None) is None  # sizes unknown: unknown, never 0


def test_a_manifest_is_read_only_when_it_hashes_to_the_digest_and_an_index_leads_to_the_platform():
    body = manifest({BIG: 1})
    assert pull.verified_manifest(body, "sha256:" + "0" * 64) is None
    index = {"mediaType": pull.INDEX_TYPES[1], "manifests": [
        {"digest": "sha256:" + "a" * 64, "platform": {"architecture": "arm64", "os": "linux"}},
        {"digest": "sha256:" + "b" * 64, "platform": {"architecture": "amd64", "os": "linux"}}]}
    assert pull.is_index(index) and not pull.is_index(json.loads(body))
    assert pull.platform_manifest(index, "amd64") == "sha256:" + "b" * 64
    assert pull.platform_manifest(index, "riscv64") is None


def test_a_tampered_blob_is_told_from_an_unreachable_cache():
    assert pull.tampered("x\n" + TAMPERED + "\n") == TAMPERED
    assert pull.tampered("Error response from daemon: manifest verification failed for digest sha256:ab") is not None
    unreachable = ('Error response from daemon: Get "http://10.0.0.5:5001/v2/": dial tcp 10.0.0.5:5001: connect: '
                   "connection refused")
    assert pull.tampered(unreachable) is None


def test_the_pull_record_round_trips_and_anything_else_is_no_record():
    stats = PullStats("reg/x@sha256:" + "1" * 64, 5, 0, False, "10.0.0.5:5001")
    assert PullStats.from_json(stats.to_json()) == stats
    assert PullStats.from_json("not json") is None
    assert PullStats.from_json('{"ref": 1}') is None
    assert PullStats.from_json(json.dumps({**json.loads(stats.to_json()), "site_bytes": "5"})) is None


def test_the_cache_config_proxies_one_registry_on_its_port():
    text = site_cache.render_config("https://registry-1.docker.io", 5001)
    assert text.startswith("# Managed by gpufleet")
    assert "proxy:\n  remoteurl: https://registry-1.docker.io\n" in text and "  addr: :5001\n" in text
    assert "auth:" not in text and "rootdirectory: /var/lib/docker-registry" in text


def test_the_upstream_and_the_path_on_the_cache_follow_the_image():
    assert site_cache.upstream_url("vllm/vllm-openai:nightly") == "https://registry-1.docker.io"
    assert site_cache.upstream_url("docker.io/library/ubuntu:24.04") == "https://registry-1.docker.io"
    assert site_cache.upstream_url("ghcr.io/org/img:t") == "https://ghcr.io"
    assert site_cache.repository_path("vllm/vllm-openai:nightly") == "vllm/vllm-openai"
    assert site_cache.repository_path("ubuntu:24.04") == "library/ubuntu"
    assert site_cache.repository_path("10.0.0.1:5000/vllm/vllm-openai:nightly") == "vllm/vllm-openai"
    assert site_cache.registry_host("https://index.docker.io") == site_cache.registry_host("https://registry-1.docker.io")


def test_insecure_registries_is_merged_keeping_every_other_key():
    before = json.dumps({"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}},
                         "insecure-registries": ["10.0.0.1:5000"]})
    merged = json.loads(docker.with_insecure_registry(before, "10.0.0.5:5001") or "")
    assert merged["runtimes"] == {"nvidia": {"path": "nvidia-container-runtime"}}
    assert merged["insecure-registries"] == ["10.0.0.1:5000", "10.0.0.5:5001"]
    assert docker.with_insecure_registry(json.dumps(merged), "10.0.0.5:5001") is None
    assert json.loads(docker.with_insecure_registry(None, "h:1") or "") == {"insecure-registries": ["h:1"]}
    with pytest.raises(ValueError):
        docker.with_insecure_registry("[1]", "h:1")


def run_op(operation: Any, snap: HostSnapshot | None = None, **arguments: Any) -> list[Any]:
    inventory = Inventory(([("gpu1", {})], {}))
    target = inventory.get_host("gpu1")
    state = State(inventory, Config())
    remember(target, snap or HostSnapshot())
    with ctx_state.use(state), ctx_host.use(target):
        return list(operation._inner(**arguments))


def test_the_cache_is_set_up_once_and_a_second_converge_changes_nothing():
    config = site_cache.render_config("https://registry-1.docker.io", 5001)
    fresh = run_op(site_cache.serving, seen=SiteCacheHost(), upstream="https://registry-1.docker.io", port=5001)
    texts = [str(c) for c in fresh if isinstance(c, StringCommand)]
    assert any("docker-registry" in t and "install" in t for t in texts)
    assert [c for c in fresh if isinstance(c, FileUploadCommand)][0].dest == site_cache.CONFIG
    assert texts[-2:] == ["systemctl enable docker-registry.service", "systemctl restart docker-registry.service"]
    converged = SiteCacheHost(installed=True, config_sha256=sha256(config), active=True, enabled=True)
    assert run_op(site_cache.serving, seen=converged, upstream="https://registry-1.docker.io", port=5001) == []
    moved = run_op(site_cache.serving, seen=converged, upstream="https://registry-1.docker.io", port=5002)
    assert [str(c) for c in moved if isinstance(c, StringCommand)][-1] == "systemctl restart docker-registry.service"
    assert parse_cache_host(["installed=ii ", f"config={sha256(config)}", "active=active", "enabled=enabled"]) == converged


def test_trusting_the_cache_reloads_docker_only_when_the_address_is_new():
    listed = HostSnapshot(daemon_json={"insecure-registries": ["10.0.0.5:5001"]})
    assert run_op(docker.trusts_registry, listed, address="10.0.0.5:5001") == []
    merge, reload = run_op(docker.trusts_registry, HostSnapshot(daemon_json={"runtimes": {}}), address="10.0.0.5:5001")
    assert isinstance(merge, FunctionCommand)
    assert str(reload) == "systemctl try-reload-or-restart docker.service"  # SIGHUP: no container restarts


INVENTORY = """
gpuhosts = [("gpu1", {"ssh_hostname": "10.0.0.5"}), ("gpu2", {}), ("gpu3", {"site_cache_address": "off"})]
site_cache = [("gpu1", {"ssh_hostname": "10.0.0.5"})]
"""


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inv.py"
    path.write_text(INVENTORY)
    return path


def test_each_host_finds_the_cache_the_inventory_names(inventory: Path):
    hosts = {h.name: h for h in load_pyinfra_hosts(inventory)}
    settings = {"site_cache_address": "", "site_cache_upstream": "", "site_cache_pull_timeout_s": 60}
    image = "vllm/vllm-openai:nightly"
    got = cache_pull(hosts["gpu2"], settings, image)
    assert got is not None and got.address == "10.0.0.5:5001" and got.cache_host == "gpu1"
    assert got.ref("sha256:" + "1" * 64) == "10.0.0.5:5001/vllm/vllm-openai@sha256:" + "1" * 64
    assert serves_site(hosts["gpu1"]) and not serves_site(hosts["gpu2"])
    assert cache_pull(hosts["gpu3"], {**settings, "site_cache_address": "off"}, image) is None
    # One cache proxies one registry: an image from another registry is pulled from it directly.
    assert cache_pull(hosts["gpu2"], settings, "ghcr.io/org/vllm:nightly") is None
    other = cache_pull(hosts["gpu2"], {**settings, "site_cache_address": "10.9.0.1:5001"}, image)
    assert other is not None and other.address == "10.9.0.1:5001"


def test_prepare_pulls_on_the_cache_host_first_then_the_rest_at_once(inventory: Path, tmp_path: Path):
    assert pull_order(str(inventory), ["gpu2", "gpu1", "gpu3"]) == [["gpu1"], ["gpu2", "gpu3"]]
    assert pull_order(str(inventory), ["gpu2", "gpu3"]) == [["gpu2"], ["gpu3"]]  # the canary first
    assert pull_order(str(inventory), ["gpu2"]) == [["gpu2"]]
    plain = tmp_path / "plain.py"
    plain.write_text('gpuhosts = [("gpu1", {}), ("gpu2", {})]\n')
    assert pull_order(str(plain), ["gpu1", "gpu2"]) == [["gpu1", "gpu2"]]  # no cache: one run, as before


@pytest.mark.parametrize(("setting", "value", "expected"), [
    ("site_cache_port", 0, "site_cache_port: 0 is not a TCP port"),
    ("site_cache_upstream", "ftp://x", "site_cache_upstream: 'ftp://x' is not a plain http(s) URL"),
    ("site_cache_address", "10.0.0.5", "site_cache_address: '10.0.0.5' is not host:port"),
    ("site_cache_pull_timeout_s", 0, "site_cache_pull_timeout_s: 0 is not a positive number of seconds"),
])
def test_a_bad_site_cache_setting_is_one_line_with_its_fix(setting: str, value: Any, expected: str):
    with pytest.raises(SettingErrors) as raised:
        build_spec("gpu1", {setting: value})
    (line,) = str(raised.value).splitlines()
    assert line.startswith(f"gpu1: {expected}") and "(fix: " in line


class RecordedSessions:
    """What Sessions.each gives: each host's value, or the line saying why it could not be read."""

    def __init__(self, values: dict[str, Any]):
        self.values = values

    def each(self, names: list[str], fn: Any) -> dict[str, Any]:
        return {n: self.values[n] for n in names}


def test_the_rollout_reads_each_hosts_record_of_its_target_only():
    target = "reg/x@sha256:" + "1" * 64
    mine = PullStats(target, 100, 0, False, "10.0.0.5:5001")
    sessions = RecordedSessions({"a": mine, "b": PullStats("reg/x@sha256:" + "2" * 64, 0, 9, True), "c": None,
                                 "d": "d: could not connect"})
    got = pull_stats(sessions, ["a", "b", "c", "d"], target)  # type: ignore[arg-type]
    assert got == {"a": mine, "b": None, "c": None, "d": None}


def test_the_cache_host_cannot_take_its_own_vllm_port(inventory: Path):
    loaded = Inventory((
        [("gpu1", {}), ("gpu2", {})], {}), site_cache=([("gpu1", {})], {}))
    check_port(loaded, "gpu2", {"site_cache_port": 5000}, 5000)  # not the cache host: no clash
    with pytest.raises(SettingErrors) as raised:
        check_port(loaded, "gpu1", {"site_cache_port": 5000}, 5000)
    assert str(raised.value).startswith("gpu1: site_cache_port: 5000 is vllm_port too")
