"""The router package offline: settings -> RouterSpec (one-line errors), the argv and unit, the host fact's parser,
the router's API answers and metrics as the real vllm-router 0.1.17 gave them (tests/fixtures/router/)."""

from __future__ import annotations

import http.server
import json
import re
import shlex
import subprocess
import threading
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import ClassVar

import pytest

from gpufleet.errors import SettingError, SettingErrors
from gpufleet.remote.transport import SshTransport
from gpufleet.router import facts, status
from gpufleet.router.api import Router, RouterError, router_samples
from gpufleet.router.settings import DEFAULTS, POLICIES, build_router_spec, replicas, resolve_router, worker_url
from gpufleet.router.spec import RouterSpec
from gpufleet.router.unit import render_proxy, render_session_script, render_unit
from gpufleet.sandbox.router_index import project_name, write_simple_index
from gpufleet.vllm.settings import BEHIND_ROUTER_ARGS
from gpufleet.vllm.spec import reach_address
from tests import frontdoor
from tests.ports import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "router"
WORKERS = ("http://10.0.0.11:5000", "http://10.0.0.12:5000")


def spec(**data: object) -> RouterSpec:
    return build_router_spec("router1", data, WORKERS)


# --- settings ----------------------------------------------------------------------------------------------------
def test_defaults_make_a_sticky_least_loaded_router_keyed_at_the_front_door_on_port_8000():
    s = spec()
    assert (s.policy, s.port, s.version, s.index_url) == (
        "sticky_least_loaded",
        8000,
        "0.1.17",
        "https://pypi.org/simple",
    )
    assert s.keys_sessions and not spec(router_policy="cache_aware").keys_sessions
    assert s.workers == WORKERS


@pytest.mark.parametrize(
    ("setting", "value", "words"),
    [
        ("router_port", 0, "not a TCP port"),
        ("router_port", "8000", "not a TCP port"),
        ("router_policy", "kv_aware", "not a policy"),
        ("router_version", "latest", "not a release version"),
        ("router_index_url", "ftp://mirror/simple", "not an http(s) URL"),
        ("router_venv", "/usr", "not a directory of its own"),
        ("router_venv", "venv", "not a directory of its own"),
        ("router_service", "../evil", "not a unit name"),
        ("router_address", "everywhere", "not an IP address"),
        ("router_health_check_interval_s", 0, "positive whole number"),
        ("router_service", "a\nExecStartPre=/bin/sh", "control character"),
    ],
)
def test_a_bad_setting_is_one_line_naming_host_setting_and_fix(setting, value, words):
    with pytest.raises(SettingErrors) as caught:
        spec(**{setting: value})
    lines = str(caught.value).splitlines()
    assert any(line.startswith(f"router1: {setting}: ") and words in line and "(fix: " in line for line in lines), lines
    assert all("\n" not in str(e) for e in caught.value.errors)


def test_the_router_record_is_validated_once_frozen_and_read_by_attribute():
    settings = resolve_router("router1", {"router_venv": "/opt/r/", "router_ready_timeout": 30})
    assert (settings.venv, settings.ready_timeout, settings.policy) == ("/opt/r", 30, "sticky_least_loaded")
    assert settings.spec("router1", WORKERS) == build_router_spec("router1", {"router_venv": "/opt/r"}, WORKERS)
    with pytest.raises(FrozenInstanceError):
        settings.port = 1  # type: ignore[misc]
    with pytest.raises(SettingErrors) as caught:
        resolve_router("router1", {"router_ready_timeout": 0})
    assert str(caught.value) == (
        "router1: router_ready_timeout: 0 is not a positive whole number of seconds (fix: use e.g. 10)"
    )


def test_an_unknown_router_setting_suggests_the_close_one():
    with pytest.raises(
        SettingErrors, match=r"router1: router_polcy: unknown setting \(fix: did you mean router_policy\?\)"
    ):
        spec(router_polcy="round_robin")


def test_the_metrics_port_cannot_be_the_client_port():
    with pytest.raises(SettingErrors, match="router_metrics_port: is the same as router_port"):
        spec(router_port=9000, router_metrics_port=9000)


def test_every_policy_gpufleet_accepts_is_one_the_router_accepts():
    help_text = (FIXTURES / "vllm-router-0.1.17-help.txt").read_text()
    accepted = re.search(r"--policy \{([a-z_,]+)\}", help_text)[1].split(",")
    assert set(POLICIES) <= set(accepted)


