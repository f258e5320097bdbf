"""SshTransport through a real sshd: HTTP over a paramiko direct-tcpip channel, docker queries over exec.

The first tests use a throwaway OpenSSH server on 127.0.0.1 (temp keys, stopped by PID); the same checks against a
real vLLM through this tunnel are in tests/vllm/test_dense.py (test_checks_and_probe_through_ssh). The last ones run
`gpufleet status` / `verify --probe` and the state checks against a test host converged by the real deploy.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from gpufleet.health import HealthState, check, wait_until_ready
from gpufleet.health.api import get
from gpufleet.remote.ssh import open_ssh, transport_from_pyinfra_host
from gpufleet.remote.transport import SshTransport, TransportError
from gpufleet.sandbox.image import image_ref
from gpufleet.units import unit_name, unit_path
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.unit import render_unit
from gpufleet.wire.identity import Expected
from tests.ports import free_port


@pytest.fixture
def web(tmp_path) -> Iterator[int]:
    """A real HTTP server on 127.0.0.1 (only the tunnel is under test here, not vLLM)."""
    (tmp_path / "health").write_text("ok")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_http_rides_a_direct_tcpip_channel(sshd, web):
    client = sshd.client()
    try:
        t = SshTransport(client, name="lo")
        assert get(t, web, "/health") == (200, "ok")
        assert get(t, web, "/missing")[0] == 404
    finally:
        client.close()


def test_nothing_listening_is_connection_refused_not_a_tunnel_error(sshd):
    client = sshd.client()
    try:
        with pytest.raises(ConnectionRefusedError):
            SshTransport(client, name="lo").http(free_port(), timeout=5)
    finally:
        client.close()


def test_docker_failure_is_reported_not_read_as_no_container(sshd):
    # Here docker either is absent or has no daemon: the query must fail loudly, never say "no container".
    client = sshd.client()
    try:
        t = SshTransport(client, name="lo", sudo=False)
        rc, _, _ = t.shell("docker ps -q")
        if rc == 0:
            pytest.skip("a docker daemon answers here: covered by the test-hosts tier")
        with pytest.raises(TransportError, match="docker"):
            t.container("vllm")
        r = check(t, Expected("vllm", free_port(), "tiny"))
        assert r.state is HealthState.CONTAINER_NOT_RUNNING
        assert "cannot read container state" in r.detail
    finally:
        client.close()


def test_closed_connection_is_ssh_unreachable(sshd):
    client = sshd.client()
    t = SshTransport(client, name="lo")
    client.close()
    r = check(t, Expected("vllm", 8000, "tiny"))
    assert r.state is HealthState.SSH_UNREACHABLE


def test_pyinfra_host_connection_is_reused(sshd, web, tmp_path):
    from pyinfra.api import Config, Inventory, State

    known_hosts = tmp_path / "known_hosts"
    known_hosts.touch()
    inventory = Inventory(
        (
            [
                (
                    "lo",
                    {
                        "ssh_hostname": "127.0.0.1",
                        "ssh_port": sshd.port,
                        "ssh_user": sshd.user,
                        "ssh_key": str(sshd.client_key),
                        "ssh_known_hosts_file": str(known_hosts),
                        "ssh_strict_host_key_checking": "accept-new",
                    },
                )
            ],
            {},
        )
    )
    state = State(inventory, Config())
    host = inventory.get_host("lo")
    t = transport_from_pyinfra_host(host)
    try:
        assert isinstance(t.client, paramiko.SSHClient)
        assert t.client is host.connector.client  # the deploy's own connection, not a second one
        assert get(t, web, "/health") == (200, "ok")
    finally:
        host.disconnect()
    del state


# --- against a deployed test host: real sshd, sudo, dockerd, the unit's container (stand-in vLLM image) -----------
REPO = Path(__file__).resolve().parents[2]
DEPLOY = str(REPO / "deploys" / "qwen35.py")
# Above the session hosts (1, 2) and the fresh_hosts range (11+): this module's own host.
HOST_NUMBER = 31


def gpufleet(*args: str) -> subprocess.CompletedProcess:
    """The installed `gpufleet` command, as an operator runs it (own process: its own gevent patching)."""
    exe = Path(sys.executable).with_name("gpufleet")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def served(fleet, pyinfra, tmp_path_factory):
    """A fresh 3x H200 test host converged by the real deploy: (host name, pyinfra inventory path, host data)."""
    from gpufleet.sandbox.config import H200x3
    from gpufleet.sandbox.inventory import pyinfra_hosts

    (host,) = fleet.add_hosts([H200x3], first=HOST_NUMBER)
    try:
        data = dict(pyinfra_hosts(fleet.write_inventory()))[host.name]
        inv = tmp_path_factory.mktemp("health-inv") / "inv.py"
        inv.write_text(f"gpuhosts = [({host.name!r}, {data!r})]\n")
        pyinfra(inv, DEPLOY)
        yield host.name, inv, data
    finally:
        fleet.remove_hosts([host.name])


def test_status_reads_container_identity_over_ssh(served):
    name, inv, data = served
    spec = build_spec(name, data)
    result = gpufleet("status", str(inv), "--json")
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["hosts"]
    assert row["ok"] is True and row["problems"] == []
    assert row["state"] == "ready", row["detail"]
    assert row["served_model"] == spec.served_model_name
    assert row["container"]["spec_hash"] == spec.spec_hash  # the label the unit put on the container
    assert row["container"]["image_id"].startswith("sha256:")
    assert row["version"]  # from /version, through the tunnel


def test_verify_probe_passes_over_ssh(served):
    _, inv, _ = served
    result = gpufleet("verify", str(inv), "--probe", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(result.stdout)["hosts"]
    assert row["probe"]["verdict"] == "effective", row["probe"]["evidence"]
    assert row["probe"]["points"] and all(p["cached"] >= p["due"] > 0 for p in row["probe"]["points"])


def test_stopped_then_started_service_states_over_ssh(served, fleet):
    name, _, data = served
    spec = build_spec(name, data)
    expected = Expected.from_spec(spec)
    client = open_ssh(name, data).client
    try:
        t = SshTransport(client, name=name)
        fleet.run_in(name, f"systemctl stop {spec.service}")
        r = check(t, expected)
        # The unit runs `docker run --rm`: stopping it leaves no container behind.
        assert r.state is HealthState.CONTAINER_NOT_RUNNING, r.detail
        fleet.run_in(name, f"systemctl start {spec.service}")
        ready = wait_until_ready(t, expected, timeout_s=120, poll_s=0.5)
        assert ready.state is HealthState.READY, (ready.detail, ready.logs)
        assert ready.container and ready.container.spec_hash == spec.spec_hash
    finally:
        client.close()


# Last in the module: it leaves the host serving an image whose engine dies.
def test_engine_death_is_dead_with_docker_logs_over_ssh(served, fleet):
    name, _, data = served
    dies_ref = image_ref(fleet.cfg, "dies")  # stand-in: serves ~8 s, then /health 503, exit 1
    dying = {**data, "vllm_image": dies_ref}
    spec = build_spec(name, dying)
    # The unit for the dying image goes in by hand: the deploy itself would (rightly) roll it back after its soak.
    fleet.run_in(
        name,
        f"docker pull -q {dies_ref} >/dev/null && cat > {unit_path(spec.service)} <<'UNIT'\n"
        f"{render_unit(spec, dies_ref)}UNIT\nsystemctl daemon-reload && systemctl restart {spec.service}",
    )
    expected = Expected.from_spec(spec)
    client = open_ssh(name, data).client
    try:
        t = SshTransport(client, name=name)
        # The unit restarts it (on-failure, 15 s): serving ~8 s, then 503 for ~1 s, then gone (docker run --rm).
        seen, logs = [], []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            r = check(t, expected)
            seen.append(r.state)
            if r.state is HealthState.DEAD:
                assert "503" in r.detail, r.detail
                # The dying --rm container may be gone by the time `docker logs` runs on a loaded machine; its
                # output is then in the unit's journal, where the deploy reads it too (service_watch.failed_logs).
                logs = (
                    t.logs(spec.service)
                    or t.shell(f"sudo -n journalctl -u {unit_name(spec.service)} -n 30 --no-pager -o cat")[
                        1
                    ].splitlines()
                )
                break
            time.sleep(0.2)
        assert HealthState.DEAD in seen, seen
        assert HealthState.READY in seen  # it really served before its engine died
        assert logs, "the dying container's log (docker logs, else the unit's journal), over SSH"
    finally:
        client.close()
