"""Helpers for the vllm tier: start real vLLM servers in pairs and record what was seen while they started."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from gpufleet.health import HealthReport, check, wait_until_ready
from gpufleet.wire.identity import Expected
from tests.loopback import LoopbackTransport
from tests.vllm_peer import models
from tests.vllm_peer.server import VllmServer, base_args

SERVED = "tiny"
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 240.0

# The hybrid in align mode, as the profile serves it; the labels its /metrics must show.
ALIGN = {"enable_prefix_caching": "True", "mamba_cache_mode": "align"}
ALIGN_FLAGS = ["--enable-prefix-caching", "--mamba-cache-mode", "align", "--enable-chunked-prefill"]
# Two shapes of the tiny hybrid whose states need attention blocks of different sizes (640 and 384 tokens on an
# AVX-512 CPU with bf16; 384 and 256 where vLLM computes in fp32): every test that depends on the block runs on both,
# so none can encode one machine's value. Keyword arguments of models.build_hybrid.
HYBRID_SHAPES: dict[str, dict[str, int]] = {"hybrid": {}, "hybrid-small-state": {"linear_num_value_heads": 2}}


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
    cpu: int | None = None  # the one core it runs on (None: every core)


def start_pair(venv: Path, workdir: Path, specs: list[ServerSpec]) -> list[Started]:
    """Spawn servers together (their ~20 s loads overlap), check each while loading, then wait for all."""
    assert len(specs) <= 2, "at most 2 vLLM servers at once (2 cores)"
    servers = []
    for spec in specs:
        (workdir / spec.label).mkdir(parents=True, exist_ok=True)
        key = ["--api-key", spec.api_key] if spec.api_key else []
        args = [*base_args(MAX_MODEL_LEN, spec.prompt_tokens_details), *spec.args, *key]
        servers.append(VllmServer(venv, spec.model, workdir / spec.label, SERVED, args, cpu=spec.cpu).start())
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
            started.append(
                Started(srv, transport, exp, while_loading, ready, time.monotonic() - srv.started_at, spec.api_key)
            )
    except BaseException:
        for srv in servers:
            srv.stop()
        raise
    return started


def expected(**cache: str) -> Expected:
    # The port is filled in per server by start_pair.
    return Expected("vllm", 0, SERVED, MAX_MODEL_LEN, dict(cache))


def resolve_hybrid_blocks(venv: Path, workdir: Path) -> dict[str, int]:
    """The attention block each of HYBRID_SHAPES resolves on this machine, read from servers started for it (both at
    once, then stopped). What the engine resolves depends on the CPU (on GPUs, on the GPU), so flags derived from
    it (a batch of one block, the write-up's batch shape) can only come from a server started on this machine."""
    # Short labels: a server's work dir holds vLLM's IPC sockets, whose paths may not pass 107 characters.
    specs = [ServerSpec(f"s{i}", models.build_hybrid(workdir / f"model{i}", **shape), ALIGN_FLAGS, expected(**ALIGN))
             for i, shape in enumerate(HYBRID_SHAPES.values())]  # fmt: skip
    started = start_pair(venv, workdir, specs)
    try:
        return {name: int(check(s.transport, s.expected).cache_config["block_size"])
                for name, s in zip(HYBRID_SHAPES, started, strict=True)}  # fmt: skip
    finally:
        for s in started:
            s.server.stop()
