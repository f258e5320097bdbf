"""SshTransport through a real sshd: HTTP over a paramiko direct-tcpip channel, docker queries over exec.

Uses a throwaway OpenSSH server on 127.0.0.1 (temp keys, stopped by PID). The same checks against a real vLLM
through this tunnel are in tests/vllm/test_dense.py (test_checks_and_probe_through_ssh).
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import paramiko
import pytest
from tests.vllm_peer.sshd import Sshd

from gpufleet.health import (
    Expected,
    HealthState,
    SshTransport,
    TransportError,
    check,
    transport_from_pyinfra_host,
)
from gpufleet.health.api import get


@pytest.fixture(scope="module")
def sshd(tmp_path_factory) -> Iterator[Sshd]:
    why = Sshd.available()
    if why:
        pytest.skip(f"no throwaway sshd: {why}")
    server = Sshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            SshTransport(client, name="lo").http(_free_port(), timeout=5)
    finally:
        client.close()


def test_docker_failure_is_reported_not_read_as_no_container(sshd):
    # Here docker either is absent or has no daemon: the query must fail loudly, never say "no container".
    client = sshd.client()
    try:
        t = SshTransport(client, name="lo", sudo=False)
        rc, _, _ = t.run("docker ps -q")
        if rc == 0:
            pytest.skip("a docker daemon answers here: covered by the test-hosts tier")
        with pytest.raises(TransportError, match="docker"):
            t.container("vllm")
        r = check(t, Expected("vllm", _free_port(), "tiny"))
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
