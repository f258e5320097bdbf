"""Container state: docker inspect JSON -> ContainerInfo, and the loopback stand-in for a container (a process)."""

from __future__ import annotations

import http.server
import logging
import socket
import subprocess
import sys
import threading
import time

import paramiko
import pytest

from gpufleet.health import HealthState, check, wait_until_ready
from gpufleet.remote.transport import SshTransport, _parse_docker_time, pick_container
from gpufleet.wire.identity import Expected
from tests.loopback import LoopbackTransport
from tests.ports import free_port

LABEL = "gpufleet.vllm"


def inspected(id_: str, status: str, started: str, exit_code: int = 0, spec_hash: str = "abc") -> dict:
    # The fields `docker inspect` (20.10 and later) writes that the checks read.
    return {
        "Id": id_ * 64,
        "Image": "sha256:" + "e" * 64,
        "State": {"Status": status, "StartedAt": started, "ExitCode": exit_code},
        "Config": {"Image": "10.213.0.1:5000/vllm/vllm-openai:v0.32.0", "Labels": {LABEL: spec_hash}},
    }


def test_running_container_wins_over_newer_exited_ones():
    info = pick_container(
        [
            inspected("a", "exited", "2026-11-29T21:00:00.123456789Z", 137),
            inspected("b", "running", "2026-11-29T20:00:00.5Z", spec_hash="h2"),
        ],
        LABEL,
    )
    assert (info.id, info.running, info.spec_hash) == ("b" * 12, True, "h2")
    assert info.image_short == "e" * 12  # started by tag: the local image id


def test_image_short_prefers_the_digest_the_container_was_started_by():
    obj = inspected("a", "running", "2026-11-29T20:00:00Z")
    obj["Config"]["Image"] = "10.213.0.1:5000/vllm/vllm-openai@sha256:" + "d" * 64
    assert pick_container([obj], LABEL).image_short == "d" * 12


def test_without_a_running_one_the_newest_is_reported():
    info = pick_container(
        [inspected("a", "exited", "2026-11-29T20:00:00Z", 1), inspected("b", "exited", "2026-11-29T21:00:00Z", 137)],
        LABEL,
    )
    assert (info.id, info.exit_code) == ("b" * 12, 137)
    assert pick_container([], LABEL) is None


def test_docker_times_with_nanoseconds_and_offsets():
    assert _parse_docker_time("2026-11-29T21:00:00.123456789Z") == pytest.approx(1795986000.123456)
    assert _parse_docker_time("2026-11-29T22:00:00+01:00") == pytest.approx(1795986000)
    assert _parse_docker_time("0001-01-01T00:00:00Z") is None  # created, never started


def test_exited_process_is_dead_with_its_exit_code(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("line 1\nEngineCore died\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    t = LoopbackTransport(proc, log)
    r = check(t, Expected("vllm", free_port(), "tiny"))
    assert r.state is HealthState.DEAD and "exit code 3" in r.detail
    waited = wait_until_ready(t, Expected("vllm", free_port(), "tiny"), timeout_s=30)
    assert waited.state is HealthState.DEAD
    assert waited.logs == ("line 1", "EngineCore died")


def test_refused_port_is_starting_within_grace_then_dead():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        t = LoopbackTransport(proc)
        exp = Expected("vllm", free_port(), "tiny")
        assert check(t, exp).state is HealthState.STARTING
        late = check(t, exp, grace_s=0.0)
        assert late.state is HealthState.DEAD and "still not answering" in late.detail
        t0 = time.monotonic()
        waited = wait_until_ready(t, exp, timeout_s=1.0, poll_s=0.2)
        assert waited.state is HealthState.STARTING and "gave up after 1 s" in waited.detail
        assert time.monotonic() - t0 < 5
    finally:
        proc.kill()
        proc.wait()


def test_accepting_then_hanging_up_is_not_readiness():
    # docker-proxy accepts on the published port before vLLM listens, then drops the connection.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        import threading

        def hang_up():
            conn, _ = srv.accept()  # check() connects once: /health gets no answer, so nothing else follows
            conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
        r = check(LoopbackTransport(), Expected("vllm", port, "tiny"))
    assert r.state is HealthState.STARTING, r.detail


def test_a_close_delimited_answer_is_read_whole_after_http_client_lets_go_of_the_connection(tmp_path):
    # HTTP/1.0 without keep-alive: http.client closes the connection when the headers are in and the response
    # reads the body on its own; the deadline socket must stay open for it, like a socket's makefile() does.
    import http.server
    import threading

    from gpufleet.health.api import fetch

    body = bytes(range(256)) * 1200  # 300 KiB: many reads, under the cap
    (tmp_path / "blob").write_bytes(body)

    class Http10(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: Http10(*a, directory=str(tmp_path)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        answer = fetch(LoopbackTransport(), httpd.server_address[1], "/blob", timeout=10)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (answer.status, answer.body) == (200, body)


class _RefusingTunnels:
    """An SSH client whose sshd fails every tunnel with code 2 (Connect failed) and the given reason."""

    def __init__(self, reason: str):
        self.reason = reason

    def get_transport(self):
        return self

    def is_active(self) -> bool:
        return True

    def open_channel(self, *args, **kwargs):
        raise paramiko.ChannelException(paramiko.common.OPEN_FAILED_CONNECT_FAILED, self.reason)


@pytest.mark.parametrize(
    ("reason", "error"),
    [("Connection refused", ConnectionRefusedError), ("Connection reset by peer", ConnectionResetError)],
)
def test_sshds_connect_failure_keeps_its_reason(reason, error):
    # Through the tunnel, a listener that accepts and resets at once is reported by sshd as a failed connect: it
    # must read as a reset (as it does without the tunnel), not as a refusal.
    with pytest.raises(error, match=r"^lo: 127\.0\.0\.1:8000 "):
        SshTransport(_RefusingTunnels(reason), name="lo").http(8000, timeout=1)


def test_a_server_published_on_one_address_is_checked_there_through_the_tunnel(sshd, caplog):
    # docker -p 10.0.0.12:5000:5000 leaves nothing on 127.0.0.1:5000: through sshd, the checks dial the address the
    # spec publishes on (127.0.0.2 here: the whole 127/8 is this machine's loopback).
    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.2", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    caplog.set_level(logging.INFO, logger="paramiko")
    client = sshd.client()
    try:
        transport = SshTransport(client, name="lo")
        port = server.server_address[1]
        conn = transport.http(port, 5, address="127.0.0.2")
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        with pytest.raises(ConnectionRefusedError, match=rf"^lo: 127\.0\.0\.1:{port} refused"):
            transport.http(port, 5)
        # The refusal is this error, not also paramiko's "Secsh channel N open FAILED" among a deploy's lines;
        # paramiko's other records still pass.
        paramiko_lines = [r.getMessage() for r in caplog.records if r.name.startswith("paramiko")]
        assert not [line for line in paramiko_lines if "open FAILED" in line], paramiko_lines
        assert any("Authentication" in line for line in paramiko_lines), paramiko_lines
    finally:
        client.close()
        server.shutdown()
        server.server_close()
