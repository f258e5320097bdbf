"""Helpers for the vllm tier: start real vLLM servers in pairs and record what was seen while they started."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from gpufleet.health import Expected, HealthReport, check, wait_until_ready
from tests.loopback import LoopbackTransport
from tests.vllm_peer.server import VllmServer, base_args

SERVED = "tiny"
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 240.0


@dataclass
class Started:
    """A running server, with what was observed while it started."""

    server: VllmServer
    transport: LoopbackTransport
    expected: Expected
    while_loading: HealthReport  # a check() made right after spawning, before the port listens
    ready: HealthReport
    start_s: float  # spawn -> ready, as wait_until_ready saw it
    api_key: str | None = None


@dataclass(frozen=True)
class ServerSpec:
    label: str
    model: Path
    args: list[str]
    expected: Expected  # port 0: filled in per server
    prompt_tokens_details: bool = True  # usage.prompt_tokens_details.cached_tokens in responses
    api_key: str | None = None  # run with --api-key: /v1/* then needs it


def start_pair(venv: Path, workdir: Path, specs: list[ServerSpec]) -> list[Started]:
    """Spawn servers together (their ~20 s loads overlap), check each while loading, then wait for all."""
    assert len(specs) <= 2, "at most 2 vLLM servers at once (2 cores)"
    servers = []
    for spec in specs:
        (workdir / spec.label).mkdir(parents=True, exist_ok=True)
        key = ["--api-key", spec.api_key] if spec.api_key else []
        args = [*base_args(MAX_MODEL_LEN, spec.prompt_tokens_details), *spec.args, *key]
        servers.append(VllmServer(venv, spec.model, workdir / spec.label, SERVED, args).start())
    started = []
    try:
        early = []
        for srv, spec in zip(servers, specs, strict=True):
            exp = dataclasses.replace(spec.expected, port=srv.port)
            transport = LoopbackTransport(srv.proc, srv.log_path, name=f"{srv.model.name}:{srv.port}")
            early.append((transport, exp, check(transport, exp)))
        for srv, spec, (transport, exp, while_loading) in zip(servers, specs, early, strict=True):
            ready = wait_until_ready(transport, exp, timeout_s=START_TIMEOUT_S, poll_s=0.5, api_key=spec.api_key)
            if not ready.ready:
                raise RuntimeError(f"{srv.model.name} did not become ready: {ready.detail}\n{srv.log_tail()}")
            started.append(Started(srv, transport, exp, while_loading, ready, time.monotonic() - srv.started_at, spec.api_key))
    except BaseException:
        for srv in servers:
            srv.stop()
        raise
    return started


def expected(**cache: str) -> Expected:
    # The port is filled in per server by start_pair.
    return Expected("vllm", 0, SERVED, MAX_MODEL_LEN, dict(cache))
