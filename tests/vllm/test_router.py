"""The real vllm-router 0.1.17 in front of 2 real vLLM replicas (the tiny hybrid, align mode, a batch of the block
this machine resolves): where each request went (each replica's own /metrics) and the later turns' prefix-cache hits,
against one server alone (bench/router_bench.py measures the same, and time per turn, over more runs and policies).

The router the deploy ships (DEFAULTS' policy behind the deploy's nginx front door, which keys a session for a
request without X-Session-ID, on replicas with the flags every replica behind a router gets) must spread K = 2N
agents over the N = 2 replicas (the busiest replica takes at most 1.5x its fair share) and keep at least 90% of one
server's later-turn hits, for agents that pause between turns and agents that send them back to back, with
X-Session-ID and without it (coding agents do not all send one). It places each new session on the replica with the
fewest and keeps it there, under one lock in the router, whatever the timing: so one run per case proves it, and
whole conversations split evenly with no later turn missing its prefix is the placement an agent pinned to its own
replica by hand gets (the bench compares their time per turn). One server's hits are taken for the same turns (each
later turn's previous prompt in whole blocks, checked on one server's own runs). Round robin, which spreads but
keeps no affinity, shows the hit measure tells the two apart. The router comes from the cached index of the real
PyPI wheels, installed offline; the front door needs this machine's nginx with Debian's njs module."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

from tests import frontdoor
from tests.vllm.servers import ALIGN, ServerSpec, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "router_bench.py"
_spec = importlib.util.spec_from_file_location("router_bench", _BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["router_bench"] = bench
_spec.loader.exec_module(bench)

# K = 2N agents over N = 2 replicas; agents that pause start 1 s apart and think 2 s between turns (issue 38).
AGENTS, TURNS, WORDS = 4, 4, 100
STAGGER_S, THINK_S = 1.0, 2.0
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
    if frontdoor.missing():
        pytest.skip(f"the router's front door cannot run here: {frontdoor.missing()}")
    try:
        return bench.router_venv(bench.DEFAULTS["router_version"])
    except Exception as error:  # no cached index and no PyPI: the tier cannot start
        pytest.skip(f"vllm-router unavailable: {error}")


@pytest.fixture(scope="module")
def single(replicas):
    """The same agents sent straight to one replica: the hit ratio a router is held to."""
    return bench.Series([bench.run_agents(replicas[0], next(_TAGS), AGENTS, TURNS, WORDS, replicas) for _ in range(2)])


def through_router(router_venv, replicas, tmp_path, candidate, runs: int, session: bool, paused: bool = False):
    pace = (STAGGER_S, THINK_S) if paused else (0.0, 0.0)
    series, decisions = bench.through_router(
        router_venv, candidate, replicas, tmp_path / "router.log", _TAGS, runs, AGENTS, TURNS, WORDS, session, *pace
    )
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


@pytest.mark.parametrize("paused", [True, False], ids=["pausing", "back-to-back"])
@pytest.mark.parametrize("session", [True, False], ids=["with-session-id", "without-session-id"])
def test_the_default_front_door_spreads_agents_and_keeps_one_servers_hits(
    router_venv, replicas, single, hybrid_blocks, tmp_path, session, paused
):
    candidate = bench.default_candidate()
    series, decisions = through_router(router_venv, replicas, tmp_path, candidate, 1, session, paused)
    s = bench.summary(series, single, hybrid_blocks["hybrid"])
    (run,) = series.runs
    print(
        f"\n[router default: {candidate.policy} behind its front door] {'pausing' if paused else 'back to back'}, "
        f"{'with' if session else 'without'} X-Session-ID: requests per replica {run['requests_per_replica']}, "
        f"later-turn hits {s['share_of_one_server_same_turns']:.1%} of one server's for the same turns, seconds per "
        f"later turn p50 {s['later_turn_seconds_p50']} p95 {s['later_turn_seconds_p95']}\n" + "\n".join(decisions)
    )
    assert s["busiest_over_fair_mean"] <= bench.SPREAD_TARGET, run["requests_per_replica"]
    assert s["share_of_one_server_same_turns"] >= bench.HIT_SHARE_TARGET, run["rows"]
    # Hand-pinned placement: whole conversations, two per replica, and every later turn found its prefix.
    assert run["requests_per_replica"] == [AGENTS * TURNS // 2] * 2 and run["later_turns_without_hit"] == 0, run["rows"]


def test_round_robin_spreads_evenly_and_re_processes_whole_prompts(router_venv, replicas, single, tmp_path):
    series, _ = through_router(router_venv, replicas, tmp_path, bench.Candidate("round_robin", "round_robin"), 1, True)
    run = series.runs[0]
    print(
        f"\n[router round_robin] requests per replica {run['requests_per_replica']}, later-turn hit ratio "
        f"{run['hit_ratio_later_turns']}"
    )
    assert max(run["requests_per_replica"]) - min(run["requests_per_replica"]) <= 1, run["requests_per_replica"]
    # Each conversation's first visit to the second replica finds nothing cached there.
    assert run["later_turns_without_hit"] >= AGENTS - 1, run["rows"]
    assert series.hit_ratio < single.hit_ratio
