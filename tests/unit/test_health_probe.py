"""The probe's verdicts on point figures measured on real vLLM servers (tests/vllm produces them live)."""

from __future__ import annotations

from pathlib import Path

from gpufleet.health.api import Completion
from gpufleet.health.cache_counters import cached_tokens
from gpufleet.health.conversation import Conversation
from gpufleet.health.probe import request_bound
from gpufleet.health.probe_measurements import ProbePoint, SessionTurn
from gpufleet.health.probe_report import Verdict, judge
from gpufleet.wire.geometry import LegalFixes, legal_prefix_match_unit, resolved_block_sizes
from gpufleet.wire.metrics import HITS, PREFILL_COMPUTED, Metrics, parse_metrics

RECORDED = Path(__file__).resolve().parents[1] / "vllm_peer" / "recorded"


def point(L: int, cached: int, unit: int = 640, ttft=0.18, next_ttft=0.02) -> ProbePoint:
    return ProbePoint(L, L + 41, unit, cached, 0, ttft, next_ttft, "usage")


# Hybrid B=640, default --max-num-batched-tokens: measured (L, cached on turn N+1).
TRAP = [(814, 0), (1028, 0), (1306, 1280), (1597, 0), (2004, 1920), (2208, 0)]


def verdict(points, *, mamba="align", prefix_caching=True, mnbt=None, unit=640):
    return judge(
        "h",
        points,
        block_size=640,
        unit=unit,
        prefix_caching=prefix_caching,
        mamba_cache_mode=mamba,
        max_num_batched_tokens=mnbt,
    )


def test_due_tokens_follow_the_unit_and_the_recomputed_last_token():
    assert point(1280, 0).due_tokens == 640  # the last token is always recomputed: 1279 // 640 blocks
    assert point(1281, 0).due_tokens == 1280
    assert point(640, 0).due_tokens == 0  # below U+1 nothing can hit
    assert point(1306, 1280).reprocessed_tokens == 1347 - 1280


def test_all_or_nothing_misses_on_an_align_hybrid_are_the_chunk_alignment_trap():
    r = verdict([point(L, c) for L, c in TRAP])
    assert r.verdict is Verdict.CHUNK_ALIGNMENT_TRAP
    assert "4 of 6" in r.detail and "--max-num-batched-tokens default" in r.detail
    assert any(f.startswith("--max-num-batched-tokens 640 ") for f in r.fixes)
    assert any(f.startswith("--prefix-match-unit 128 ") for f in r.fixes)
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
    assert judge(
        "h",
        pts,
        block_size=640,
        unit=640,
        prefix_caching=True,
        mamba_cache_mode="align",
        max_num_batched_tokens=640,
        small_prompt_ttft_s=0.005,
    ).ttft_is_signal
    assert not judge(
        "h",
        pts,
        block_size=640,
        unit=640,
        prefix_caching=True,
        mamba_cache_mode="align",
        max_num_batched_tokens=640,
        small_prompt_ttft_s=0.05,
    ).ttft_is_signal


def test_metrics_fallback_uses_counter_deltas():
    turn = Completion(0.01, 0.02, "", prompt_tokens=1347, completion_tokens=2, cached_tokens=None)
    before = Metrics({HITS: 100.0, PREFILL_COMPUTED: 5000.0})
    after = Metrics({HITS: 1380.0, PREFILL_COMPUTED: 5067.0})
    assert cached_tokens(turn, before, after) == (1280, "metrics")
    reported = Completion(0.01, 0.02, "", prompt_tokens=1347, completion_tokens=2, cached_tokens=640)
    assert cached_tokens(reported, before, after) == (640, "usage")


def test_conversations_are_deterministic_and_differ_in_the_first_block_only_by_seed():
    a, b = Conversation("s1", "filler-0", 300), Conversation("s2", "filler-0", 300)
    assert a.messages == Conversation("s1", "filler-0", 300).messages
    assert a.messages[0] != b.messages[0] and a.messages[0]["content"].startswith("Conversation s1.")
    assert a.messages[1:] == b.messages[1:]  # same filler: a twin measures the same length
    nxt = a.next_turn("reply")
    assert nxt[: len(a.messages)] == a.messages and nxt[-2] == {"role": "assistant", "content": "reply"}


def test_every_length_missing_on_an_align_hybrid_is_ineffective_but_offers_the_trap_fixes():
    r = verdict([point(L, 0) for L in (866, 1035, 1409)])
    assert r.verdict is Verdict.INEFFECTIVE
    assert "possibly the chunk-alignment trap" in r.detail
    assert any(f.startswith("--max-num-batched-tokens 640 ") for f in r.fixes)


