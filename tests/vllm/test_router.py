"""The real vllm-router 0.1.17 in front of 2 real vLLM replicas (the tiny hybrid, align mode, a batch of the block
this machine resolves): where each request went (each replica's own /metrics) and the later turns' prefix-cache hits,
against one server alone (bench/router_bench.py measures the same over more runs and every candidate policy).

The router the deploy ships (DEFAULTS' policy, on replicas with the flags every replica behind a router gets,
gpufleet.vllm.settings.BEHIND_ROUTER_ARGS: --enable-scale-out, which cache_aware needs) must spread K = 2N agents over the N = 2 replicas (the busiest
replica takes on average at most 1.5x its fair share over the runs) and keep at least 90% of one server's later-turn
hits, with X-Session-ID and without it (coding agents do not all send one). One server's hits are taken for the same
turns (each later turn's previous prompt in whole blocks, checked on one server's own runs), so conversations of
different lengths do not move the share. Round robin, which spreads but keeps no affinity, shows the hit measure
tells the two apart. The router comes from the cached index of the real PyPI wheels, installed offline."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

from tests.vllm.servers import ALIGN, ServerSpec, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "router_bench.py"
_spec = importlib.util.spec_from_file_location("router_bench", _BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["router_bench"] = bench
_spec.loader.exec_module(bench)

# K = 2N agents over N = 2 replicas; RUNS runs of fresh agents per header mode (the bench does 5).
AGENTS, TURNS, WORDS, RUNS = 4, 4, 100, 3
# Run tags of one length (every run's prompts are the same size, so block alignment treats them alike).
_TAGS = (f"t{n:03d}" for n in itertools.count())


@pytest.fixture(scope="module")
def replicas(pair_factory, tmp_path_factory, hybrid_blocks):
    model = models.build_hybrid(tmp_path_factory.mktemp("models") / "hybrid")
    # The replicas as the deploy runs them behind a router: with --enable-scale-out, which its default policy needs
    # (cache_aware routes on the token ids of the replica's /render).
    flags = [*bench.replica_flags(hybrid_blocks["hybrid"]), *bench.behind_router_flags()]
    specs = [ServerSpec(f"replica{i}", model, flags, expected(**ALIGN)) for i in (1, 2)]
    return [f"http://127.0.0.1:{s.server.port}" for s in pair_factory(specs)]


@pytest.fixture(scope="module")
def router_venv():
    try:
        return bench.router_venv(bench.DEFAULTS["router_version"])
    except Exception as error:  # no cached index and no PyPI: the tier cannot start
        pytest.skip(f"vllm-router unavailable: {error}")


@pytest.fixture(scope="module")
def single(replicas):
    """The same agents sent straight to one replica: the hit ratio a router is held to."""
    return bench.Series([bench.run_agents(replicas[0], next(_TAGS), AGENTS, TURNS, WORDS, replicas) for _ in range(2)])


def through_router(router_venv, replicas, tmp_path, candidate, runs: int, session: bool):
    series, decisions = bench.through_router(router_venv, candidate, replicas, tmp_path / "router.log", _TAGS, runs,
                                             AGENTS, TURNS, WORDS, session)
    for run in series.runs:
        assert run["requests"] == AGENTS * TURNS
        # Every request is counted by the replica that served it, and by no other.
        assert sum(run["requests_per_replica"]) == AGENTS * TURNS, run["requests_per_replica"]
    return series, decisions


def test_one_server_hits_its_cache_on_later_turns(single, hybrid_blocks):
    assert all(run["requests_per_replica"] == [AGENTS * TURNS, 0] for run in single.runs)
    assert single.hit_ratio > 0.5, [run["rows"] for run in single.runs]
    # What the router is held to, turn by turn: one server takes each later turn's previous prompt from its cache, in
    # whole blocks (bench.one_server_cached).
    assert single.one_server_rule_holds(hybrid_blocks["hybrid"]), [run["rows"] for run in single.runs]


@pytest.mark.parametrize("session", [True, False], ids=["with-session-id", "without-session-id"])
def test_the_default_router_spreads_agents_and_keeps_nine_tenths_of_one_servers_hits(
    router_venv, replicas, single, hybrid_blocks, tmp_path, session
):
    candidate = bench.default_candidate()
    series, decisions = through_router(router_venv, replicas, tmp_path, candidate, RUNS, session)
    s = bench.summary(series, single, hybrid_blocks["hybrid"])
    print(f"\n[router default: {candidate.policy}, replicas {'with' if candidate.scale_out else 'without'} "
          f"{bench.SCALE_OUT}] {'with' if session else 'without'} X-Session-ID: requests per replica per run "
          f"{s['per_run_requests_per_replica']}, busiest/fair {s['busiest_over_fair_mean']:.2f}, later-turn hits "
          f"{s['share_of_one_server_same_turns']:.1%} of one server's for the same turns (hit ratio "
          f"{s['hit_ratio_later_turns']}, one server's {single.hit_ratio:.3f} on other conversations)\n"
          + "\n".join(decisions))
    assert s["busiest_over_fair_mean"] <= bench.SPREAD_TARGET, s["per_run_requests_per_replica"]
    assert s["share_of_one_server_same_turns"] >= bench.HIT_SHARE_TARGET, [run["rows"] for run in series.runs]


def test_round_robin_spreads_evenly_and_re_processes_whole_prompts(router_venv, replicas, single, tmp_path):
    series, _ = through_router(router_venv, replicas, tmp_path, bench.Candidate("round_robin", "round_robin"), 1, True)
    run = series.runs[0]
    print(f"\n[router round_robin] requests per replica {run['requests_per_replica']}, later-turn hit ratio "
          f"{run['hit_ratio_later_turns']}")
    assert max(run["requests_per_replica"]) - min(run["requests_per_replica"]) <= 1, run["requests_per_replica"]
    # Each conversation's first visit to the second replica finds nothing cached there.
    assert run["later_turns_without_hit"] >= AGENTS - 1, run["rows"]
    assert series.hit_ratio < single.hit_ratio
