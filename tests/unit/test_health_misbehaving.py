"""The health checks against a real misbehaving server: every answer becomes a state, bounded in time and memory.

The server is a real TCP server on 127.0.0.1 (a thread per connection, stopped by the test) that answers with a
real vLLM 0.32's recorded /v1/models and /metrics, except where a case makes it misbehave. Each case runs through
both transports: plain loopback, and a paramiko direct-tcpip channel through a throwaway sshd.
"""

from __future__ import annotations

import datetime
import json
import re
import socket
import ssl
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpufleet.health import HealthState, check
from gpufleet.health.api import fetch
from gpufleet.health.runner import HostTarget, check_fleet, check_host
from gpufleet.remote.transport import MAX_BODY_BYTES, DeadlineExceeded, SshTransport
from gpufleet.wire.identity import Expected
from tests.loopback import LoopbackTransport
from tests.ports import free_port

RECORDED = Path(__file__).resolve().parents[1] / "vllm_peer" / "recorded"
MODELS = (RECORDED / "models-hybrid-align.json").read_bytes()
METRICS = (RECORDED / "metrics-hybrid-align.txt").read_bytes()
DEADLINE_S = 1.0
# Bounded at all is the point (the floods never end); parsing 40,000 models under tracemalloc on a loaded 2-core
# machine took 7 s.
TIME_BOUND_S = 10 * DEADLINE_S
# What a check may allocate at its peak, whatever the server sends (the floods below send without end): a body
# up to the 1 MiB cap and what parsing it makes (40,000 model objects), plus paramiko's 2 MiB channel window.
MEMORY_BOUND = 32 << 20

Handler = Callable[[socket.socket], None]


def expected(port: int) -> Expected:
    return Expected("vllm", port, "tiny", 4096, {"enable_prefix_caching": "True", "mamba_cache_mode": "align"})


# --- what the server sends -------------------------------------------------------------------------------------
def answer(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> Handler:
    def send(conn: socket.socket) -> None:
        head = {"content-length": str(len(body)), **(headers or {})}
        lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in head.items()]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    return send


def raw(data: bytes) -> Handler:
    return lambda conn: conn.sendall(data)


def drip(data: bytes, every_s: float = 0.4) -> Handler:
    def send(conn: socket.socket) -> None:
        for i in range(len(data)):
            conn.sendall(data[i : i + 1])
            time.sleep(every_s)

    return send


def flood(head: bytes, block: bytes) -> Handler:
    """head, then block after block until the client goes away."""

    def send(conn: socket.socket) -> None:
        conn.sendall(head)
        while True:
            conn.sendall(block)

    return send


def silent(conn: socket.socket) -> None:
    while conn.recv(4096):  # until the client gives up
        pass


def then(*handlers: Handler) -> Handler:
    def send(conn: socket.socket) -> None:
        for handler in handlers:
            handler(conn)

    return send


def reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
    conn.close()


def hang_up(conn: socket.socket) -> None:
    """Close at once (the server's finally does it)."""


def models_doc(data) -> bytes:
    return json.dumps({"object": "list", "data": data}).encode()


