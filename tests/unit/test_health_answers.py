"""The answer checks (gpufleet.health.answers) against the stand-in `vllm serve` on loopback: a good server passes
both, each way of failing clients fails the check it should, naming what came back; against hand-made answers
that are wrong in one way each; and a request that gets no answer, which is not a failure: its check could not run."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

from gpufleet.health.answers import MAX_TOKENS, check_answers, failed, unanswered
from gpufleet.health.api import BrokenAnswer, HttpStatusError, NotHttp
from gpufleet.remote.transport import AnswerTooLarge, DeadlineExceeded, TransportError, Unreachable
from gpufleet.wire.identity import Expected
from tests.loopback import LoopbackTransport
from tests.unit.test_standin_vllm_serve import model, server  # noqa: F401 - fixtures

KEY = "sk-test-answers"


def expected(port: int) -> Expected:
    return Expected("vllm", port, "m")


def test_a_good_server_passes_both_checks_with_its_key(server):
    s = server("--served-model-name", "m", "--api-key", KEY).wait()
    checks = check_answers(LoopbackTransport(), expected(s.port), api_key=KEY, timeout_s=10)
    assert [(c.name, c.ok) for c in checks] == [("completion", True), ("stream", True)], checks
    assert failed(checks) is None
    assert "tokens (length)" in checks[0].detail and "chunks" in checks[1].detail


def test_without_the_key_both_checks_fail_naming_401(server):
    s = server("--served-model-name", "m", "--api-key", KEY).wait()
    checks = check_answers(LoopbackTransport(), expected(s.port), timeout_s=10)
    assert not any(c.ok for c in checks)
    assert all("401" in c.detail for c in checks), checks


@pytest.mark.parametrize(("mode", "bad", "evidence"), [
    ("completions-fail", {"completion", "stream"}, "answered 500"),
    ("stream-broken", {"stream"}, "not an OpenAI stream chunk"),
])  # fmt: skip
def test_each_way_of_failing_clients_fails_its_check(server, mode, bad, evidence):
    s = server("--served-model-name", "m", env={"STANDIN_MISBEHAVE": mode}).wait()
    checks = check_answers(LoopbackTransport(), expected(s.port), timeout_s=10)
    assert {c.name for c in checks if not c.ok} == bad, checks
    assert all(evidence in c.detail for c in checks if not c.ok), checks
    line = failed(checks)
    assert line is not None and line.isprintable() and all(name in line for name in bad)


def test_a_model_the_server_does_not_serve_fails_naming_it(server):
    s = server("--served-model-name", "m").wait()
    checks = check_answers(LoopbackTransport(), Expected("vllm", s.port, "other"), timeout_s=10)
    assert not any(c.ok for c in checks) and all("404" in c.detail for c in checks), checks


def test_nothing_listening_is_a_check_that_could_not_run_not_an_exception():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        completion, stream = check_answers(LoopbackTransport(), expected(port), timeout_s=2)
    assert not completion.ok and not completion.ran and "could not run: ConnectionRefusedError" in completion.detail
    assert (stream.ok, stream.ran, stream.detail) == (False, False, "not sent: completion got no answer")
    assert failed((completion, stream)).startswith("completion: could not run: ")  # not passed either


@pytest.mark.parametrize(("error", "no_answer"), [
    (DeadlineExceeded("POST /v1/chat/completions: no complete answer within 60 s"), True),
    (TimeoutError("gpu1: the tunnel to port 8000 did not open within 60 s"), True),
    (ConnectionRefusedError("gpu1: 127.0.0.1:8000 refused the connection"), True),
    (ConnectionResetError("reset before any answer"), True),
    (http.client.RemoteDisconnected("Remote end closed connection without response"), True),
    (Unreachable("gpu1: SSH failed: timed out"), True),
    (TransportError("gpu1: sshd refused the tunnel to port 8000: Administratively prohibited"), True),
    (BrokenAnswer("POST /v1/chat/completions: body broken off after 10 bytes"), False),
    (NotHttp("POST /v1/chat/completions: the port does not answer HTTP"), False),
    (AnswerTooLarge("body over 4194304 bytes"), False),
    (HttpStatusError("/v1/chat/completions", 500, "EngineCore encountered an issue."), False),
    (ValueError("/metrics answered 500"), False),
])  # fmt: skip
def test_only_a_request_that_got_no_answer_at_all_is_unanswered(error, no_answer):
    assert unanswered(error) is no_answer


class Silent:
    """Accepts connections and answers the first `silent` of them with nothing (the request's deadline passes),
    the rest with a good completion."""

    def __init__(self, silent: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.silent, self.accepted, self.held = self.listener.getsockname()[1], silent, 0, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        body = json.dumps(_completion()).encode()
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.silent:
                self.held.append(conn)  # never answered, never closed until the test ends
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


def test_a_request_that_gets_no_answer_is_sent_once_more_and_then_could_not_run():
    server = Silent(silent=2)
    try:
        completion, stream = check_answers(LoopbackTransport(), expected(server.port), timeout_s=1)
    finally:
        server.close()
    assert server.accepted == 2  # the completion twice; the stream was not sent
    assert not completion.ran and completion.detail.startswith("could not run: DeadlineExceeded: POST "), completion
    assert not stream.ran and completion.as_dict()["ran"] is False


def test_one_request_that_got_no_answer_is_a_blip_when_the_next_is_answered():
    server = Silent(silent=1)
    try:
        completion = check_answers(LoopbackTransport(), expected(server.port), timeout_s=1)[0]
    finally:
        server.close()
    assert completion.ok and completion.ran and server.accepted >= 2, completion


# --- answers wrong in one way each, from a minimal HTTP server ---------------------------------------------------
def _completion(**changes) -> dict:
    doc = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ready"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
    }
    return doc | changes


class OneAnswer:
    """Answers every request with the same status and body (a non-streaming JSON completion, or SSE text)."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json"):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        head = f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
        self.answer = head.encode() + body
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                while len(body) < length:
                    body += conn.recv(65536)
                conn.sendall(self.answer)

    def completion_check(self):
        (completion, _) = check_answers(LoopbackTransport(), expected(self.port), timeout_s=5)
        return completion

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize(("doc", "evidence"), [
    (b"<html>502 Bad Gateway</html>", "is not JSON: <html>502"),
    (b"[]", "is a JSON list, not a completion object"),
    (json.dumps(_completion(choices=[])).encode(), "has no choice"),
    (json.dumps(_completion(choices=[{"finish_reason": "stop"}])).encode(), "choice 0 has no message"),
    (json.dumps(_completion(choices=[{"message": {"role": "assistant"}, "finish_reason": "stop"}])).encode(),
     "carries no text and no tool call"),
    (json.dumps(_completion(choices=[{"message": {"content": "x"}, "finish_reason": None}])).encode(),
     "finish_reason is null"),
    (json.dumps(_completion(usage=None)).encode(), "no usage counts"),
    (json.dumps(_completion(usage={"prompt_tokens": 12, "completion_tokens": MAX_TOKENS + 50})).encode(),
     f"not 1..{MAX_TOKENS}"),
])  # fmt: skip
def test_a_completion_wrong_in_one_way_fails_naming_it(doc, evidence):
    server = OneAnswer(200, doc)
    try:
        check = server.completion_check()
    finally:
        server.close()
    assert not check.ok and evidence in check.detail, check


def test_a_reasoning_only_answer_and_a_tool_call_are_answers():
    for message in ({"content": None, "reasoning": "thinking"}, {"content": None, "tool_calls": [{"id": "c1"}]}):
        server = OneAnswer(
            200, json.dumps(_completion(choices=[{"message": message, "finish_reason": "stop"}])).encode()
        )
        try:
            check = server.completion_check()
        finally:
            server.close()
        assert check.ok, check


@pytest.mark.parametrize(("sse", "evidence"), [
    (b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": "stop"}]}\n\n'
     b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n', "without data: [DONE]"),
    (b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n',
     "no chunk with a choice"),
    (b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n'
     b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n',
     "finish_reason is null"),
    (b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n',
     "prompt_tokens is null"),
])  # fmt: skip
def test_a_stream_wrong_in_one_way_fails_naming_it(sse, evidence):
    server = OneAnswer(200, sse, "text/event-stream")
    try:
        (_, stream) = check_answers(LoopbackTransport(), expected(server.port), timeout_s=5)
    finally:
        server.close()
    assert not stream.ok and evidence in stream.detail, stream
