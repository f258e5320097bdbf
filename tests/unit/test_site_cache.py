"""The site cache (docs/site-cache.md) without hosts: docker's pull output read into bytes, the cache's config, the
daemon.json merge, the operations' decisions, how a host finds its cache, settings refused on one line, and the
order prepare pulls in."""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State, StringCommand
from pyinfra.context import ctx_host, ctx_state

from gpufleet.errors import SettingError, SettingErrors
from gpufleet.facts import pull
from gpufleet.facts.pull import PullStats
from gpufleet.inventory import load_pyinfra_hosts
from gpufleet.operations.files import sha256
from gpufleet.operations.run import remember
from gpufleet.rollout.prepare import pull_order, pull_stats
from gpufleet.sitecache import operations as site_cache
from gpufleet.sitecache.deploy import cache_pull, check_port, clients, repositories, serves_site
from gpufleet.sitecache.facts import SiteCacheHost
from gpufleet.sitecache.facts import parse as parse_cache_host
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.operations import docker
from gpufleet.vllm.settings import build_spec, resolve_host
from tests.ports import free_port

BIG = "9f3c2a7d1e55"
# docker pull of a digest (20.10, not on a terminal) through the cache: one layer present, one fetched.
CACHE_PULL = f"""10.0.0.5:5001/vllm/vllm-openai@sha256:{"7" * 64}: Pulling from vllm/vllm-openai
682958b6cb03: Already exists
{BIG}: Pulling fs layer
{BIG}: Verifying Checksum
{BIG}: Download complete
{BIG}: Pull complete
Digest: sha256:{"7" * 64}
Status: Downloaded newer image for 10.0.0.5:5001/vllm/vllm-openai@sha256:{"7" * 64}
""".splitlines()
# ... then from upstream: every layer present, the manifest only.
UPSTREAM_AFTER = f"""reg:5000/vllm/vllm-openai@sha256:{"7" * 64}: Pulling from vllm/vllm-openai
Digest: sha256:{"7" * 64}
Status: Downloaded newer image for reg:5000/vllm/vllm-openai@sha256:{"7" * 64}
""".splitlines()
# What docker 20.10 printed for a blob the cache had tampered with (recorded on a test host).
TAMPERED = (
    "filesystem layer verification failed for digest "
    "sha256:682958b6cb031ed384534a3eff3629e02082dabf3c84e006c190f667511b561b"
)


def manifest(sizes: dict[str, int]) -> bytes:
    layers = [
        {
            "mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
            "size": size,
            "digest": "sha256:" + short + "0" * 52,
        }
        for short, size in sizes.items()
    ]
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
    index = {
        "mediaType": pull.INDEX_TYPES[1],
        "manifests": [
            {"digest": "sha256:" + "a" * 64, "platform": {"architecture": "arm64", "os": "linux"}},
            {"digest": "sha256:" + "b" * 64, "platform": {"architecture": "amd64", "os": "linux"}},
        ],
    }
    assert pull.is_index(index) and not pull.is_index(json.loads(body))
    assert pull.platform_manifest(index, "amd64") == "sha256:" + "b" * 64
    assert pull.platform_manifest(index, "riscv64") is None


def test_a_tampered_blob_is_told_from_an_unreachable_cache():
    assert pull.tampered("x\n" + TAMPERED + "\n") == TAMPERED
    assert pull.tampered("Error response from daemon: manifest verification failed for digest sha256:ab") is not None
    unreachable = (
        'Error response from daemon: Get "http://10.0.0.5:5001/v2/": dial tcp 10.0.0.5:5001: connect: '
        "connection refused"
    )
    assert pull.tampered(unreachable) is None


def test_the_pull_record_round_trips_and_anything_else_is_no_record():
    stats = PullStats("reg/x@sha256:" + "1" * 64, 5, 0, False, "10.0.0.5:5001")
    assert PullStats.from_json(stats.to_json()) == stats
    assert PullStats.from_json("not json") is None
    assert PullStats.from_json('{"ref": 1}') is None
    assert PullStats.from_json(json.dumps({**json.loads(stats.to_json()), "site_bytes": "5"})) is None


