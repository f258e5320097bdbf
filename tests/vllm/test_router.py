"""The real vllm-router 0.1.17 in front of 2 real vLLM replicas (the tiny hybrid, align mode): multi-turn agents
keep their prefix cache under the affine policies and lose some under round robin (bench/router_bench.py measures
the same at a larger size). The router comes from the cached index of the real PyPI wheels, installed offline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.vllm.servers import ServerSpec, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "router_bench.py"
_spec = importlib.util.spec_from_file_location("router_bench", _BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["router_bench"] = bench
_spec.loader.exec_module(bench)

AGENTS, TURNS, WORDS = 3, 4, 100


@pytest.fixture(scope="module")
def replicas(pair_factory, tmp_path_factory):
    model = models.build_hybrid(tmp_path_factory.mktemp("models") / "hybrid")
    specs = [ServerSpec(f"replica{i}", model, bench.FLAGS, expected(**bench.ALIGN)) for i in (1, 2)]
    return [f"http://127.0.0.1:{s.server.port}" for s in pair_factory(specs)]


@pytest.fixture(scope="module")
def router_venv():
    try:
        return bench.router_venv(bench.DEFAULTS["router_version"])
    except Exception as error:  # no cached index and no PyPI: the tier cannot start
        pytest.skip(f"vllm-router unavailable: {error}")


@pytest.fixture(scope="module")
def single(replicas):
    return bench.run_agents(replicas[0], "t0", AGENTS, TURNS, WORDS)


def through_router(router_venv, replicas, tmp_path, policy: str, tag: str) -> dict:
    router = bench.Router(router_venv, policy, replicas, tmp_path / f"router-{policy}.log")
    try:
        return bench.run_agents(router.base, tag, AGENTS, TURNS, WORDS)
    finally:
        router.stop()


def test_one_server_hits_its_cache_on_later_turns(single):
    assert single["hit_ratio_later_turns"] > 0.5


def hit_ratio_without_strays(rows: list[dict], strays: int) -> float:
    """The later turns' hit ratio, leaving out the `strays` turns with the fewest cached tokens."""
    later = sorted((r for r in rows if r["turn"] > 1), key=lambda r: r["cached_tokens"] / r["prompt_tokens"])
    kept = later[strays:]
    return sum(r["cached_tokens"] for r in kept) / sum(r["prompt_tokens"] for r in kept)


# consistent_hash is a function of the session key: no stray turn. cache_aware decides from its own view of each
# replica's cache and load at that moment: with this machine's CPU shared by other test tiers, one later turn in 9
# has been seen to go to the other replica (re-processed there: 0.63 against 0.73 of one server's hits, 1 run in
# 4); bench/router_bench.py measures it at 95% of one server's hits over 20 later turns.
STRAY_TURNS = {"consistent_hash": 0, "cache_aware": 1}


@pytest.mark.parametrize(("policy", "tag"), [("consistent_hash", "t1"), ("cache_aware", "t2")])
def test_affine_policies_keep_nine_tenths_of_one_servers_hits(router_venv, replicas, single, tmp_path, policy, tag):
    run = through_router(router_venv, replicas, tmp_path, policy, tag)
    assert run["requests"] == AGENTS * TURNS
    kept = hit_ratio_without_strays(run["rows"], STRAY_TURNS[policy])
    assert kept >= 0.9 * single["hit_ratio_later_turns"], run["rows"]


def test_round_robin_re_processes_whole_prompts(router_venv, replicas, single, tmp_path):
    run = through_router(router_venv, replicas, tmp_path, "round_robin", "t3")
    cold_later_turns = [r for r in run["rows"] if r["turn"] > 1 and r["cached_tokens"] == 0]
    # Each conversation's first visit to the second replica finds nothing cached there.
    assert len(cold_later_turns) >= AGENTS - 1, run["rows"]
    assert run["hit_ratio_later_turns"] < single["hit_ratio_later_turns"]
