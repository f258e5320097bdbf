"""HTTP over a Transport with one deadline and a capped body: GETs, and a streamed chat completion with its TTFT.

Whatever the server sends becomes an Answer or an exception quoting it in one line (docs/health.md, Bounds).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpufleet.remote.transport import (
    LOOPBACK,
    MAX_BODY_BYTES,
    AnswerTooLarge,
    BadAnswer,
    DeadlineExceeded,
    DeadlineHTTPConnection,
    Transport,
)
from gpufleet.wire.evidence import excerpt

DEFAULT_TIMEOUT_S = 10.0


class NotHttp(BadAnswer):
    """The listener does not speak HTTP/1.x."""


class BrokenAnswer(BadAnswer):
    """An HTTP answer broken off or malformed."""


class HttpStatusError(Exception):
    """A streamed completion answered with another status than 200."""

    def __init__(self, path: str, status: int, body: str):
        self.path, self.status, self.body = path, status, body
        super().__init__(f"{path} answered {status}: {excerpt(body)}")


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


def _headers(api_key: str | None) -> dict[str, str]:
    # The key travels inside the SSH channel, never on a command line.
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _not_http(request: str, head: bytes) -> NotHttp:
    if head[:1] in (b"\x15", b"\x16") and head[1:2] == b"\x03":  # a TLS record: alert or handshake
        return NotHttp(f"{request}: the port answers in TLS, not plain HTTP (first bytes {excerpt(head, 24)})")
    return NotHttp(f"{request}: the port does not answer HTTP: {excerpt(head) or 'an empty status line'}")


@contextlib.contextmanager
def _translated(request: str, conn: DeadlineHTTPConnection) -> Iterator[None]:
    """Turn http.client's and the wire's errors into this module's, quoting what the server sent."""
    wire = conn.wire
    try:
        yield
    except (ConnectionResetError, BrokenPipeError) as e:
        if not wire.received:
            raise  # nothing answered, as docker-proxy does before vLLM listens
        raise BrokenAnswer(f"{request}: connection closed after {wire.received} bytes: {excerpt(wire.head)}") from e
    except http.client.UnknownProtocol as e:
        raise NotHttp(
            f"{request}: the port answers {excerpt(str(e.args[0]) if e.args else '?', 20)}, not HTTP/1.x"
        ) from e
    except http.client.BadStatusLine as e:
        raise _not_http(request, wire.head) from e
    except http.client.LineTooLong as e:
        if not wire.head.startswith(b"HTTP/"):
            raise _not_http(request, wire.head) from e
        what = next((w for w in ("header line", "chunk size", "trailer line") if w in str(e)), "line")
        raise BrokenAnswer(f"{request}: a {what} over 64 KiB") from e
    except http.client.IncompleteRead as e:
        more = f", {e.expected} more announced" if e.expected else ""
        raise BrokenAnswer(f"{request}: body broken off after {len(e.partial)} bytes{more}") from e
    except http.client.HTTPException as e:  # e.g. "got more than 100 headers"
        raise BrokenAnswer(f"{request}: malformed answer: {excerpt(str(e))}") from e
    except AnswerTooLarge as e:
        raise AnswerTooLarge(f"{request}: {e}", e.head) from e
    except DeadlineExceeded as e:
        seen = f": {excerpt(e.head)}" if e.head else ""
        raise DeadlineExceeded(f"{request}: {e}{seen}", e.head) from e


def fetch(
    transport: Transport,
    port: int,
    path: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    api_key: str | None = None,
    max_body: int = MAX_BODY_BYTES,
    json_body: dict[str, Any] | None = None,
    address: str = LOOPBACK,
) -> Answer:
    """GET path, or POST json_body to it, within `timeout` seconds overall; a body over max_body is AnswerTooLarge."""
    method = "GET" if json_body is None else "POST"
    conn = transport.http(port, timeout, address=address)
    resp = None
    try:
        with _translated(f"{method} {path}", conn):
            if json_body is None:
                conn.request("GET", path, headers={"Accept": "*/*", **_headers(api_key)})
            else:
                conn.request(
                    "POST",
                    path,
                    json.dumps(json_body),
                    {"Accept": "application/json", "Content-Type": "application/json", **_headers(api_key)},
                )
            resp = conn.getresponse()
            body = resp.read(max_body + 1)
            if len(body) > max_body:
                raise AnswerTooLarge(f"body over {max_body} bytes")
            if resp.length:  # http.client accepts a short body when the server closes early
                raise http.client.IncompleteRead(body, resp.length)
        return Answer(resp.status, body)
    finally:
        if resp is not None:
            resp.close()
        conn.close()


def get(
    transport: Transport,
    port: int,
    path: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    api_key: str | None = None,
    address: str = LOOPBACK,
) -> tuple[int, str]:
    """(status, body) of fetch()."""
    answer = fetch(transport, port, path, timeout=timeout, api_key=api_key, address=address)
    return answer.status, answer.text


@dataclass(frozen=True)
class Completion:
    """One streamed chat completion, measured."""

    ttft_s: float  # until the first chunk carrying a choice
    total_s: float
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # None when the server does not report it
    finish_reason: str | None = None
    done: bool = False  # the stream ended with "data: [DONE]"
    chunks: int = 0  # chunks that carried a choice


def stream_chat(
    transport: Transport,
    port: int,
    body: dict[str, Any],
    api_key: str | None = None,
    timeout: float = 120.0,
    address: str = LOOPBACK,
) -> Completion:
    """POST /v1/chat/completions streamed, with usage in the final chunk, within `timeout` overall."""
    path = "/v1/chat/completions"
    payload = body | {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json", **_headers(api_key)}
    conn = transport.http(port, timeout, address=address)
    try:
        with _translated(f"POST {path}", conn):
            start = time.monotonic()
            conn.request("POST", path, json.dumps(payload), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise HttpStatusError(path, resp.status, resp.read(MAX_BODY_BYTES).decode(errors="replace"))
            ttft: float | None = None
            parts: list[str] = []
            usage: dict[str, Any] = {}
            details: dict[str, Any] = {}
            finish_reason: str | None = None
            done, chunks = False, 0
            for raw in resp:  # the wire's cap bounds the stream
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                    for choice in chunk.get("choices") or []:
                        chunks += 1
                        finish_reason = choice.get("finish_reason") or finish_reason
                        if ttft is None:
                            ttft = time.monotonic() - start
                        delta = choice.get("delta") or {}
                        parts.append(
                            str(delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content") or "")
                        )
                    usage = dict(chunk.get("usage") or usage)
                    details = dict(usage.get("prompt_tokens_details") or {})
                except (ValueError, TypeError, AttributeError, RecursionError) as e:
                    raise BrokenAnswer(f"POST {path}: not an OpenAI stream chunk: {excerpt(data)}") from e
            total = time.monotonic() - start
    finally:
        conn.close()
    return Completion(
        ttft_s=ttft if ttft is not None else total,
        total_s=total,
        text="".join(parts),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=details.get("cached_tokens"),
        finish_reason=finish_reason,
        done=done,
        chunks=chunks,
    )
