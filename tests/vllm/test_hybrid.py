"""The probe on a Qwen-3.5-style hybrid (Qwen3-Next: 3 Gated DeltaNet + 1 attention layer, align mode).

"published" runs the write-up's batching shape (chunked prefill, --max-num-seqs 2, a --max-num-batched-tokens
that is not a multiple of the block) with a small batch, so prompts of 2-3 prefill chunks stay fast on CPU;
"fixed" has --max-num-batched-tokens equal to the block size, the measured fix.
"""

from __future__ import annotations

import json

import pytest

from gpufleet.health import HealthState, check
from gpufleet.health.probe import Verdict, probe
from gpufleet.lint import lint_spec
from gpufleet.settings import build_spec, merged_settings
from tests.vllm.servers import ServerSpec, Started, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# The attention block size vLLM picks for this tiny hybrid in align mode (read back from cache_config_info below).
BLOCK = 640
# The write-up runs --max-num-batched-tokens 8192 --max-num-seqs 2; 8192 is no multiple of a GPU block size
# either. 1024 keeps that shape at a size where 1.5 and 2.5 chunks fit max_model_len 4096 on 2 CPU cores.
PUBLISHED_BATCH = 1024
ALIGN = {"enable_prefix_caching": "True", "mamba_cache_mode": "align"}
FLAGS = ["--enable-prefix-caching", "--mamba-cache-mode", "align", "--enable-chunked-prefill"]


@pytest.fixture(scope="module")
def hybrid(pair_factory, tmp_path_factory) -> dict[str, Started]:
    model = models.build_hybrid(tmp_path_factory.mktemp("models") / "hybrid")
    published, fixed = pair_factory(
        [
            ServerSpec("published", model, [*FLAGS, "--max-num-batched-tokens", str(PUBLISHED_BATCH), "--max-num-seqs", "2"],
                       expected(**ALIGN)),
            # No --enable-prompt-tokens-details here: the probe must fall back to /metrics deltas.
            ServerSpec("fixed", model, [*FLAGS, "--max-num-batched-tokens", str(BLOCK)], expected(**ALIGN), False),
        ]
    )  # fmt: skip
    return {"published": published, "fixed": fixed}


@pytest.fixture(scope="module")
def published_report(hybrid):
    s = hybrid["published"]
    report = probe(s.transport, s.expected, max_num_batched_tokens=PUBLISHED_BATCH)
    print("\n[probe hybrid published]", json.dumps(report.as_dict(), indent=1))
    return report


def test_hybrid_is_ready_in_align_mode_with_the_expected_block(hybrid):
    for s in hybrid.values():
        r = check(s.transport, s.expected)
        assert r.state is HealthState.READY, r.detail
        assert r.cache_config["mamba_cache_mode"] == "align"
        assert r.cache_config["block_size"] == str(BLOCK), "the fix below must equal the real block size"


def test_multi_chunk_points_are_measured_and_judged_the_trap(published_report):
    report = published_report
    long = [p for p in report.points if p.kind == "multi-chunk"]
    assert [p.chunks for p in long] == [2, 3]
    assert all(p.prompt_tokens > PUBLISHED_BATCH for p in long)
    assert report.verdict is Verdict.CHUNK_ALIGNMENT_TRAP, report.evidence
    misses = [p for p in report.points if not p.hit]
    # Whole blocks lost: 0, or in the session only an older checkpoint's tokens.
    assert misses and all(p.cached_tokens % BLOCK == 0 and p.cached_tokens < p.due_tokens for p in misses)
    assert any(p.kind == "multi-chunk" for p in misses), "a multi-chunk turn lost its due hit"
    assert any("chunks): cached 0 of" in e for e in report.evidence)
    # The fixes are computed from the block the server resolved, both legal here.
    assert any(f.startswith(f"--max-num-batched-tokens {BLOCK} ") for f in report.fixes)
    assert any(f.startswith("--prefix-match-unit 128 ") for f in report.fixes)
    assert report.requests <= report.request_bound


def test_session_figures_match_the_servers_own_counts(published_report):
    turns = published_report.session
    assert [t.turn for t in turns] == [0, 1, 2, 3]
    assert turns[0].cached_tokens == 0  # turn N is cold
    for t in turns:
        # usage.prompt_tokens_details (this server reports it) and the /metrics counters say the same.
        assert t.usage_cached == t.metrics_hits == t.cached_tokens, t
        assert t.metrics_queries == t.prompt_tokens, t
        assert t.metrics_computed == t.reprocessed_tokens == t.prompt_tokens - t.cached_tokens, t
    for prev, t in zip(turns, turns[1:], strict=False):
        assert t.due_tokens == (prev.prompt_tokens - 1) // BLOCK * BLOCK
        assert t.prompt_tokens > prev.prompt_tokens


def test_probe_is_clean_with_the_measured_fix_at_every_length_and_turn(hybrid):
    s = hybrid["fixed"]
    report = probe(s.transport, s.expected, max_num_batched_tokens=BLOCK)
    print("\n[probe hybrid fixed]", json.dumps(report.as_dict(), indent=1))
    assert report.verdict is Verdict.EFFECTIVE, report.evidence
    assert {p.kind for p in report.points} == {"sweep", "multi-chunk", "session"}
    assert all(p.cached_tokens >= p.due_tokens > 0 for p in report.points)
    assert all(p.source == "metrics" for p in report.points)  # cached_tokens is null without the flag
    for t in report.session[1:]:
        assert t.usage_cached is None and t.metrics_hits == t.cached_tokens >= t.due_tokens > 0
        assert t.metrics_computed == t.reprocessed_tokens
    assert report.hit_ratio > 0.5


def test_lint_names_the_unit_that_divides_the_served_block(hybrid):
    r = check(hybrid["published"].transport, hybrid["published"].expected)
    findings = lint_spec(build_spec("box", {}), merged_settings({}), served=r.cache_config)
    (chunking,) = [f for f in findings if f.rule.id == "hybrid-align-chunk-alignment"]
    assert '"prefix-match-unit": 128' in chunking.fix and f"block size {BLOCK}" in chunking.fix