def test_sticky_least_loaded_is_a_policy_gpufleet_runs():
    assert spec(router_policy="sticky_least_loaded").policy == "sticky_least_loaded"


def test_replicas_behind_a_router_can_serve_cache_aware():
    # cache_aware routes on token ids from the worker's POST /v1/chat/completions/render, which vLLM serves only with
    # --enable-scale-out (measured: docs/router.md): replicas behind a router get it (gpufleet.vllm.settings), so
    # router_policy = "cache_aware" needs no change to them.
    assert "cache_aware" in POLICIES
    assert BEHIND_ROUTER_ARGS == {"enable-scale-out": True}


def test_every_flag_a_replica_behind_a_router_gets_is_one_vllm_knows():
    help_text = (FIXTURES.parent / "vllm" / "serve-help-all.txt").read_text()
    for flag in BEHIND_ROUTER_ARGS:
        assert re.search(rf"^  --{re.escape(flag)}[ ,\n]", help_text, re.M), flag


def test_the_router_argv_adds_no_routing_argument_beyond_the_policy():
    # The router's own thresholds: the measured fixes are at the front door and on the replicas, not in the router.
    argv = spec().argv()
    assert argv[argv.index("--policy") + 1] == DEFAULTS["router_policy"]
    assert not {"--cache-threshold", "--balance-abs-threshold", "--balance-rel-threshold"} & set(argv)


# --- worker addresses ----------------------------------------------------------------------------------------------
def test_a_replica_is_reached_at_its_ssh_hostname_and_vllm_port():
    assert worker_url("gpu1", {"ssh_hostname": "10.0.0.11", "vllm_port": 8001}) == "http://10.0.0.11:8001"
    assert worker_url("gpu1.lab", {}) == "http://gpu1.lab:5000"


def test_a_port_published_on_one_address_is_reached_there():
    assert (
        worker_url("gpu1", {"ssh_hostname": "bastion", "vllm_publish_address": "192.168.5.11"})
        == "http://192.168.5.11:5000"
    )
    assert (
        worker_url("gpu1", {"ssh_hostname": "10.0.0.11", "vllm_publish_address": "0.0.0.0"}) == "http://10.0.0.11:5000"
    )


def test_router_worker_address_wins_and_ipv6_is_bracketed():
    assert worker_url("gpu1", {"ssh_hostname": "a", "router_worker_address": "fd00::11"}) == "http://[fd00::11]:5000"


def test_a_replica_on_loopback_only_is_refused_naming_the_fix():
    with pytest.raises(
        SettingError, match=r"gpu1: vllm_publish_address: 127\.0\.0\.1 keeps vLLM off the network.*fix: "
    ):
        worker_url("gpu1", {"vllm_publish_address": "127.0.0.1"})


def test_replicas_lists_every_problem_at_once():
    with pytest.raises(SettingErrors) as caught:
        replicas(
            [("a", {"vllm_publish_address": "127.0.0.1"}), ("b", {"router_worker_address": "bad host!"}), ("c", {})]
        )
    assert [e.host for e in caught.value.errors] == ["a", "b"]


# --- argv, install, unit -------------------------------------------------------------------------------------------
def test_argv_names_policy_port_and_metrics_and_never_the_workers():
    argv = spec(router_policy="consistent_hash").argv()
    assert argv[0] == "/opt/vllm-router/bin/vllm-router"
    joined = " ".join(argv)
    # vllm-router itself listens on the loopback only: its worker management API shares its port.
    for part in (
        "--policy consistent_hash",
        "--port 28000",
        "--host 127.0.0.1",
        "--prometheus-host 127.0.0.1",
        "--prometheus-port 29000",
    ):
        assert part in joined
    # Membership is kept through the router's API and its members file, never in what the unit runs: a replica's
    # readiness must not rewrite or restart the router (nor keep it from listening until every worker answers).
    assert "--worker-urls" not in joined and "10.0.0.11" not in render_unit(spec()).split("ExecStartPost")[0]


def test_the_unit_replays_the_members_file_after_each_start_without_waiting_on_a_worker():
    s = spec()
    assert s.members_text() == "http://10.0.0.11:5000\nhttp://10.0.0.12:5000\n"
    [line] = [line for line in render_unit(s).splitlines() if line.startswith("ExecStartPost=")]
    assert line.startswith('ExecStartPost=+/bin/sh -c "')  # as root: the fence refuses the router's own user
    script = s.rejoin_argv()[2]
    assert f"< {s.members_file}" in script and s.members_file == "/var/lib/gpufleet-router/vllm-router.workers"
    # Each add in the background: one replica that is down never holds the start.
    assert '--data-urlencode "url=$u" http://127.0.0.1:28000/add_worker & }' in script
    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0
    # The same unit, whoever is ready: the membership is not what the unit runs.
    assert render_unit(s) == render_unit(build_router_spec("router1", {}, WORKERS[:1]))


