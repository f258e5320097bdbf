"""The probe's verdicts on point figures measured on real vLLM servers (tests/vllm produces them live)."""

from __future__ import annotations

from gpufleet.health.api import Completion
from gpufleet.health.metrics import Metrics
from gpufleet.health.probe import HITS, PREFILL_COMPUTED, ProbePoint, Verdict, _cached, _Conversation, judge


def point(L: int, cached: int, unit: int = 640, ttft=0.18, next_ttft=0.02) -> ProbePoint:
    return ProbePoint(L, L + 41, unit, cached, 0, ttft, next_ttft, "usage")


# Hybrid B=640, default --max-num-batched-tokens: measured (L, cached on turn N+1).
TRAP = [(814, 0), (1028, 0), (1306, 1280), (1597, 0), (2004, 1920), (2208, 0)]


def verdict(points, *, mamba="align", prefix_caching=True, mnbt=None, unit=640):
    return judge("h", points, 640, unit, prefix_caching, mamba, mnbt)


def test_due_tokens_follow_the_unit_and_the_recomputed_last_token():
    assert point(1280, 0).due_tokens == 640  # the last token is always recomputed: 1279 // 640 blocks
    assert point(1281, 0).due_tokens == 1280
    assert point(640, 0).due_tokens == 0  # below U+1 nothing can hit
    assert point(1306, 1280).reprocessed_tokens == 1347 - 1280


def test_all_or_nothing_misses_on_an_align_hybrid_are_the_chunk_alignment_trap():
    r = verdict([point(L, c) for L, c in TRAP])
    assert r.verdict is Verdict.CHUNK_ALIGNMENT_TRAP
    assert "4 of 6" in r.detail and "--max-num-batched-tokens default" in r.detail
    assert r.fixes[0].startswith("--max-num-batched-tokens 640")
    assert any("--prefix-match-unit 128" in f for f in r.fixes)
    assert "L=814 (L mod U=174, U=640): cached 0 of 640 due" in r.evidence
    assert not r.ok


def test_configured_max_num_batched_tokens_is_cited():
    r = verdict([point(L, c) for L, c in TRAP], mnbt=8192)
    assert "--max-num-batched-tokens 8192" in r.detail


def test_the_same_misses_are_not_called_the_trap_when_its_fix_is_in_place():
    # With --max-num-batched-tokens equal to the block size the trap cannot be the cause: plainly ineffective.
    r = verdict([point(L, c) for L, c in TRAP], mnbt=640)
    assert r.verdict is Verdict.INEFFECTIVE
    assert r.fixes == ()


def test_dense_model_misses_are_ineffective_not_the_trap():
    r = verdict([point(300, 256, unit=128), point(400, 0, unit=128)], mamba=None, unit=128)
    assert r.verdict is Verdict.INEFFECTIVE


def test_every_due_hit_is_effective():
    r = verdict([point(L, (L - 1) // 640 * 640) for L, _ in TRAP], mnbt=640)
    assert r.verdict is Verdict.EFFECTIVE and r.ok
    assert 0.5 < r.hit_ratio < 1


def test_no_hits_with_caching_disabled_says_so():
    r = verdict([point(L, 0, unit=128) for L in (200, 330, 460)], mamba=None, prefix_caching=False, unit=128)
    assert r.verdict is Verdict.INEFFECTIVE
    assert "prefix caching is disabled" in r.detail


def test_ttft_is_a_signal_only_when_cold_prefill_dominates():
    pts = [point(1306, 1280, ttft=0.18, next_ttft=0.013)]
    assert judge("h", pts, 640, 640, True, "align", 640, small_prompt_ttft_s=0.005).ttft_is_signal
    assert not judge("h", pts, 640, 640, True, "align", 640, small_prompt_ttft_s=0.05).ttft_is_signal


def test_metrics_fallback_uses_counter_deltas():
    turn = Completion(0.01, 0.02, "", prompt_tokens=1347, completion_tokens=2, cached_tokens=None)
    before = Metrics({HITS: 100.0, PREFILL_COMPUTED: 5000.0})
    after = Metrics({HITS: 1380.0, PREFILL_COMPUTED: 5067.0})
    assert _cached(turn, before, after) == (1280, "metrics")
    reported = Completion(0.01, 0.02, "", prompt_tokens=1347, completion_tokens=2, cached_tokens=640)
    assert _cached(reported, before, after) == (640, "usage")


def test_conversations_are_deterministic_and_differ_in_the_first_block_only_by_seed():
    a, b = _Conversation("s1", "filler-0", 300), _Conversation("s2", "filler-0", 300)
    assert a.messages == _Conversation("s1", "filler-0", 300).messages
    assert a.messages[0] != b.messages[0] and a.messages[0]["content"].startswith("Conversation s1.")
    assert a.messages[1:] == b.messages[1:]  # same filler: a twin measures the same length
    nxt = a.next_turn("reply")
    assert nxt[: len(a.messages)] == a.messages and nxt[-2] == {"role": "assistant", "content": "reply"}


def test_every_length_missing_on_an_align_hybrid_is_ineffective_but_offers_the_trap_fixes():
    r = verdict([point(L, 0) for L in (866, 1035, 1409)])
    assert r.verdict is Verdict.INEFFECTIVE
    assert "possibly the chunk-alignment trap" in r.detail
    assert "--max-num-batched-tokens 640" in r.fixes
