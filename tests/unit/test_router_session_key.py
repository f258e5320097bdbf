"""The front door's session key: the deploy's nginx config and njs script, run by this machine's nginx in front of an
upstream that echoes the X-Session-ID it got (what vllm-router would place by), and the deploy's decisions for it."""

from __future__ import annotations

import http.server
import json
import re
import socket
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.command import FileUploadCommand
from pyinfra.context import ctx_host, ctx_state

from gpufleet.operations.files import sha256
from gpufleet.router import operations
from gpufleet.router.facts import RouterHost
from gpufleet.router.settings import build_router_spec
from gpufleet.router.unit import NJS_PACKAGE, render_proxy, render_session_script, script_path
from tests import frontdoor
from tests.ports import free_port

KEY = re.compile(r"gf-[0-9a-f]{4}")  # 65,536 keys: the router's table holds at most that many derived sessions


class Echo(http.server.BaseHTTPRequestHandler):
    """Answers every request with the X-Session-ID and the body length it received."""

    protocol_version = "HTTP/1.1"

    def answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        out = json.dumps({"session": self.headers.get("X-Session-ID"), "length": len(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[frontdoor.FrontDoor]:
    if frontdoor.missing():
        pytest.skip(f"{frontdoor.missing()} (the integration tier runs the front door on the router hosts)")
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Echo)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    started = frontdoor.FrontDoor("sticky_least_loaded", upstream.server_address[1], tmp_path_factory.mktemp("door"))
    yield started
    started.stop()
    upstream.shutdown()


def send(door: frontdoor.FrontDoor, body: bytes | dict | None, headers: dict[str, str] | None = None) -> dict:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(f"{door.base}/v1/chat/completions", data, headers or {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def chat(*messages: tuple[str, str], **extra: Any) -> dict:
    return {"model": "m", "messages": [{"role": role, "content": text} for role, text in messages], **extra}


SYSTEM = ("system", "You are a coding agent. " + "Follow the repository's conventions. " * 200)


def test_every_turn_of_a_conversation_gets_the_key_of_its_opening(door):
    first = send(door, chat(SYSTEM, ("user", "fix the parser")))["session"]
    later = send(
        door,
        chat(
            SYSTEM,
            ("user", "fix the parser"),
            ("assistant", "done"),
            ("user", "now the tests"),
            max_tokens=64,
            stream=False,
        ),
    )["session"]
    assert first == frontdoor.expected_key(chat(SYSTEM, ("user", "fix the parser"))) and later == first
    # The same opening in parts (the content as a list) is another client's serialisation: a key of its own, and
    # every turn of it keeps that key too.
    parts = chat(SYSTEM, ("user", [{"type": "text", "text": "fix the parser"}]))
    assert (
        send(door, parts)["session"]
        == send(door, {**parts, "messages": [*parts["messages"], {"role": "assistant", "content": "ok"}]})["session"]
    )


def test_agents_sharing_one_long_system_prompt_get_keys_of_their_own(door):
    # Their first user messages differ. (Two conversations share a key with a chance of 1 in 65,536 per pair; these
    # contents are fixed, so this is no matter of chance.)
    keys = {send(door, chat(SYSTEM, ("user", f"task {k}: make the tests pass")))["session"] for k in range(20)}
    assert len(keys) == 20 and all(KEY.fullmatch(k) for k in keys)


def test_the_clients_own_session_id_always_wins(door):
    assert send(door, chat(SYSTEM, ("user", "hi")), {"X-Session-ID": "agent-7"})["session"] == "agent-7"
    # An empty header names no session: the key is derived.
    assert KEY.fullmatch(send(door, chat(SYSTEM, ("user", "hi")), {"X-Session-ID": ""})["session"])


def test_a_compacted_conversation_and_a_one_shot_request_are_sessions_of_their_own(door):
    turn = send(door, chat(SYSTEM, ("user", "task"), ("assistant", "a"), ("user", "more")))["session"]
    # The agent compacts its history into a summary: a new opening, so a new key (one cold turn).
    compacted = send(door, chat(SYSTEM, ("user", "summary of the task so far"), ("assistant", "ok"), ("user", "more")))[
        "session"
    ]
    assert KEY.fullmatch(compacted) and compacted != turn
    # A one-shot request (no history) is placed like the first turn of a conversation.
    assert KEY.fullmatch(send(door, chat(("user", "translate: bonjour")))["session"])


def test_responses_and_messages_bodies_are_keyed_by_their_opening_too(door):
    responses = {"model": "m", "instructions": "be brief", "input": [{"role": "user", "content": "a"}]}
    grown = {
        **responses,
        "input": [*responses["input"], {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    }
    assert (
        KEY.fullmatch(send(door, responses)["session"])
        and send(door, grown)["session"] == send(door, responses)["session"]
    )
    messages = {"model": "m", "system": "be brief", "max_tokens": 8, "messages": [{"role": "user", "content": "a"}]}
    assert send(door, messages)["session"] != send(door, {**messages, "system": "be verbose"})["session"]


def test_a_body_that_cannot_be_keyed_is_still_passed_on_and_answered(door):
    # Not JSON, JSON with no messages, a body over the in-memory buffer (nginx keeps it in a file): each is passed on
    # whole and placed by a key of its own request's id.
    for body in (
        b"not json {",
        b'{"model": "m", "prompt": "completions have no messages"}',
        json.dumps(chat(("user", "x" * (12 << 20)))).encode(),
    ):
        got = [send(door, body, {"Content-Type": "application/json"}) for _ in range(2)]
        assert all(g["length"] == len(body) and KEY.fullmatch(g["session"]) for g in got), got
    assert "js exception" not in door.errors()
    # A request without a body names no session.
    with urllib.request.urlopen(f"{door.base}/v1/models", timeout=10) as resp:
        assert json.loads(resp.read())["session"] is None


def test_a_chunked_body_is_keyed_as_the_same_body_with_a_length(door):
    body = json.dumps(chat(SYSTEM, ("user", "chunked"))).encode()
    with socket.create_connection(("127.0.0.1", door.port), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
        )
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["session"] == send(door, body)["session"]


def test_a_body_cut_short_gets_an_answer_and_the_front_door_goes_on(door):
    # The client promises more than it sends and closes: nginx never reaches the upstream with half a body.
    with socket.create_connection(("127.0.0.1", door.port), timeout=10) as conn:
        conn.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model": ')
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(65536) == b""  # closed, no upstream answer
    assert KEY.fullmatch(send(door, chat(("user", "still there?")))["session"])


# --- the deploy's decisions ------------------------------------------------------------------------------------------
def run_alone(operation: Any, **arguments: Any) -> list[Any]:
    inventory = Inventory(([("router1", {})], {}))
    with ctx_state.use(State(inventory, Config())), ctx_host.use(inventory.get_host("router1")):
        return list(operation._inner(**arguments))


def converged(policy: str) -> tuple[Any, RouterHost]:
    spec = build_router_spec("router1", {"router_policy": policy}, ())
    return spec, RouterHost(
        nginx=True,
        nginx_active=True,
        proxy_sha256=sha256(render_proxy(spec)),
        njs=True,
        session_script_sha256=sha256(render_session_script()),
    )


def test_the_front_door_writes_its_session_key_script_only_for_a_policy_that_places_by_session(monkeypatch):
    installed: list[list[str]] = []
    monkeypatch.setattr(operations.apt.packages, "_inner", lambda packages, **_: installed.append(packages) or iter(()))
    spec, seen = converged("sticky_least_loaded")
    assert run_alone(operations.front_door, spec=spec, seen=seen) == []
    # The script missing (or another version of it): written, then nginx checked and reloaded.
    commands = run_alone(operations.front_door, spec=spec, seen=replace(seen, session_script_sha256=None))
    uploads = [c for c in commands if isinstance(c, FileUploadCommand)]
    assert [u.dest for u in uploads] == [script_path("vllm-router")] and installed == []
    assert [str(c) for c in commands[-3:]] == [
        "nginx -t -q",
        "systemctl enable nginx",
        "systemctl reload-or-restart nginx",
    ]
    # nginx there without njs (a router that ran another policy): njs installed.
    run_alone(operations.front_door, spec=spec, seen=replace(seen, njs=False))
    assert installed == [["nginx", NJS_PACKAGE]]
    # cache_aware keys nothing: neither njs nor the script is asked for.
    spec, seen = converged("cache_aware")
    assert run_alone(operations.front_door, spec=spec, seen=replace(seen, njs=False, session_script_sha256=None)) == []