def test_before_the_router_listens_its_port_is_fenced_to_root_and_nginx():
    from tests.unit.systemd_words import split_exec

    s = spec(router_internal_port=18000)
    [line] = [line for line in render_unit(s).splitlines() if line.startswith("ExecStartPre=")]
    assert line.startswith("ExecStartPre=+/usr/sbin/nft ")  # "+": as root, the router's own user cannot load it
    assert split_exec(line.removeprefix("ExecStartPre=+")) == s.fence_argv()
    script = s.fence_argv()[1]
    # One transaction that replaces the table: a second start loads the same rule once.
    assert script.startswith(
        "table inet gpufleet-router-18000; delete table inet gpufleet-router-18000; table inet "
        "gpufleet-router-18000 { chain output { type filter hook output priority 0; "
    )
    assert 'oifname "lo" tcp dport 18000 meta skuid != { root, www-data } reject with tcp reset' in script
    assert s.fence_argv() != spec().fence_argv()  # the port's own table, its own port


def test_every_argument_is_one_the_router_knows():
    help_text = (FIXTURES / "vllm-router-0.1.17-help.txt").read_text()
    for arg in spec().argv()[1:]:
        if arg.startswith("--"):
            assert f"[{arg} " in help_text or f"[{arg}]" in help_text, arg


def test_the_api_key_never_reaches_the_router():
    s = build_router_spec("router1", {"vllm_api_key": "sk-secret-123"}, WORKERS)
    assert "sk-secret-123" not in " ".join(s.argv()) + render_unit(s)


def test_pip_trusts_a_plain_http_mirror_by_name_only():
    assert "--trusted-host" not in spec().pip_install_argv("/v", "/v/r.txt")
    argv = spec(router_index_url="http://10.213.0.1:8080/pypi/simple").pip_install_argv("/v", "/v/r.txt")
    assert argv[argv.index("--trusted-host") + 1] == "10.213.0.1"
    assert argv[-2:] == ["-r", "/v/r.txt"]


def test_the_unit_runs_exactly_the_argv():
    s = spec()
    unit = render_unit(s)
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M)[1]
    assert shlex.split(exec_start) == s.argv()
    assert unit.startswith("# Managed by gpufleet (router1)") and s.spec_hash in unit


def test_spec_hash_follows_what_runs():
    assert spec().spec_hash == spec().spec_hash
    assert spec().spec_hash != spec(router_policy="round_robin").spec_hash
    assert spec().spec_hash == build_router_spec("router1", {}, WORKERS[:1]).spec_hash  # membership is not run


def test_the_router_is_controlled_on_its_loopback_port_and_clients_use_the_front_door():
    assert spec().control_url == "http://127.0.0.1:28000"
    assert spec(router_address="10.0.0.5").control_url == "http://127.0.0.1:28000"
    assert spec(router_internal_port=18000).control_url == "http://127.0.0.1:18000"
    # The front door (status' and verify's look at it) is reached on the loopback when it listens everywhere.
    assert reach_address(spec().address) == "127.0.0.1"
    assert reach_address(spec(router_address="10.0.0.5").address) == "10.0.0.5"


@pytest.mark.parametrize(("data", "problem"), [
    ({"router_internal_port": 8000}, "router_internal_port: is the same as router_port or router_metrics_port"),
    ({"router_internal_port": 29000}, "router_internal_port: is the same as router_port or router_metrics_port"),
    ({"router_internal_port": 70000}, "router_internal_port: 70000 is not a TCP port"),
])  # fmt: skip
def test_the_internal_port_is_a_port_of_its_own(data, problem):
    with pytest.raises(SettingErrors, match=re.escape(problem)):
        spec(**data)


def test_the_front_door_passes_on_the_client_api_only():
    site = render_proxy(spec(router_policy="cache_aware"))
    assert re.search(r"^\s*listen 8000;$", site, re.M)
    locations = dict(re.findall(r"location ([^{]+?) \{\s*(.*?)\s*\}", site, re.S))
    assert locations == {
        "/v1/": "proxy_pass http://127.0.0.1:28000/v1/;",
        "= /health": "proxy_pass http://127.0.0.1:28000/health;",
        "/": "return 404;",
    }
    assert "listen 10.0.0.5:8000;" in render_proxy(spec(router_address="10.0.0.5"))
    assert "listen [fd00::5]:8000;" in render_proxy(spec(router_address="fd00::5"))