def chunked(*parts: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"".join(parts)


def tls_server_context(tmp: Path) -> ssl.SSLContext:
    """A real TLS server context with a throwaway self-signed certificate (cryptography comes with paramiko)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256())
    )  # fmt: skip
    (tmp / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp / "cert.pem", tmp / "key.pem")
    return ctx


# --- the server ------------------------------------------------------------------------------------------------
GOOD: dict[str, Handler] = {
    "/health": answer(200),
    "/v1/models": answer(200, MODELS, {"content-type": "application/json"}),
    "/version": answer(200, b'{"version":"0.32.0"}', {"content-type": "application/json"}),
    "/metrics": answer(200, METRICS, {"content-type": "text/plain; version=0.0.4"}),
}


class Server:
    """Answers like vLLM, except: `routes` replace the answer to their paths; `first` (if set) handles every
    connection before the request is even read (a listener that is not an HTTP server)."""

    def __init__(self, routes: dict[str, Handler] | None = None, first: Handler | None = None):
        self.routes, self.first = {**GOOD, **(routes or {})}, first
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()
        self._wait_serving()

    def _wait_serving(self) -> None:
        """Return once the server has accepted a connection: a case's clock starts on a server already serving, not
        on one whose accept thread a loaded machine has yet to schedule."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5):
            if not self.accepted.wait(5):
                raise RuntimeError(f"the test server on port {self.port} accepted nothing within 5 s")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed by stop()
                return
            self.accepted.set()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.first is not None:
                self.first(conn)
            else:
                self._route(conn)

            # A graceful end, so the client reads everything sent before it sees the close (closing with its
            # request unread would send a reset instead, racing the data).
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(5)
            while conn.recv(4096):
                pass
        except OSError:
            pass  # the client gave up (its deadline) or closed early: what a flood or a drip ends with
        finally:
            conn.close()

    def _route(self, conn: socket.socket) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            data = conn.recv(4096)
            if not data:
                return
            request += data
        path = request.split(b" ", 2)[1].decode()
        self.routes.get(path, answer(404, b'{"detail":"Not Found"}'))(conn)

    def stop(self) -> None:
        self.listener.close()
        self.thread.join(5)


@pytest.fixture(params=["loopback", "ssh"])
def through(request) -> Iterator[Callable[[], object]]:
    """through() -> a Transport to the server's host; `ssh` tunnels the same requests through a real sshd."""
    if request.param == "loopback":
        yield LoopbackTransport
        return
    sshd = request.getfixturevalue("sshd")
    client = sshd.client()

    class Tunnelled(SshTransport):
        # HTTP rides the real channel; the "container" is the test's server, running (no docker here).
        def container(self, service):
            return LoopbackTransport().container(service)

    yield lambda: Tunnelled(client, name="lo")
    client.close()


def checked(through, routes: dict[str, Handler] | None = None, first: Handler | None = None):
    """check() against a Server started for it and stopped after it."""
    server = Server(routes, first)
    try:
        return check(through(), expected(server.port), timeout_s=DEADLINE_S)
    finally:
        server.stop()


def measured(fn: Callable[[], object]) -> tuple[object, float, int]:
    """(result, seconds, peak bytes allocated while it ran)."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        result = fn()
        return result, time.monotonic() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


S, D, M = HealthState.STARTING, HealthState.DEAD, HealthState.MISCONFIGURED
HUGE_LISTING = models_doc([{"id": f"model-{i}"} for i in range(40_000)])  # ~0.8 MiB: under the cap
# (case id, routes, first-connection handler, state, detail regex)
CASES = [
    # /v1/models: not JSON, or JSON of another shape
    ("models-html", {"/v1/models": answer(200, b"<html><body>502 Bad Gateway</body></html>")}, None,
     M, r"^/v1/models is not JSON: <html><body>502 Bad Gateway"),
    ("models-empty-body", {"/v1/models": answer(200)}, None, M, r"^/v1/models is not JSON: an empty body$"),
    ("models-a-list", {"/v1/models": answer(200, b'[{"id": "tiny"}]')}, None,
     M, r'^/v1/models is a JSON array, not an object with a "data" list$'),
    ("models-no-data", {"/v1/models": answer(200, b'{"object": "list"}')}, None, M, r'^/v1/models has no "data" list$'),
    ("models-data-not-a-list", {"/v1/models": answer(200, b'{"data": {"id": "tiny"}}')}, None,
     M, r'^/v1/models has "data" as a JSON object, not a list$'),
    ("models-item-not-object", {"/v1/models": answer(200, models_doc(["tiny"]))}, None,
     M, r"^/v1/models item 0 is a JSON string, not a model object$"),
    ("models-item-without-id", {"/v1/models": answer(200, models_doc([{"object": "model"}]))}, None,
     M, r"^/v1/models item 0 has no id$"),
    ("models-id-not-string", {"/v1/models": answer(200, models_doc([{"id": 42}]))}, None,
     M, r"^/v1/models item 0 has an id that is a JSON number$"),
    ("models-max-len-not-int", {"/v1/models": answer(200, models_doc([{"id": "tiny", "max_model_len": "4k"}]))}, None,
     M, r"^/v1/models item 0 \(tiny\) has a max_model_len that is a JSON string$"),
    ("models-nested-past-recursion", {"/v1/models": answer(200, b"[" * 200_000)}, None, M, r"^/v1/models is not JSON: \[\[\["),
    ("models-huge-array", {"/v1/models": answer(200, HUGE_LISTING)}, None,
     M, r"^serves model-0, model-1, model-2 and 39997 more, expected tiny; max_model_len None, expected 4096$"),
    ("models-control-characters", {"/v1/models": answer(200, models_doc([{"id": "evil\r\nExecStartPre=/x\x1b[2J"}]))},
     None, M, r"^serves evil\\r\\nExecStartPre=/x\\x1b\[2J, expected tiny; max_model_len None, expected 4096$"),
    ("models-body-over-cap", {"/v1/models": flood(b"HTTP/1.1 200 OK\r\ncontent-length: 67108864\r\n\r\n", b"[" * 65536)},
     None, M, rf"^GET /v1/models: body over {MAX_BODY_BYTES} bytes$"),
    ("models-chunked-without-end", {"/v1/models": flood(chunked(), b"10000\r\n" + b"x" * 65536 + b"\r\n")}, None,
     M, rf"^GET /v1/models: body over {MAX_BODY_BYTES} bytes$"),
    ("models-bad-chunk-size", {"/v1/models": raw(chunked(b"zz\r\nabc\r\n"))}, None,
     D, r"^GET /v1/models: body broken off after 0 bytes$"),
    ("models-chunks-cut-off", {"/v1/models": raw(chunked(b"5\r\n{\"dat\r\n"))}, None,
     D, r"^GET /v1/models: body broken off after 5 bytes$"),
    ("models-content-length-too-long", {"/v1/models": raw(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"data\": []}")},
     None, D, r"^GET /v1/models: body broken off after 12 bytes, 88 more announced$"),
    ("models-content-length-too-short", {"/v1/models": answer(200, MODELS, {"content-length": str(len(MODELS) - 9)})},
     None, M, r'^/v1/models is not JSON: \{"object":"list"'),
    ("models-content-length-never-sent", {"/v1/models": then(answer(200, b"{}", {"content-length": "100"}), silent)}, None,
     S, r"^container running, port \d+ not answering in time: GET /v1/models: no complete answer within 1 s "
        r"\(\d+ bytes received\): HTTP/1.1 200 X"),
    # status codes of every class
    ("health-101", {"/health": answer(101)}, None, M, r"^/health answered 101$"),
    ("health-204", {"/health": answer(204)}, None, M, r"^/health answered 204$"),
    ("health-302", {"/health": answer(302, b"", {"location": "/login"})}, None, M, r"^/health answered 302$"),
    ("health-404", {"/health": answer(404, b"Not Found")}, None, M, r"^/health answered 404: Not Found$"),
    ("health-503", {"/health": answer(503, b"\x1b[31mengine dead\n")}, None,
     D, r"^/health answered 503: \\x1b\[31mengine dead\\n$"),
    ("health-999", {"/health": answer(999)}, None, M, r"^/health answered 999$"),
    ("models-401", {"/v1/models": answer(401, b'{"error":"Unauthorized"}')}, None,
     M, r"^/v1/models answered 401: the server requires its API key"),
    ("models-404", {"/v1/models": answer(404, b"{}")}, None, M, r"^/health is 200 but /v1/models answered 404: \{\}$"),
    ("models-500", {"/v1/models": answer(500, b"Internal Server Error")}, None,
     D, r"^/health is 200 but /v1/models answered 500: Internal Server Error$"),
    # /metrics and /version
    ("metrics-not-prometheus", {"/metrics": answer(200, b"<html>metrics moved</html>")}, None,
     M, r"^/metrics is not Prometheus text: invalid metric name:<html>metrics moved</html>$"),
    ("metrics-value-not-a-number", {"/metrics": answer(200, METRICS + b"vllm:num_requests_running{engine=\"1\"} lots\n")},
     None, M, r"^/metrics is not Prometheus text: could not convert string to float: 'lots'$"),
    ("metrics-without-cache-config", {"/metrics": answer(200, b"vllm:num_requests_running 0\n")}, None,
     M, r"^enable_prefix_caching=None, expected True; mamba_cache_mode=None, expected align$"),
    ("metrics-503", {"/metrics": answer(503)}, None, D, r"^/metrics answered 503$"),
    ("version-not-json", {"/version": answer(200, b"0.32.0\n")}, None,
     HealthState.READY, r"^/health 200, serving tiny \(vLLM None\)$"),
    # not an HTTP server on the port
    ("not-http-line", None, raw(b"-ERR unknown command 'GET'\r\n"), M,
     r"^GET /health: the port does not answer HTTP: -ERR unknown command 'GET'\\r\\n$"),
    ("not-http-binary", None, raw(b"\x00\x01\x02\xffgarbage\n"), M,
     r"^GET /health: the port does not answer HTTP: \\x00\\x01\\x02\\xffgarbage\\n$"),
    ("not-http-endless-line", None, flood(b"", b"\x07" * 65536), M, r"^GET /health: the port does not answer HTTP: (\\x07)+"),
    ("tls-alert", None, raw(b"\x15\x03\x03\x00\x02\x02\x46"), M,
     r"^GET /health: the port answers in TLS, not plain HTTP \(first bytes \\x15\\x03\\x03"),
    ("http2", None, raw(b"HTTP/2.0 200 OK\r\n\r\n"), M, r"^GET /health: the port answers HTTP/2.0, not HTTP/1.x$"),
    ("hangs-up", None, hang_up, S, r"^container running, port \d+ not answering yet: the connection (closed|was reset) "
                                     r"before any answer$"),
    # Through the tunnel sshd reports the failure of its own connect: on a loaded machine it has seen the listener's
    # reset as a refusal (seen here and on a 2-core AVX2 machine); either is a server not answering yet.
    ("resets", None, reset, S, r"^container running, port \d+ not answering yet: (the connection (closed|was reset) "
                                 r"before any answer|connection refused)$"),
    ("silent", None, silent, S, r"^container running, port \d+ not answering in time: GET /health: no complete answer "
                                  r"within 1 s \(nothing received\)$"),
    ("drips", None, drip(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"), S,
     r"^container running, port \d+ not answering in time: GET /health: no complete answer within 1 s "
     r"\([1-4] bytes received\): H"),
    # broken headers
    ("header-over-64k", {"/health": raw(b"HTTP/1.1 200 OK\r\nx: " + b"a" * 70_000 + b"\r\n\r\n")}, None,
     D, r"^GET /health: a header line over 64 KiB$"),
    ("headers-over-100", {"/health": raw(b"HTTP/1.1 200 OK\r\n" + b"x: 1\r\n" * 101 + b"\r\n")}, None,
     D, r"^GET /health: malformed answer: got more than 100 headers$"),
    ("headers-without-end", {"/health": flood(b"HTTP/1.1 200 OK\r\n", b"x: " + b"a" * 60_000 + b"\r\n")}, None,
     M, r"^GET /health: answer over \d+ bytes$"),
]  # fmt: skip


@pytest.mark.parametrize(("routes", "first", "state", "detail"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_misbehaviour_is_a_state_bounded_in_time_and_memory(through, routes, first, state, detail):
    report, seconds, peak = measured(lambda: checked(through, routes, first))
    assert report.state is state, report.detail
    assert re.search(detail, report.detail), report.detail
    assert report.detail.isprintable() and len(report.detail) <= 400  # one line, no terminal escapes
    assert seconds < TIME_BOUND_S, seconds
    assert peak < MEMORY_BOUND, peak


def test_the_good_server_is_ready(through):
    # The baseline every case above departs from: a real vLLM's answers.
    report = checked(through)
    assert report.state is HealthState.READY, report.detail
    assert (report.served_model, report.max_model_len, report.vllm_version) == ("tiny", 4096, "0.32.0")


def test_nan_and_infinite_metrics_are_unknown_not_a_crash(through):
    usage = b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} '
    assert usage + b"0.0\n" in METRICS
    odd = (
        METRICS.replace(usage + b"0.0\n", usage + b"NaN\n")
        + b'vllm:num_requests_running{engine="1",model_name="tiny"} +Inf\n'
    )
    report = checked(through, {"/metrics": answer(200, odd)})
    assert report.state is HealthState.READY, report.detail
    assert (report.kv_cache_usage, report.running) == (None, None)


def test_a_real_tls_listener_is_not_readiness(through, tmp_path):
    # vLLM started with --ssl-keyfile: the TLS stack drops a plain-text request without an HTTP answer.
    ctx = tls_server_context(tmp_path)

    def tls(conn: socket.socket) -> None:
        ctx.wrap_socket(conn, server_side=True)  # fails on the plain-text request (the server ignores why)

    report = checked(through, first=tls)
    assert report.state is HealthState.STARTING, report.detail
    assert re.search(r"not answering yet: the connection (closed|was reset) before any answer$", report.detail)


def test_a_dripping_server_cannot_hold_a_request_past_its_deadline(through):
    # One byte every 0.4 s: a per-read timeout of 1 s would never fire (the issue measured 31 s).
    server = Server(first=drip(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 100))
    try:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=r"no complete answer within 1 s \(\d bytes received\)"):
            fetch(through(), server.port, "/health", timeout=DEADLINE_S)
        assert time.monotonic() - start < TIME_BOUND_S
    finally:
        server.stop()


def test_one_bad_host_is_one_row_and_never_sinks_the_fleet(sshd):
    good = Server()
    # Its own known_hosts file: pyinfra's default accept-new would otherwise record this throwaway key in root's.
    ssh = {
        "ssh_hostname": "127.0.0.1",
        "ssh_port": sshd.port,
        "ssh_user": sshd.user,
        "ssh_key": str(sshd.client_key),
        "ssh_known_hosts_file": str(sshd.dir / "known_hosts"),
    }
    targets = [
        HostTarget("reachable", ssh, expected(good.port)),
        HostTarget("bad-key", {**ssh, "ssh_key": str(sshd.dir / "missing-key")}, expected(good.port)),
        HostTarget("bad-port", {**ssh, "ssh_port": "twenty-two"}, expected(good.port)),  # int() raises ValueError
        HostTarget("refusing", {**ssh, "ssh_port": free_port()}, expected(good.port)),
    ]
    try:
        results = check_fleet(targets)
    finally:
        good.stop()
    assert [r.target.name for r in results] == ["reachable", "bad-key", "bad-port", "refusing"]
    rows = {r.target.name: r.health for r in results}
    # Through SSH, with no container of ours here (or no docker at all): a row that says so.
    assert rows["reachable"].state is HealthState.CONTAINER_NOT_RUNNING, rows["reachable"].detail
    assert rows["bad-key"].state is HealthState.SSH_UNREACHABLE and "missing-key" in rows["bad-key"].detail
    assert rows["bad-port"].state is HealthState.SSH_UNREACHABLE and "twenty-two" in rows["bad-port"].detail
    assert rows["refusing"].state is HealthState.SSH_UNREACHABLE


def test_a_host_whose_server_misbehaves_is_its_own_row(through):
    bad = Server(first=raw(b"\x00garbage\n"))
    try:
        result = check_host(HostTarget("garbage", {}, expected(bad.port)), transport=through())
    finally:
        bad.stop()
    assert result.health.state is HealthState.MISCONFIGURED and "\\x00garbage" in result.health.detail
    assert not result.ok
