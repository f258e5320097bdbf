"""vllm-router's own HTTP API, reached through a health transport (SSH to the router host, then its loopback).

What it answers (vllm-router 0.1.17, measured; docs/router.md): GET /workers (url, is_healthy, load per worker),
GET /list_workers, GET /readiness, POST /add_worker?url= (blocks until the worker answers /health, up to
--worker-startup-timeout-secs), POST /remove_worker?url=; Prometheus text on its metrics port.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from gpufleet.errors import GpufleetError, one_line
from gpufleet.health.api import fetch
from gpufleet.remote.transport import Transport
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.metrics import Sample, samples

TIMEOUT_S = 10.0


class RouterError(GpufleetError):
    """The router refused or did not answer a request (one line: what, the router's answer)."""


@dataclass(frozen=True)
class Router:
    """One router: a transport to its host, its client port and its metrics port (on that host's loopback)."""

    name: str
    transport: Transport
    port: int
    metrics_port: int
    members_file: str | None = None  # on the router host: its worker set, replayed after a restart (router.spec)
    # What metrics() left out because it was not a number (NaN, infinite): name{labels}, once each, for the caller
    # to say (a rollout's reconcile does); kept out of comparisons, and cleared by whoever says it.
    non_finite: list[str] = field(default_factory=list, compare=False, repr=False)

    def get_json(self, path: str, timeout: float = TIMEOUT_S) -> Any:
        answer = fetch(self.transport, self.port, path, timeout)
        if answer.status != 200:
            raise RouterError(one_line(f"{self.name}: GET {path}: HTTP {answer.status}: {excerpt(answer.text)}"))
        try:
            return json.loads(answer.text)
        except json.JSONDecodeError:
            raise RouterError(one_line(f"{self.name}: GET {path}: not JSON: {excerpt(answer.text)}")) from None

    def post(self, path: str, timeout: float = TIMEOUT_S) -> str:
        conn = self.transport.http(self.port, timeout)
        try:
            conn.request("POST", path, headers={"Content-Length": "0"})
            resp = conn.getresponse()
            body = resp.read(1 << 16).decode(errors="replace")
        except OSError as error:
            raise RouterError(one_line(f"{self.name}: POST {path}: {error}")) from None
        finally:
            conn.close()
        if resp.status != 200:
            raise RouterError(one_line(f"{self.name}: POST {path}: HTTP {resp.status}: {excerpt(body)}"))
        return body

    def add_worker(self, url: str, timeout: float) -> None:
        self.post(f"/add_worker?url={quote(url, safe='')}", timeout)

    def remove_worker(self, url: str) -> None:
        self.post(f"/remove_worker?url={quote(url, safe='')}")

    def list_workers(self) -> list[str]:
        return [str(u) for u in self.get_json("/list_workers").get("urls", [])]

    def metrics(self) -> list[Sample]:
        """The router's finite metric samples; RouterError when they cannot be read. A sample that is NaN or
        infinite says nothing (a running-requests gauge of NaN is no count): left out, and named in non_finite."""
        answer = fetch(self.transport, self.metrics_port, "/metrics", TIMEOUT_S)
        if answer.status != 200:
            raise RouterError(one_line(f"{self.name}: GET /metrics: HTTP {answer.status}"))
        every = _parsed(answer.text, self.name)
        for name, labels, value in every:
            if not math.isfinite(value) and (key := _key(name, labels, value)) not in self.non_finite:
                self.non_finite.append(key)
        return [s for s in every if math.isfinite(s[2])]


def router_samples(text: str, router: str = "router") -> list[Sample]:
    """The finite samples of the router's Prometheus text (a NaN or infinite count says nothing: left out); a text
    that is not Prometheus is a RouterError."""
    return [s for s in _parsed(text, router) if math.isfinite(s[2])]


def _parsed(text: str, router: str) -> list[Sample]:
    try:
        return samples(text)
    except ValueError as error:
        raise RouterError(one_line(f"{router}: GET /metrics: {error}")) from None


def _key(name: str, labels: dict[str, str], value: float) -> str:
    inside = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inside}}} {value:g}" if inside else f"{name} {value:g}"
