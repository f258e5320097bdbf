"""Small HTTP helpers over a Transport: JSON GETs and a streaming chat completion with its TTFT."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from gpufleet.health.transport import Transport


class HttpStatusError(Exception):
    def __init__(self, path: str, status: int, body: str):
        self.path, self.status, self.body = path, status, body
        super().__init__(f"GET {path}: HTTP {status} {body[:120]}")


def _headers(api_key: str | None) -> dict[str, str]:
    # The key travels inside the transport (the SSH channel), never on a command line.
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def get(transport: Transport, port: int, path: str, timeout: float = 10.0, api_key: str | None = None) -> tuple[int, str]:
    """(status, body). Raises ConnectionRefusedError / OSError / http.client errors on transport trouble."""
    conn = transport.http(port, timeout)
    try:
        conn.request("GET", path, headers={"Accept": "*/*", **_headers(api_key)})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def get_json(transport: Transport, port: int, path: str, timeout: float = 10.0, api_key: str | None = None) -> Any:
    status, body = get(transport, port, path, timeout, api_key)
    if status != 200:
        raise HttpStatusError(path, status, body)
    return json.loads(body)


@dataclass(frozen=True)
class Completion:
    """One streamed chat completion, measured."""

    ttft_s: float  # request sent -> first SSE chunk carrying a choice
    total_s: float
    text: str  # content, or the reasoning text when a reasoning parser moved everything there
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None when the server does not report it


def stream_chat(
    transport: Transport,
    port: int,
    body: dict[str, Any],
    api_key: str | None = None,
    timeout: float = 120.0,
) -> Completion:
    """POST /v1/chat/completions with stream=True and usage in the final chunk."""
    payload = body | {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json", **_headers(api_key)}
    conn = transport.http(port, timeout)
    try:
        start = time.monotonic()
        conn.request("POST", "/v1/chat/completions", json.dumps(payload), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise HttpStatusError("/v1/chat/completions", resp.status, resp.read().decode(errors="replace"))
        ttft, parts, usage = None, [], None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                if ttft is None:
                    ttft = time.monotonic() - start
                delta = choice.get("delta") or {}
                # Content may be null with a reasoning parser: the text is then in reasoning(_content).
                parts.append(delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content") or "")
            usage = chunk.get("usage") or usage
        total = time.monotonic() - start
    finally:
        conn.close()
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        ttft_s=ttft if ttft is not None else total,
        total_s=total,
        text="".join(parts),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=details.get("cached_tokens"),
    )
