"""The stand-in vLLM's HTTP server: uvicorn's keep-alive and access log, vLLM's endpoints, answers and errors.

STANDIN_MISBEHAVE makes it misbehave in one way (docs/test-hosts.md).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:
    from .vllm_argv import VERSION
    from .vllm_chat import as_token_ids, chat_prompt, greedy_tokens, stale_tokens, tokenize, tool_arguments
    from .vllm_engine import Engine
else:  # the image runs it as a script beside its modules
    from vllm_argv import VERSION
    from vllm_chat import as_token_ids, chat_prompt, greedy_tokens, stale_tokens, tokenize, tool_arguments
    from vllm_engine import Engine

MISBEHAVE = os.environ.get("STANDIN_MISBEHAVE", "")
KEEP_ALIVE_S = float(os.environ.get("STANDIN_KEEP_ALIVE_S", "5"))  # uvicorn's default --timeout-keep-alive
# STANDIN_MISBEHAVE=slow: a build that answers right, slower (the speed check's regression)
SLOW_PREFILL_FACTOR = 20
SLOW_REQUEST_DELAY_S = 0.4


class Handler(BaseHTTPRequestHandler):
    engine: Engine
    server_version = "uvicorn"
    sys_version = ""
    # Every answer is framed so the connection can carry the next request; an idle socket is dropped.
    protocol_version = "HTTP/1.1"
    timeout = KEEP_ALIVE_S
    # Head and body leave in one write, and TCP_NODELAY as uvicorn's, so no body waits for a delayed ACK (Nagle).
    wbufsize = -1
    disable_nagle_algorithm = True

    def handle(self) -> None:
        if MISBEHAVE != "not-http":
            super().handle()
            return
        # Another protocol on vLLM's port. The request is read first, so the close is clean, not a reset.
        try:
            while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                pass
        except TimeoutError:
            return
        self.wfile.write(b"-ERR unknown command 'GET', with args beginning with: '/health'\r\n")
        print("INFO:     answered a request with a line of another protocol (STANDIN_MISBEHAVE=not-http)", flush=True)

    def log_message(self, fmt: str, *args: Any) -> None:  # one access-log line per request, like uvicorn's
        line = getattr(self, "requestline", "")
        print(f'INFO:     {self.client_address[0]} - "{line}" {args[1] if len(args) > 1 else ""}', flush=True)

    def log_error(self, fmt: str, *args: Any) -> None:
        if args and isinstance(args[0], TimeoutError):
            return  # an idle keep-alive connection timed out: uvicorn closes those silently
        super().log_error(fmt, *args)

    def _body(self) -> bytes | None:
        """The request's body, read in full so that the next request on the connection starts where it should.

        None when it cannot be framed: a 400 is sent and the connection closes. A chunked body is not read (the
        stand-in never needed one): the request is answered as if it had none, then the connection closes.
        """
        if self.headers.get("transfer-encoding"):
            self.close_connection = True
            return b""
        try:
            length = int(self.headers.get("content-length") or 0)
            if length < 0:
                raise ValueError(length)
        except ValueError:
            self.send_error(400, "Invalid HTTP request received.")
            return None
        return self.rfile.read(length) if length else b""

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        keys = self.engine.api_keys
        if not keys or not self.path.startswith("/v1"):
            return True
        if self.headers.get("Authorization", "") in {f"Bearer {k}" for k in keys}:
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:
        e = self.engine
        if self._body() is None:
            return
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/ping"):
            self.send_response(503 if e.dead else 200)
            self.send_header("content-length", "0")
            self.end_headers()
        elif path == "/version":
            self._json(200, {"version": VERSION})
        elif path == "/metrics":
            data = e.metrics().encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path == "/v1/models" and MISBEHAVE == "models-not-json":
            if self._authorised():
                page = b"<html><head><title>502 Bad Gateway</title></head><body>502 Bad Gateway</body></html>\n"
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.send_header("content-length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)
        elif path == "/v1/models":
            if self._authorised():
                now = int(time.time())
                self._json(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": name,
                                "object": "model",
                                "created": now,
                                "owned_by": "vllm",
                                "root": e.model,
                                "parent": None,
                                "max_model_len": e.max_model_len,
                                "permission": [
                                    {
                                        "id": f"modelperm-{uuid.uuid4().hex}",
                                        "object": "model_permission",
                                        "created": now,
                                        "allow_sampling": True,
                                        "allow_view": True,
                                        "is_blocking": False,
                                        "organization": "*",
                                        "group": None,
                                    }
                                ],
                            }
                            for name in e.names
                        ],
                    },
                )
        else:
            self._json(404, {"detail": "Not Found"})

    def _lost_rank(self, ranks: list[int]) -> None:
        """A rank left the group: the pipeline's first send fails, the engine dies and the server exits (vLLM)."""
        self.engine.dead = True
        print(
            f"ERROR pipeline stage of rank(s) {ranks} is gone: Connection closed by peer\n"
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
            "for the root cause.",
            flush=True,
        )
        server = self.server

        def stop() -> None:
            time.sleep(float(os.environ.get("STANDIN_DEAD_SECONDS", "1")))
            server.shutdown()

        threading.Thread(target=stop, daemon=True).start()

    def do_POST(self) -> None:
        e = self.engine
        # Read before any answer, even a 404 or a 401: an unread body would be parsed as the next request.
        body = self._body()
        if body is None:
            return
        if self.path.split("?", 1)[0] != "/v1/chat/completions":
            self._json(404, {"detail": "Not Found"})
            return
        if not self._authorised():
            return
        try:
            req = json.loads(body or b"{}")
        except json.JSONDecodeError as err:
            self._json(
                400,
                {
                    "error": {
                        "message": f"JSON decode error: {err}",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
            )
            return
        if req.get("model") not in e.names:
            self._json(
                404,
                {
                    "error": {
                        "message": f"The model `{req.get('model')}` does not exist.",
                        "type": "NotFoundError",
                        "param": "model",
                        "code": 404,
                    }
                },
            )
            return
        problem = self._tool_problem(req)
        if problem:
            self._json(400, {"error": {"message": problem, "type": "BadRequestError", "param": None, "code": 400}})
            return
        if e.group is not None and not e.dead and e.group.lost():
            self._lost_rank(e.group.lost())
        # A dead engine, or one that crashes in every batch (STANDIN_MISBEHAVE=completions-fail): vLLM's 500.
        if e.dead or MISBEHAVE == "completions-fail":
            self._json(
                500,
                {
                    "error": {
                        "message": "EngineCore encountered an issue.",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
            )
            return
        kwargs = {**e.template_kwargs, **(req.get("chat_template_kwargs") or {})}
        thinking = kwargs.get("enable_thinking", True) is not False
        text = chat_prompt(req.get("messages") or [], req.get("tools"), thinking)
        tokens = tokenize(text)
        max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        if len(tokens) + max_tokens > e.max_model_len:
            self._json(
                400,
                {
                    "error": {
                        "message": f"This model's maximum context length is {e.max_model_len} tokens. "
                        f"However, you requested {len(tokens) + max_tokens} tokens.",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
            )
            return
        with e.lock:
            e.running += 1
            # STANDIN_MISBEHAVE=stalls-under-load: the second request in flight is never scheduled.
            stalled = MISBEHAVE == "stalls-under-load" and e.running >= 2
        try:
            if stalled:
                print("INFO:     a request is never scheduled (STANDIN_MISBEHAVE=stalls-under-load)", flush=True)
                threading.Event().wait()
            self._complete(req, text, tokens, max_tokens, thinking)
        finally:
            with e.lock:
                e.running -= 1

    def _tool_problem(self, req: dict[str, Any]) -> str | None:
        """vLLM's 400s for tool use: a tool_choice without tools, "auto" without the parser flags, an unknown name."""
        tools, choice = req.get("tools") or [], req.get("tool_choice")
        if choice in (None, "none"):
            if not tools or choice == "none":
                return None
            choice = "auto"  # vLLM's default when tools are given
        if not tools:
            return "When using `tool_choice`, `tools` must be set."
        args = self.engine.args
        if choice == "auto" and not (args.enable_auto_tool_choice and args.tool_call_parser):
            return '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        if choice not in ("auto", "required") and _named_tool(req) is None:
            return "The tool specified in `tool_choice` does not match any of the specified `tools`"
        return None

    def _complete(self, req: dict[str, Any], text: str, tokens: list[str], max_tokens: int, thinking: bool) -> None:
        e = self.engine
        t0 = time.monotonic()
        slow = MISBEHAVE == "slow"
        if slow:
            time.sleep(SLOW_REQUEST_DELAY_S)
        cached = e.cached_tokens(tokens)
        # prefill: only the uncached part costs time
        time.sleep(len("".join(tokens[cached:])) * e.seconds_per_char * (SLOW_PREFILL_FACTOR if slow else 1))
        want_logprobs = bool(req.get("logprobs"))
        top = int(req.get("top_logprobs") or 0) if want_logprobs else 0
        tools = req.get("tools") or []
        forced = _named_tool(req) if req.get("tool_choice") != "required" else tools[0]
        auto = bool(tools) and req.get("tool_choice") in (None, "auto")
        calls: list[dict[str, Any]] = []
        entries: list[dict[str, Any]] = []
        content: str | None = None
        reasoning: str | None = None
        if forced is not None or (auto and MISBEHAVE == "tools-broken"):
            # The model "writes" the call as Qwen does; the tool parser takes it out of the text (unless broken).
            tool = forced or tools[0]
            name, arguments = (tool.get("function") or {}).get("name"), tool_arguments(tool)
            written = json.dumps({"name": name, "arguments": arguments})
            n_out = min(len(tokenize(written)), max_tokens)
            if MISBEHAVE == "tools-broken":
                content, finish = f"<tool_call>\n{written}\n</tool_call>", "stop"
                pieces = tokenize(content)
            else:
                call = {"name": name, "arguments": json.dumps(arguments)}
                calls = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function", "function": call}]
                content, pieces, finish = "", [], "tool_calls"
        else:
            # The "model" ends its answer after 16 tokens; vLLM's ignore_eos and min_tokens make it go on.
            n_out = (
                max_tokens
                if req.get("ignore_eos")
                else max(min(max_tokens, 16), min(int(req.get("min_tokens") or 0), max_tokens))
            )
            answer = stale_tokens if MISBEHAVE == "cache-corrupt" and cached else greedy_tokens
            entries = answer(text, n_out, top)
            pieces = [entry["token"] for entry in entries]
            if req.get("return_tokens_as_token_ids"):
                entries = as_token_ids(entries)
            if e.args.reasoning_parser and thinking:  # the parser finds no end of thinking: all of it is reasoning
                reasoning = "".join(pieces)
            else:
                content = "".join(pieces)
            finish = "length" if n_out == max_tokens else "stop"
        usage: dict[str, Any] = {
            "prompt_tokens": len(tokens),
            "total_tokens": len(tokens) + n_out,
            "completion_tokens": n_out,
            "prompt_tokens_details": {"cached_tokens": cached} if e.args.enable_prompt_tokens_details else None,
        }
        if reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": n_out}
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req["model"]
        if not req.get("stream"):
            e.account(len(tokens), cached, n_out, time.monotonic() - t0)
            time.sleep(max(n_out - 1, 0) * e.seconds_per_token)  # the first token came with the prefill
            message = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
                       "function_call": None, "tool_calls": calls, "reasoning": reasoning}  # fmt: skip
            self._json(
                200,
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "logprobs": {"content": entries} if want_logprobs and entries else None,
                            "finish_reason": finish,
                            "stop_reason": None,
                        }
                    ],
                    "usage": usage,
                    "prompt_logprobs": None,
                },
            )
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("connection", "close")
        self.end_headers()

        def send(choices: list[dict[str, Any]], **extra: Any) -> None:
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        e.account(len(tokens), cached, n_out, time.monotonic() - t0)
        if MISBEHAVE == "stream-broken":
            self.wfile.write(
                b'data: {"id": "' + rid.encode() + b'", "choices": [{"index": 0, "delta": {"content": "st\n\n'
            )
            self.close_connection = True
            return
        if calls:
            delta = {"tool_calls": [{"index": 0, **calls[0]}]}
            send([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])
        field = "reasoning" if reasoning is not None else "content"
        first = time.monotonic()
        for i, piece in enumerate(pieces):
            # Paced from the first token, so a late wake-up delays one token, not every one after it.
            time.sleep(max(first + i * e.seconds_per_token - time.monotonic(), 0))
            logprobs = {"content": [entries[i]]} if want_logprobs and entries else None
            last = i == len(pieces) - 1
            send(
                [{"index": 0, "delta": {field: piece}, "logprobs": logprobs, "finish_reason": finish if last else None}]
            )
        if (req.get("stream_options") or {}).get("include_usage"):
            send([], usage=usage)
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


def _named_tool(req: dict[str, Any]) -> dict[str, Any] | None:
    """The tool a `tool_choice: {"type": "function", "function": {"name": ...}}` names, among the request's tools."""
    choice = req.get("tool_choice")
    if not isinstance(choice, dict):
        return None
    name = (choice.get("function") or {}).get("name")
    return next((t for t in req.get("tools") or [] if (t.get("function") or {}).get("name") == name), None)