@pytest.mark.parametrize("policy", ["sticky_least_loaded", "cache_aware"])
def test_the_front_door_site_is_one_nginx_accepts(tmp_path, policy):
    if frontdoor.missing():
        pytest.skip(f"{frontdoor.missing()} (the integration tier runs it on the router hosts)")
    (tmp_path / "vllm-router-session-key.js").write_text(render_session_script())
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        frontdoor.nginx_conf(render_proxy(spec(router_port=18080, router_policy=policy), str(tmp_path)), tmp_path)
    )
    proc = subprocess.run(["nginx", "-t", "-q", "-c", str(conf), "-p", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_router_runs_unprivileged_and_sandboxed():
    unit = render_unit(spec())
    settings = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    for key, value in {
        "DynamicUser": "yes",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert settings.get(key) == value, key
    assert "User" not in settings  # no fixed account: systemd makes one for each start


# --- the host fact ---------------------------------------------------------------------------------------------------
def test_fact_parses_a_converged_router_host():
    out = [
        "dist=vllm_router-0.1.17.dist-info",
        "python3_venv=install_ok_installed",
        "unit_sha256=abc",
        "ActiveState=active",
        "NeedDaemonReload=no",
        "UnitFileState=enabled",
        'workers={"urls":["http://10.0.0.11:5000","http://10.0.0.12:5000"]}',
        "reach http://10.0.0.11:5000 200",
        "reach http://10.0.0.12:5000 000",
    ]
    seen = facts.parse(out)
    assert seen.installed_version == "0.1.17" and seen.python3_venv and seen.running
    assert seen.enabled and not seen.need_daemon_reload
    assert seen.live_workers == WORKERS
    assert seen.reach == {WORKERS[0]: "200", WORKERS[1]: "000"}


def test_fact_reads_the_front_doors_session_key_parts():
    seen = facts.parse(["njs=install_ok_installed", "session_script_sha256=abc"])
    assert seen.njs and seen.session_script_sha256 == "abc"
    bare = facts.parse(["njs=", "session_script_sha256="])
    assert not bare.njs and bare.session_script_sha256 is None


def test_fact_parses_a_bare_host():
    seen = facts.parse(
        ["python3_venv=", "unit_sha256=", "ActiveState=inactive", "NeedDaemonReload=no", "UnitFileState=", "workers="]
    )
    assert seen.installed_version is None and seen.venv_key is None and not seen.python3_venv
    assert seen.live_workers is None and not seen.running


def test_fact_command_is_one_valid_shell_line_quoting_what_it_reads():
    cmd = facts.command(spec(), ("http://x:5000/$(reboot)",))
    assert "'http://x:5000/$(reboot)/health'" in cmd
    assert subprocess.run(["sh", "-n", "-c", cmd]).returncode == 0


# --- the router's answers, recorded ------------------------------------------------------------------------------------
def test_metrics_parse_the_real_router_exposition():
    samples = router_samples((FIXTURES / "metrics.txt").read_text())
    decisions = [(labels, v) for name, labels, v in samples if name == "vllm_router_policy_decisions_total"]
    assert decisions == [({"policy": "cache_aware", "worker": "http://127.0.0.1:18102"}, 3.0)]


def test_router_metrics_leave_out_what_is_not_a_count_and_refuse_what_is_not_prometheus():
    text = (
        'vllm_router_running_requests{worker="http://a:1"} NaN\nvllm_router_running_requests{worker="http://b:1"} 2\n'
    )
    assert router_samples(text) == [("vllm_router_running_requests", {"worker": "http://b:1"}, 2.0)]
    with pytest.raises(RouterError, match="router1: GET /metrics: is not Prometheus text"):
        router_samples("<html>oops</html>", "router1")


class RecordedRouter(Router):
    """The Router interface answering from the recorded files (the parsing under test is status.read's)."""

    def get_json(self, path: str, timeout: float = 10.0):
        return json.loads(
            (FIXTURES / {"/workers": "workers.json", "/list_workers": "list_workers.json"}[path]).read_text()
        )

    def metrics(self):
        return router_samples((FIXTURES / "metrics.txt").read_text())


def test_status_reads_workers_health_and_routing():
    row = status.read(RecordedRouter("router1", None, 8000, 29000), "round_robin")  # type: ignore[arg-type]
    assert row.state == "ready" and row.policy == "cache_aware"  # the running router's, over the inventory's
    by_url = {w.url: w for w in row.workers}
    assert set(by_url) == {"http://127.0.0.1:18101", "http://127.0.0.1:18102"}
    assert by_url["http://127.0.0.1:18102"].routed == 3 and by_url["http://127.0.0.1:18101"].routed == 0
    assert all(w.healthy for w in row.workers) and row.requests == 3
    assert row.prefix_outcomes == {"missing_tokens": 3}


class DownRouter(Router):
    def get_json(self, path: str, timeout: float = 10.0):
        raise ConnectionRefusedError("connection refused")


def test_status_of_a_router_that_does_not_answer_is_a_row_not_a_crash():
    row = status.read(DownRouter("router1", None, 8000, 29000))  # type: ignore[arg-type]
    assert row.state == "down" and "refused" in row.detail


# --- the worker API, asked by root on the router host --------------------------------------------------------------------
class WorkerApi(http.server.BaseHTTPRequestHandler):
    """vllm-router's worker API as 0.1.17 answers it, recording who asked (the user agent)."""

    agents: ClassVar[list[str]] = []

    def _answer(self, status: int, body: bytes) -> None:
        WorkerApi.agents.append(self.headers.get("User-Agent", ""))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/list_workers":
            self._answer(200, b'{"urls": ["http://10.0.0.11:5000"]}')
        else:
            self._answer(200, b"x" * (3 << 20))  # over the transport's cap

    def do_POST(self):
        if self.path.startswith("/add_worker"):
            self._answer(400, b"Timeout 120s waiting for worker http://10.0.0.99:5000")
        else:
            self._answer(200, b"Successfully removed worker")

    def log_message(self, *args):
        pass


@pytest.fixture
def worker_api():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), WorkerApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_worker_api_is_asked_by_a_root_command_on_the_host_not_through_a_tunnel(sshd, worker_api):
    # The router's port is fenced to root and nginx: a tunnel (sshd connects as the login user) is refused there.
    router = Router("router1", SshTransport(sshd.client(), name="router1"), worker_api, 29000)
    try:
        WorkerApi.agents.clear()
        assert router.list_workers() == ["http://10.0.0.11:5000"]
        router.remove_worker("http://10.0.0.12:5000")
        assert WorkerApi.agents and all(a.startswith("curl/") for a in WorkerApi.agents), WorkerApi.agents
        with pytest.raises(RouterError) as refused:
            router.add_worker("http://10.0.0.99:5000", timeout=5)
        assert str(refused.value) == (
            "router1: POST /add_worker?url=http%3A%2F%2F10.0.0.99%3A5000: HTTP 400: Timeout "
            "120s waiting for worker http://10.0.0.99:5000"
        )
        with pytest.raises(RouterError, match=r"^router1: GET /big: not JSON: xxx"):
            router.get_json("/big")  # cut at the cap, so not JSON: bounded, and one line
        with pytest.raises(RouterError) as down:
            Router("router1", router.transport, free_port(), 29000).list_workers()
        assert str(down.value).startswith("router1: GET /list_workers: curl: (7) ") and "\n" not in str(down.value)
    finally:
        router.transport.client.close()  # type: ignore[attr-defined]


def test_a_login_that_cannot_become_root_cannot_ask_the_worker_api(sshd_nobody, worker_api):
    router = Router("router1", SshTransport(sshd_nobody.client(), name="router1"), worker_api, 29000)
    try:
        with pytest.raises(RouterError, match=r"^router1: GET /list_workers: \S"):
            router.list_workers()
    finally:
        router.transport.client.close()  # type: ignore[attr-defined]


# --- the sandbox's package index ------------------------------------------------------------------------------------
def test_simple_index_links_every_wheel_with_its_hash(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    (files / "vllm_router-0.1.17-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"wheel")
    (files / "pydantic_core-2.50.5-cp311-cp311-manylinux2014_x86_64.whl").write_bytes(b"core")
    write_simple_index(files, tmp_path / "simple")
    page = (tmp_path / "simple" / "vllm-router" / "index.html").read_text()
    assert 'href="../../files/vllm_router-0.1.17-cp38-abi3-manylinux_2_28_x86_64.whl#sha256=' in page
    assert (tmp_path / "simple" / "pydantic-core" / "index.html").exists()
    assert project_name("typing_extensions-4.16.0-py3-none-any.whl") == "typing-extensions"


def test_defaults_are_all_router_settings():
    assert all(k.startswith("router_") for k in DEFAULTS)