def test_the_cache_config_proxies_one_registry_on_the_loopback():
    text = site_cache.render_config("https://registry-1.docker.io", 5002)
    assert text.startswith("# Managed by gpufleet")
    assert "proxy:\n  remoteurl: https://registry-1.docker.io\n" in text and "  addr: 127.0.0.1:5002\n" in text
    assert "auth:" not in text and "rootdirectory: /var/lib/docker-registry" in text


def test_the_upstream_and_the_path_on_the_cache_follow_the_image():
    assert site_cache.upstream_url("vllm/vllm-openai:nightly") == "https://registry-1.docker.io"
    assert site_cache.upstream_url("docker.io/library/ubuntu:24.04") == "https://registry-1.docker.io"
    assert site_cache.upstream_url("ghcr.io/org/img:t") == "https://ghcr.io"
    assert site_cache.repository_path("vllm/vllm-openai:nightly") == "vllm/vllm-openai"
    assert site_cache.repository_path("ubuntu:24.04") == "library/ubuntu"
    assert site_cache.repository_path("10.0.0.1:5000/vllm/vllm-openai:nightly") == "vllm/vllm-openai"
    assert site_cache.registry_host("https://index.docker.io") == site_cache.registry_host(
        "https://registry-1.docker.io"
    )


def test_insecure_registries_is_merged_keeping_every_other_key():
    before = json.dumps(
        {"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}, "insecure-registries": ["10.0.0.1:5000"]}
    )
    merged = json.loads(docker.with_insecure_registry(before, "10.0.0.5:5001") or "")
    assert merged["runtimes"] == {"nvidia": {"path": "nvidia-container-runtime"}}
    assert merged["insecure-registries"] == ["10.0.0.1:5000", "10.0.0.5:5001"]
    assert docker.with_insecure_registry(json.dumps(merged), "10.0.0.5:5001") is None
    assert json.loads(docker.with_insecure_registry(None, "h:1") or "") == {"insecure-registries": ["h:1"]}
    with pytest.raises(ValueError, match=r"^not a JSON object$"):
        docker.with_insecure_registry("[1]", "h:1")
    # The cache moved, or was turned off: the address gpufleet trusted before goes, the user's own entries stay.
    moved = json.loads(docker.with_insecure_registry(json.dumps(merged), "10.0.0.6:5001", drop={"10.0.0.5:5001"}) or "")
    assert moved["insecure-registries"] == ["10.0.0.1:5000", "10.0.0.6:5001"]
    off = json.loads(docker.with_insecure_registry(json.dumps(merged), None, drop={"10.0.0.5:5001"}) or "")
    assert off["insecure-registries"] == ["10.0.0.1:5000"] and off["runtimes"] == merged["runtimes"]
    assert docker.with_insecure_registry(json.dumps(off), None, drop={"10.0.0.5:5001"}) is None


def run_op(operation: Any, snap: HostSnapshot | None = None, **arguments: Any) -> list[Any]:
    inventory = Inventory(([("gpu1", {})], {}))
    target = inventory.get_host("gpu1")
    state = State(inventory, Config())
    remember(target, snap or HostSnapshot())
    with ctx_state.use(state), ctx_host.use(target):
        return list(operation._inner(**arguments))


def test_the_cache_is_set_up_once_and_a_second_converge_changes_nothing():
    config = site_cache.render_config("https://registry-1.docker.io", 5002)
    fresh = run_op(site_cache.serving, seen=SiteCacheHost(), upstream="https://registry-1.docker.io", port=5002)
    texts = [str(c) for c in fresh if isinstance(c, StringCommand)]
    assert any("docker-registry" in t and "install" in t for t in texts)
    assert next(c for c in fresh if isinstance(c, FileUploadCommand)).dest == site_cache.CONFIG
    assert texts[-2:] == ["systemctl enable docker-registry.service", "systemctl restart docker-registry.service"]
    converged = SiteCacheHost(installed=True, config_sha256=sha256(config), active=True, enabled=True)
    assert run_op(site_cache.serving, seen=converged, upstream="https://registry-1.docker.io", port=5002) == []
    moved = run_op(site_cache.serving, seen=converged, upstream="https://registry-1.docker.io", port=5003)
    assert [str(c) for c in moved if isinstance(c, StringCommand)][-1] == "systemctl restart docker-registry.service"
    assert (
        parse_cache_host(["installed=ii ", f"config={sha256(config)}", "active=active", "enabled=enabled"]) == converged
    )


def test_a_cache_over_its_bound_is_emptied_before_the_pull_and_one_under_it_is_kept():
    config = site_cache.render_config("https://registry-1.docker.io", 5002)
    converged = SiteCacheHost(installed=True, config_sha256=sha256(config), active=True, enabled=True)
    args = {"seen": converged, "upstream": "https://registry-1.docker.io", "port": 5002, "max_gb": 2}
    assert run_op(site_cache.serving, used_kib=2 * 1024 * 1024, **args) == []
    emptied = [str(c) for c in run_op(site_cache.serving, used_kib=2 * 1024 * 1024 + 1, **args)]
    assert emptied == [
        "systemctl stop docker-registry.service",
        "rm -rf /var/lib/docker-registry/docker",
        "systemctl restart docker-registry.service",
    ]


def test_the_front_door_is_set_up_once_and_a_second_converge_changes_nothing():
    args = {
        "port": 5001,
        "internal_port": 5002,
        "clients": ["127.0.0.1", "10.0.0.5"],
        "repositories": ["vllm/vllm-openai"],
    }
    fresh = [str(c) for c in run_op(site_cache.front_door, seen=SiteCacheHost(), **args)]
    assert "nginx" in fresh[1] and fresh[2] == "rm -f /etc/nginx/sites-enabled/default"
    assert fresh[-3:] == ["nginx -t -q", "systemctl enable nginx", "systemctl reload-or-restart nginx"]
    content = site_cache.render_front(5001, 5002, ["127.0.0.1", "10.0.0.5"], ["vllm/vllm-openai"])
    converged = SiteCacheHost(nginx=True, front_sha256=sha256(content), nginx_active=True)
    assert run_op(site_cache.front_door, seen=converged, **args) == []
    # nginx there before gpufleet (the host's own): its sites are left alone, the front door added.
    added = [str(c) for c in run_op(site_cache.front_door, seen=SiteCacheHost(nginx=True, nginx_active=True), **args)]
    assert not any("sites-enabled" in c or "apt-get" in c for c in added)


class Registry(http.server.BaseHTTPRequestHandler):
    """The registry behind the front door: what it was asked."""

    asked: ClassVar[list[str]] = []

    def do_GET(self):
        Registry.asked.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_the_front_door_lets_the_inventorys_hosts_pull_its_repositories_by_digest_and_nothing_else(tmp_path):
    import shutil

    if not shutil.which("nginx"):
        pytest.skip("no nginx on this machine (the integration tier runs it on the site cache host)")
    registry = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=registry.serve_forever, daemon=True).start()
    port = free_port()
    site = site_cache.render_front(port, registry.server_address[1], ["127.0.0.1"], ["vllm/vllm-openai", "org/x.y"])
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        f"daemon off; pid {tmp_path}/nginx.pid; error_log stderr; events {{}} http {{ access_log off; {site} }}"
    )
    nginx = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(tmp_path)], stderr=subprocess.PIPE, text=True)
    digest = "sha256:" + "ab" * 32

    def get(path: str, method: str = "GET", source: str = "127.0.0.1") -> int:
        with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as sock:
            sock.sendall(f"{method} {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
            return int(sock.makefile("rb").readline().split()[1])

    try:
        for _ in range(100):
            try:
                get("/v2/")
                break
            except OSError:
                time.sleep(0.05)
        Registry.asked.clear()
        assert get("/v2/") == 200
        assert get(f"/v2/vllm/vllm-openai/manifests/{digest}") == 200
        assert get(f"/v2/org/x.y/blobs/{digest}") == 200
        assert get(f"/v2/x/../vllm/vllm-openai/blobs/{digest}") == 200  # asked as nginx resolved it
        assert Registry.asked == [
            "/v2/",
            f"/v2/vllm/vllm-openai/manifests/{digest}",
            f"/v2/org/x.y/blobs/{digest}",
            f"/v2/vllm/vllm-openai/blobs/{digest}",
        ]
        # Another repository of upstream, a tag (the cache would resolve it), a push, a catalogue, another client.
        for path, method, source in [
            (f"/v2/library/ubuntu/manifests/{digest}", "GET", "127.0.0.1"),
            (f"/v2/org/xxy/manifests/{digest}", "GET", "127.0.0.1"),
            ("/v2/vllm/vllm-openai/manifests/latest", "GET", "127.0.0.1"),
            ("/v2/vllm/vllm-openai/blobs/uploads/", "POST", "127.0.0.1"),
            (f"/v2/vllm/vllm-openai/manifests/{digest}", "PUT", "127.0.0.1"),
            ("/v2/_catalog", "GET", "127.0.0.1"),
            (f"/v2/library%2Fubuntu/manifests/{digest}", "GET", "127.0.0.1"),
            (f"/v2/vllm/vllm-openai/manifests/{digest}", "GET", "127.0.0.2"),
            ("/v2/", "GET", "127.0.0.2"),
        ]:
            assert get(path, method, source) == 403, (path, method, source)
        assert len(Registry.asked) == 4
    finally:
        nginx.terminate()
        nginx.wait(10)
        registry.shutdown()
        registry.server_close()


def test_trusting_the_cache_reloads_docker_only_when_the_address_is_new():
    listed = HostSnapshot(
        daemon_json={"insecure-registries": ["10.0.0.5:5001"]}, file_sha256={docker.TRUSTED: sha256("10.0.0.5:5001\n")}
    )
    assert run_op(docker.trusts_site_cache, listed, address="10.0.0.5:5001") == []
    (merge,) = run_op(docker.trusts_site_cache, HostSnapshot(daemon_json={"runtimes": {}}), address="10.0.0.5:5001")
    assert isinstance(merge, FunctionCommand)
    # The cache turned off or moved: the address gpufleet recorded is taken out; without a record, nothing to do.
    assert len(run_op(docker.trusts_site_cache, listed, address=None)) == 1
    assert len(run_op(docker.trusts_site_cache, listed, address="10.0.0.6:5001")) == 1
    assert (
        run_op(
            docker.trusts_site_cache, HostSnapshot(daemon_json={"insecure-registries": ["10.0.0.5:5001"]}), address=None
        )
        == []
    )


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
    settings = resolve_host("gpu2", {"site_cache_pull_timeout_s": 60})[1]
    image = "vllm/vllm-openai:nightly"
    got = cache_pull(hosts["gpu2"], settings, image)
    assert got is not None and got.address == "10.0.0.5:5001" and got.cache_host == "gpu1"
    assert got.ref("sha256:" + "1" * 64) == "10.0.0.5:5001/vllm/vllm-openai@sha256:" + "1" * 64
    assert serves_site(hosts["gpu1"]) and not serves_site(hosts["gpu2"])
    assert cache_pull(hosts["gpu3"], replace(settings, site_cache_address="off"), image) is None
    # One cache proxies one registry: an image from another registry is pulled from it directly.
    assert cache_pull(hosts["gpu2"], settings, "ghcr.io/org/vllm:nightly") is None
    other = cache_pull(hosts["gpu2"], replace(settings, site_cache_address="10.9.0.1:5001"), image)
    assert other is not None and other.address == "10.9.0.1:5001"


def test_prepare_pulls_on_the_cache_host_first_then_the_rest_at_once(inventory: Path, tmp_path: Path):
    assert pull_order(str(inventory), ["gpu2", "gpu1", "gpu3"]) == [["gpu1"], ["gpu2", "gpu3"]]
    assert pull_order(str(inventory), ["gpu2", "gpu3"]) == [["gpu2"], ["gpu3"]]  # the canary first
    assert pull_order(str(inventory), ["gpu2"]) == [["gpu2"]]
    plain = tmp_path / "plain.py"
    plain.write_text('gpuhosts = [("gpu1", {}), ("gpu2", {})]\n')
    assert pull_order(str(plain), ["gpu1", "gpu2"]) == [["gpu1", "gpu2"]]  # no cache: one run, as before


def test_the_cache_lets_in_every_vllm_host_of_the_inventory_and_serves_their_repositories(tmp_path: Path):
    path = tmp_path / "inv.py"
    path.write_text(
        "gpuhosts = [('gpu1', {'ssh_hostname': '10.0.0.5', 'vllm_image': 'vllm/vllm-openai:nightly'}), "
        "('localhost', {'vllm_image': 'ghcr.io/org/vllm:x'}), ('gpu3', {'ssh_hostname': 'fd00::3'})]\n"
        "routers = [('rtr', {'ssh_hostname': '10.0.0.9'})]\n"
        "site_cache = [('gpu1', {})]\n"
    )
    inventory = load_pyinfra_hosts(path)[0].inventory
    found = clients(inventory, ["10.0.1.0/24"])
    assert found[:3] == ["127.0.0.1", "::1", "10.0.1.0/24"]  # the host itself, then site_cache_clients
    assert {"10.0.0.5", "fd00::3", "127.0.0.1"} <= set(found) and "10.0.0.9" not in found  # a router pulls nothing
    assert repositories(inventory, "https://registry-1.docker.io") == ["vllm/vllm-openai", "vllm/vllm-openai"]
    unresolved = tmp_path / "unresolved.py"
    unresolved.write_text(
        "gpuhosts = [('gpu1', {'ssh_hostname': 'no-such-host.invalid'})]\nsite_cache = [('gpu1', {})]\n"
    )
    with pytest.raises(SettingErrors) as unknown:
        clients(load_pyinfra_hosts(unresolved)[0].inventory, [])
    assert str(unknown.value).startswith("gpu1: ssh_hostname: no-such-host.invalid does not resolve (")
    assert "(fix: set ssh_hostname to its address, or add it to site_cache_clients)" in str(unknown.value)


@pytest.mark.parametrize(
    ("setting", "value", "expected"),
    [
        ("site_cache_port", 0, "site_cache_port: 0 is not a TCP port"),
        ("site_cache_internal_port", 5001, "site_cache_internal_port: is site_cache_port too"),
        ("site_cache_clients", ["10.0.0.0/33"], "site_cache_clients: ['10.0.0.0/33'] is not a list of addresses"),
        ("site_cache_clients", "10.0.0.5", "site_cache_clients: '10.0.0.5' is not a list of addresses"),
        ("site_cache_max_gb", 0, "site_cache_max_gb: 0 is not a positive number of GB"),
        ("site_cache_max_gb", float("inf"), "site_cache_max_gb: inf is not a positive number of GB"),
        ("site_cache_model_max_gb", "500", "site_cache_model_max_gb: '500' is not a positive number of GB"),
        ("site_cache_mirror_port", 70000, "site_cache_mirror_port: 70000 is not a TCP port"),
        (
            "site_cache_mirror_index_url",
            "https://x/simple;rm -rf /",
            "site_cache_mirror_index_url: 'https://x/simple;rm -rf /' is not a plain http(s) URL",
        ),
        ("site_cache_upstream", "ftp://x", "site_cache_upstream: 'ftp://x' is not a plain http(s) URL"),
        ("site_cache_address", "10.0.0.5", "site_cache_address: '10.0.0.5' is not host:port"),
        ("site_cache_pull_timeout_s", 0, "site_cache_pull_timeout_s: 0 is not a positive number of seconds"),
    ],
)
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
    sessions = RecordedSessions(
        {"a": mine, "b": PullStats("reg/x@sha256:" + "2" * 64, 0, 9, True), "c": None, "d": "d: could not connect"}
    )
    got = pull_stats(sessions, ["a", "b", "c", "d"], target)  # type: ignore[arg-type]
    assert got == {"a": mine, "b": None, "c": None, "d": None}


def test_the_cache_host_cannot_take_its_own_vllm_port(inventory: Path):
    loaded = Inventory(([("gpu1", {}), ("gpu2", {})], {}), site_cache=([("gpu1", {})], {}))
    ports = resolve_host("gpu1", {"site_cache_port": 5001, "site_cache_internal_port": 5002})[1]
    check_port(loaded, "gpu2", replace(ports, site_cache_port=5000), 5000)  # not the cache host: no clash
    with pytest.raises(SettingErrors) as raised:
        check_port(loaded, "gpu1", replace(ports, site_cache_port=5000), 5000)
    assert str(raised.value).startswith("gpu1: site_cache_port: 5000 is vllm_port too")
    with pytest.raises(SettingErrors) as raised:
        check_port(loaded, "gpu1", ports, 5002)
    assert str(raised.value).startswith("gpu1: site_cache_internal_port: 5002 is vllm_port too")


def test_the_model_mirror_is_installed_from_the_lock_once_and_a_second_converge_changes_nothing():
    from gpufleet.sitecache import facts, mirror

    install = mirror.locked("cache", "3.11", "x86_64")
    config = mirror.render_config("https://huggingface.co", 5003, "10.0.0.5:5001", ["Qwen/Qwen3.5-27B-AWQ"], 500)
    args = {"install": install, "config": config, "index_url": "https://pypi.org/simple", "port": 5003}
    fresh = [str(c) for c in run_op(site_cache.model_mirror, seen=SiteCacheHost(python3_venv=True), **args)]
    assert any("--require-hashes" in c and "--no-deps" in c for c in fresh)
    assert fresh[-3:-1] == [f"systemctl enable {mirror.UNIT}", f"systemctl restart {mirror.UNIT}"]
    assert "until curl" in fresh[-1] and "127.0.0.1:5003" in fresh[-1]
    converged = SiteCacheHost(
        python3_venv=True,
        mirror_key=install.key,
        mirror_config_sha256=sha256(config),
        mirror_unit_sha256=sha256(mirror.render_unit()),
        mirror_active=True,
        mirror_enabled=True,
    )
    assert run_op(site_cache.model_mirror, seen=converged, **args) == []
    # What the fact reads back, as the host prints it.
    seen = facts.parse(
        [
            "python=3.11",
            "machine=x86_64",
            "python3_venv=install_ok_installed",
            f"mirror_key={install.key}",
            "mirror_active=active",
            "mirror_enabled=enabled",
        ]
    )
    assert (seen.python, seen.machine, seen.mirror_key, seen.mirror_active) == ("3.11", "x86_64", install.key, True)
    # Only the inventory's repositories, never a redirect, nothing from Xet.
    assert 'repo = "Qwen/Qwen3.5-27B-AWQ", allow = true' in config and 'repo = "*/*", allow = false' in config
    assert "cache-redirect-model = false" in config and "xet-passthrough = false" in config
    # No wheels for the host: its one line, and nothing installed.
    with pytest.raises(SettingError, match=r"has no wheels for the host's Python 3\.11 on aarch64"):
        mirror.locked("cache", "3.11", "aarch64")