def test_the_legal_unit_divides_every_block_size_and_prefers_the_measured_128():
    assert legal_prefix_match_unit([640]) == 128
    assert legal_prefix_match_unit([1152]) == 128
    # Upstream reports a GPU block of 2096 tokens: 128 does not divide it, vLLM would refuse to start.
    assert legal_prefix_match_unit([2096]) == 16
    assert legal_prefix_match_unit([544]) == 68
    assert legal_prefix_match_unit([640, 1280]) == 128
    assert legal_prefix_match_unit([]) is None
    for blocks in ([2096], [544], [1568, 784], [600]):
        unit = legal_prefix_match_unit(blocks)
        assert all(b % unit == 0 for b in blocks)


def test_block_sizes_come_from_the_recorded_cache_config_info_not_the_stale_mamba_label():
    recorded = parse_metrics((RECORDED / "metrics-hybrid-align.txt").read_text()).cache_config
    assert recorded["mamba_block_size"] == "16"  # vLLM 0.32 shows the value from before alignment
    assert resolved_block_sizes(recorded) == (640,)
    legal = LegalFixes.from_cache_config(recorded)
    assert (legal.prefix_match_unit, legal.max_num_batched_tokens) == (128, 640)
    # A dense model has one KV cache group: vLLM accepts no unit but the block itself, so none is offered.
    assert LegalFixes.from_cache_config({"block_size": "128", "mamba_cache_mode": "None"}).prefix_match_unit is None


def test_trap_fixes_are_legal_for_a_block_128_does_not_divide():
    legal = LegalFixes.from_cache_config({"block_size": "2096", "mamba_cache_mode": "align"})
    points = [point(L, c, unit=2096) for L, c in [(2300, 2096), (3000, 0), (4300, 4192), (5000, 0)]]
    r = judge(
        "h",
        points,
        block_size=2096,
        unit=2096,
        prefix_caching=True,
        mamba_cache_mode="align",
        max_num_batched_tokens=8192,
        legal=legal,
    )
    assert r.verdict is Verdict.CHUNK_ALIGNMENT_TRAP
    assert any(f.startswith("--prefix-match-unit 16 ") for f in r.fixes)
    assert not any("128" in f for f in r.fixes)
    assert any(f.startswith("--max-num-batched-tokens 2096 ") for f in r.fixes)


def test_multi_chunk_points_count_their_chunks_in_the_evidence():
    p = ProbePoint(3081, 3122, 640, 0, 0, 0.2, 0.2, "usage", kind="multi-chunk", chunk_tokens=1024)
    assert p.chunks == 4
    r = judge(
        "h",
        [point(1306, 1280), p],
        block_size=640,
        unit=640,
        prefix_caching=True,
        mamba_cache_mode="align",
        max_num_batched_tokens=1024,
    )
    assert r.verdict is Verdict.CHUNK_ALIGNMENT_TRAP
    assert "multi-chunk L=3081 (L mod U=521, U=640, 4 chunks): cached 0 of 2560 due" in r.evidence


def test_session_turns_report_reprocessed_tokens_and_share():
    turns = (
        SessionTurn(0, 1600, 0, 0, 0, 0, 1600, 1600, 0.3),
        SessionTurn(1, 1913, 1280, 1280, 1280, 1280, 1913, 633, 0.05),
        SessionTurn(2, 2226, 1280, 1280, 1280, 1280, 2226, 946, 0.06),
    )
    assert [t.reprocessed_tokens for t in turns] == [1600, 633, 946]
    assert round(turns[1].reprocessed_share, 3) == 0.331
    r = judge(
        "h",
        [point(1600, 1280)],
        block_size=640,
        unit=640,
        prefix_caching=True,
        mamba_cache_mode="align",
        max_num_batched_tokens=640,
        session=turns,
    )
    assert r.reprocessed_per_turn == (633 + 946) / 2  # the later turns only: turn N is cold by construction
    assert [t["reprocessed"] for t in r.as_dict()["session"]] == [1600, 633, 946]


def test_the_request_count_is_bounded():
    assert request_bound(6, 2, 4) == 2 + 8 * 5 + 7


def test_a_session_turn_falling_back_to_an_older_checkpoint_is_the_trap_too():
    # Measured on the published-shape batching (block 640, --max-num-batched-tokens 1024): turn N+3 of the
    # session got 1280 of 1920 due; a 3-chunk turn got 0 of 1920.
    pts = [point(1314, 1280), point(1568, 1280), point(2555, 0), point(2163, 1280)]
    r = verdict(pts, mnbt=1024)
    assert r.verdict is Verdict.CHUNK_ALIGNMENT_TRAP
    assert "got 0/1280 cached tokens although 1920/1920 were due" in r.detail
    # Losses that are not whole units are not the trap's pattern.
    assert verdict([point(1314, 1280), point(2163, 1000)], mnbt=1024).verdict is Verdict.INEFFECTIVE
