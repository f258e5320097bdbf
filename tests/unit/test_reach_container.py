"""The checks reach the server at its container's own address, never at the published port: a local user's listener
that bound the port first (on the address the checks used to reach) gets no request, no key, and no say in
readiness. A real stand-in vLLM stands in for the container (on 127.0.0.1), a real listener for the local user (on
127.0.0.2, the same port)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from gpufleet.health.answers import check_answers
from gpufleet.health.check import HealthState, check, reached
from gpufleet.remote.transport import ContainerInfo, pick_container
from gpufleet.wire.identity import Expected
from tests.loopback import LoopbackTransport
from tests.unit import test_standin_vllm_serve as standin

model, server = standin.model, standin.server  # the stand-in's fixtures
KEY = "sk-reach-7f1e"


class Impostor(BaseHTTPRequestHandler):
    """Answers like a ready vLLM and keeps every Authorization header it is sent."""

    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        Impostor.seen.append(self.headers.get("Authorization") or "")
        body = b'{"object":"list","data":[{"id":"m","object":"model","max_model_len":4096}]}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


class InContainer(LoopbackTransport):
    """The stand-in's process as the container, with the address docker gives it."""

    def container(self, service: str) -> ContainerInfo | None:
        info = super().container(service)
        return None if info is None else ContainerInfo(info.id, info.state, info.started_at, address="127.0.0.1")


def test_checks_and_answers_go_to_the_container_not_to_a_listener_on_the_published_port(server):
    s = server("--served-model-name", "m", "--api-key", KEY).wait()
    impostor = ThreadingHTTPServer(("127.0.0.2", s.port), Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    Impostor.seen = []
    try:
        published = Expected("vllm", s.port, "m", address="127.0.0.2")  # where the port was published
        transport = InContainer(s.proc)
        report = check(transport, published, api_key=KEY)
        assert report.state is HealthState.READY, report.detail
        answers = check_answers(transport, reached(published, report.container), api_key=KEY)
        assert all(a.ok for a in answers), answers
        assert Impostor.seen == []  # nothing, and so no key, went to the listener on the published port
        # Without a container address (host networking) the port is all there is: the impostor is what answers.
        assert reached(published, ContainerInfo("c", "running")) == published
    finally:
        impostor.shutdown()


def test_the_container_address_is_read_from_docker_inspect():
    bridge = {
        "Id": "4f2a" * 16,
        "State": {"Status": "running"},
        "Config": {"Labels": {"gpufleet.vllm": "abc"}},
        "NetworkSettings": {"Networks": {"bridge": {"IPAddress": "172.17.0.3", "Gateway": "172.17.0.1"}}},
    }
    assert pick_container([bridge], "gpufleet.vllm").address == "172.17.0.3"
    host = {**bridge, "NetworkSettings": {"Networks": {"host": {"IPAddress": ""}}}}
    assert pick_container([host], "gpufleet.vllm").address is None
    odd = {**bridge, "NetworkSettings": {"Networks": {"bridge": {"IPAddress": "$(reboot)"}}}}
    assert pick_container([odd], "gpufleet.vllm").address is None  # only an IP address is ever used
