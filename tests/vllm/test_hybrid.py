"""The probe on a Qwen-3.5-style hybrid (Qwen3-Next: 3 Gated DeltaNet + 1 attention layer, align mode).

With vLLM's default --max-num-batched-tokens a due hit is all-or-nothing depending on how turn N was chunked
(the chunk-alignment trap); with --max-num-batched-tokens equal to the block size every due hit happens.
"""

from __future__ import annotations

import json

import pytest

from gpufleet.health import HealthState, check
from gpufleet.health.probe import Verdict, probe
from tests.vllm.servers import ServerSpec, Started, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# The attention block size vLLM picks for this tiny hybrid in align mode (read back from cache_config_info below).
BLOCK = 640
ALIGN = {"enable_prefix_caching": "True", "mamba_cache_mode": "align"}


@pytest.fixture(scope="module")
def hybrid(pair_factory, tmp_path_factory) -> dict[str, Started]:
    model = models.build_hybrid(tmp_path_factory.mktemp("models") / "hybrid")
    flags = ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    default, fixed = pair_factory(
        [
            ServerSpec("default", model, flags, expected(**ALIGN)),
            # No --enable-prompt-tokens-details here: the probe must fall back to /metrics deltas.
            ServerSpec("fixed", model, [*flags, "--max-num-batched-tokens", str(BLOCK)], expected(**ALIGN), False),
        ]
    )
    return {"default": default, "fixed": fixed}


def test_hybrid_is_ready_in_align_mode_with_the_expected_block(hybrid):
    for s in hybrid.values():
        r = check(s.transport, s.expected)
        assert r.state is HealthState.READY, r.detail
        assert r.cache_config["mamba_cache_mode"] == "align"
        assert r.cache_config["block_size"] == str(BLOCK), "the fix below must equal the real block size"


def test_probe_finds_and_names_the_chunk_alignment_trap(hybrid):
    s = hybrid["default"]
    report = probe(s.transport, s.expected)
    print("\n[probe hybrid default]", json.dumps(report.as_dict(), indent=1))
    assert report.verdict is Verdict.CHUNK_ALIGNMENT_TRAP, report.evidence
    assert "chunk-alignment trap" in report.detail
    assert report.unit == BLOCK
    misses = [p for p in report.points if not p.hit]
    hits = [p for p in report.points if p.hit]
    assert misses and hits
    assert all(p.cached_tokens == 0 and p.due_tokens > 0 for p in misses)  # all-or-nothing
    assert any(f"--max-num-batched-tokens {BLOCK}" in f for f in report.fixes)
    assert any("--prefix-match-unit 128" in f for f in report.fixes)
    assert any(f"L mod U={p.l_mod_u}" in e for p in misses for e in report.evidence)


def test_probe_is_clean_with_the_measured_fix(hybrid):
    s = hybrid["fixed"]
    report = probe(s.transport, s.expected, max_num_batched_tokens=BLOCK)
    print("\n[probe hybrid fixed]", json.dumps(report.as_dict(), indent=1))
    assert report.verdict is Verdict.EFFECTIVE, report.evidence
    assert all(p.cached_tokens >= p.due_tokens > 0 for p in report.points)
    assert all(p.source == "metrics" for p in report.points)  # cached_tokens is null without the flag
    assert report.hit_ratio > 0.5
