"""Prompt re-processing probe: does turn N+1 of a conversation reuse the cache that turn N left behind?

Measured by token counts, not by time: the engine can only reuse whole cache units (the block size, or
--prefix-match-unit when set) and always recomputes the last prompt token, so after a turn N of L prompt tokens
the next turn is due at least floor((L-1)/U)*U cached tokens. Each point of the sweep is a fresh conversation
(a seed in its system prompt makes it differ inside the first block, so turn N is cold):

    warm up -> turn N (L tokens, streamed) -> turn N+1 (same messages + the reply + a new question)

Several lengths are swept because of the chunk-alignment trap (hybrid models, --mamba-cache-mode align): whether
a due hit happens depends on how turn N's prompt was split into prefill chunks, so one length can hit by luck
while others silently re-process everything. Measured fixes: --max-num-batched-tokens equal to the block size, or
--prefix-match-unit 128 (see docs/verify.md).
"""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpufleet.health.api import Completion, get, stream_chat
from gpufleet.health.check import Expected
from gpufleet.health.metrics import HITS, PREFILL_COMPUTED, RUNNING, WAITING, Metrics, parse_metrics
from gpufleet.health.transport import Transport

# Conversation lengths, in cache units: fractional parts spread L mod U over the unit so the trap shows up.
# Measured on a hybrid (B=640, default batching): only lengths just past a block boundary hit, so two points sit
# there (a probe whose every point misses cannot tell the trap from a broken cache).
DEFAULT_LENGTHS_IN_UNITS = (1.05, 1.3, 1.6, 2.05, 2.45, 2.85)
REPLY_TOKENS = 16
MAX_TWINS = 3  # length measurements per point before turn N (bounds the request count)
TOLERANCE_TOKENS = 4
_WORDS = (
    "the server keeps a cache of every block it has seen so a long conversation should not be processed again "
    "when the next question arrives and the operator wants to know that this really happens on each host"
).split()


class Verdict(StrEnum):
    EFFECTIVE = "effective"
    INEFFECTIVE = "ineffective"
    CHUNK_ALIGNMENT_TRAP = "chunk-alignment-trap"


@dataclass(frozen=True)
class ProbePoint:
    """One conversation: turn N of `prompt_tokens` tokens, then turn N+1."""

    prompt_tokens: int  # L, turn N
    next_prompt_tokens: int  # turn N+1
    unit: int
    cached_tokens: int  # on turn N+1
    cold_cached_tokens: int  # on turn N: should be 0 (the seed makes it unique)
    ttft_s: float  # turn N
    next_ttft_s: float  # turn N+1
    source: str  # "usage" (prompt_tokens_details) or "metrics" (deltas of /metrics counters)

    @property
    def due_tokens(self) -> int:
        return (self.prompt_tokens - 1) // self.unit * self.unit

    @property
    def hit(self) -> bool:
        return self.due_tokens > 0 and self.cached_tokens >= self.due_tokens

    @property
    def reprocessed_tokens(self) -> int:
        return self.next_prompt_tokens - self.cached_tokens

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.next_prompt_tokens if self.next_prompt_tokens else 0.0

    @property
    def ttft_ratio(self) -> float:
        return self.next_ttft_s / self.ttft_s if self.ttft_s else float("nan")

    @property
    def l_mod_u(self) -> int:
        return self.prompt_tokens % self.unit


@dataclass(frozen=True)
class ProbeReport:
    host: str
    verdict: Verdict
    detail: str  # one line
    block_size: int
    unit: int  # what hits are aligned to: prefix_match_unit when set, else block_size
    prefix_caching: bool
    mamba_cache_mode: str | None
    max_num_batched_tokens: int | None  # as configured for the host, when known
    points: tuple[ProbePoint, ...] = ()
    fixes: tuple[str, ...] = ()  # set for the chunk-alignment trap
    evidence: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    small_prompt_ttft_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.EFFECTIVE

    @property
    def hit_ratio(self) -> float:
        return statistics.median(p.hit_ratio for p in self.points) if self.points else 0.0

    @property
    def reprocessed_per_turn(self) -> float:
        return statistics.median(p.reprocessed_tokens for p in self.points) if self.points else 0.0

    @property
    def ttft_ratio(self) -> float:
        return statistics.median(p.ttft_ratio for p in self.points) if self.points else float("nan")

    @property
    def ttft_is_signal(self) -> bool:
        """TTFT tells hits from misses only when a cold prefill clearly dominates a tiny prompt's TTFT."""
        if not self.points or not self.small_prompt_ttft_s:
            return False
        return min(p.ttft_s for p in self.points) >= 10 * self.small_prompt_ttft_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "verdict": str(self.verdict),
            "detail": self.detail,
            "block_size": self.block_size,
            "unit": self.unit,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "hit_ratio": self.hit_ratio,
            "reprocessed_per_turn": self.reprocessed_per_turn,
            "ttft_ratio": self.ttft_ratio,
            "ttft_is_signal": self.ttft_is_signal,
            "fixes": list(self.fixes),
            "evidence": list(self.evidence),
            "warnings": list(self.warnings),
            "points": [
                {
                    "L": p.prompt_tokens,
                    "L_mod_U": p.l_mod_u,
                    "due": p.due_tokens,
                    "cached": p.cached_tokens,
                    "next_prompt_tokens": p.next_prompt_tokens,
                    "ttft_ms": round(p.ttft_s * 1e3, 1),
                    "next_ttft_ms": round(p.next_ttft_s * 1e3, 1),
                    "source": p.source,
                }
                for p in self.points
            ],
        }


@dataclass
class _Conversation:
    """A deterministic synthetic conversation: (seed, filler, words) -> the same messages every time.

    The seed opens the system prompt, so conversations with different seeds differ inside their first cache
    block and share nothing cacheable; the filler (the history's text) depends only on `filler`, so a twin with
    another seed has the same length to within the seed's own tokens.
    """

    seed: str
    filler: str
    words: int
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.filler)
        turns, left = [], self.words
        for i in range(3):
            n = left // (3 - i)
            left -= n
            turns.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
        self.messages = [
            {"role": "system", "content": f"Conversation {self.seed}. You are a terse assistant."},
            {"role": "user", "content": turns[0]},
            {"role": "assistant", "content": turns[1]},
            {"role": "user", "content": turns[2] + " What follows?"},
        ]

    def next_turn(self, reply: str) -> list[dict[str, str]]:
        return [*self.messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]


def probe(
    transport: Transport,
    expected: Expected,
    max_num_batched_tokens: int | None = None,
    lengths_in_units: Sequence[float] = DEFAULT_LENGTHS_IN_UNITS,
    api_key: str | None = None,
    run_id: str | None = None,
    timeout_s: float = 120.0,
) -> ProbeReport:
    """Sweep conversation lengths on one host and judge its prefix cache.

    Requests: 2 calibration + per length 1-3 length measurements, turn N and turn N+1 (at most 32 by default).

    max_num_batched_tokens: the host's configured value (vLLM does not expose it), used as evidence only.
    run_id: distinguishes this run's conversations from earlier probes on the same server (default: random).
    """
    port, model = expected.port, expected.served_model_name
    metrics = _metrics(transport, port)
    block = metrics.block_size or 0
    if not block:
        raise ValueError(f"{transport.name}: vllm:cache_config_info has no block_size")
    unit = metrics.prefix_match_unit or block
    prefix_caching = metrics.cache_config.get("enable_prefix_caching") == "True"
    mamba = metrics.cache_config.get("mamba_cache_mode")
    hybrid = mamba not in (None, "None", "none")
    run_id = run_id or os.urandom(4).hex()

    def chat(messages: list[dict[str, str]], max_tokens: int) -> Completion:
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        return stream_chat(transport, port, body, api_key=api_key, timeout=timeout_s)

    # Two calibration requests: they warm the server up (the first request after a start is ~4x slower) and
    # give tokens per filler word, so lengths can be crafted without a tokenizer.
    # The long one goes first, so the short one's TTFT is a warm server's baseline for a tiny prompt.
    w1, w2 = 20, 200
    c2 = chat(_Conversation(f"{run_id}-c2", "calibration", w2).messages, 1)
    c1 = chat(_Conversation(f"{run_id}-c1", "calibration", w1).messages, 1)
    if not (c1.prompt_tokens and c2.prompt_tokens):
        raise ValueError(f"{transport.name}: the server reports no usage.prompt_tokens in streamed responses")
    per_word = max((c2.prompt_tokens - c1.prompt_tokens) / (w2 - w1), 0.1)

    limit = (expected.max_model_len or 1 << 30) - 2 * REPLY_TOKENS - 64
    points, warnings = [], []
    for i, units in enumerate(lengths_in_units):
        target = min(int(units * unit), limit)
        if target <= unit:
            warnings.append(f"skipped {units} units: max_model_len leaves no room for a point that can hit")
            continue
        words = max(1, round(w2 + (target - c2.prompt_tokens) / per_word))
        # Re-measure on twins (another seed: nothing of theirs is reusable by the real turn N) until the
        # length lands within a few tokens of the target, so the sweep really covers the L mod U it aims at.
        for attempt in range(MAX_TWINS):
            twin = chat(_Conversation(f"{run_id}-{i}t{attempt}", f"filler-{i}", words).messages, 1)
            miss = target - (twin.prompt_tokens or target)
            if abs(miss) <= TOLERANCE_TOKENS:
                break
            words = max(1, words + round(miss / per_word))
        conv = _Conversation(f"{run_id}-{i}r", f"filler-{i}", words)
        turn_n = chat(conv.messages, REPLY_TOKENS)
        before = _metrics(transport, port)
        if (before.get(RUNNING) or 0) + (before.get(WAITING) or 0) > 0:
            warnings.append("other requests were in flight: /metrics deltas are not attributable")
        turn_next = chat(conv.next_turn(turn_n.text), 2)
        after = _metrics(transport, port)
        cached, source = _cached(turn_next, before, after)
        if (turn_n.cached_tokens or 0) > 0:
            warnings.append(f"turn N of point {i} was not cold ({turn_n.cached_tokens} cached)")
        points.append(
            ProbePoint(
                prompt_tokens=turn_n.prompt_tokens or 0,
                next_prompt_tokens=turn_next.prompt_tokens or 0,
                unit=unit,
                cached_tokens=cached,
                cold_cached_tokens=turn_n.cached_tokens or 0,
                ttft_s=turn_n.ttft_s,
                next_ttft_s=turn_next.ttft_s,
                source=source,
            )
        )
    return judge(
        host=transport.name,
        points=points,
        block_size=block,
        unit=unit,
        prefix_caching=prefix_caching,
        mamba_cache_mode=mamba if hybrid else None,
        max_num_batched_tokens=max_num_batched_tokens,
        warnings=tuple(dict.fromkeys(warnings)),
        small_prompt_ttft_s=c1.ttft_s,
    )


def _metrics(transport: Transport, port: int) -> Metrics:
    status, body = get(transport, port, "/metrics")
    if status != 200:
        raise ValueError(f"{transport.name}: /metrics answered {status}")
    return parse_metrics(body)


def _cached(turn: Completion, before: Metrics, after: Metrics) -> tuple[int, str]:
    """Cached tokens of a turn: the server's own usage figure, else /metrics counter deltas."""
    if turn.cached_tokens is not None:
        return turn.cached_tokens, "usage"
    hits = (after.get(HITS) or 0) - (before.get(HITS) or 0)
    computed = (after.get(PREFILL_COMPUTED) or 0) - (before.get(PREFILL_COMPUTED) or 0)
    if not hits and computed and turn.prompt_tokens:
        # Without prefix caching the hit counters stay put; prompt - computed is then the truth (0).
        hits = max(turn.prompt_tokens - computed, 0)
    return int(hits), "metrics"


def judge(
    host: str,
    points: Sequence[ProbePoint],
    block_size: int,
    unit: int,
    prefix_caching: bool,
    mamba_cache_mode: str | None,
    max_num_batched_tokens: int | None,
    warnings: tuple[str, ...] = (),
    small_prompt_ttft_s: float | None = None,
) -> ProbeReport:
    """The verdict from the measured points (pure: unit-testable on recorded figures)."""
    hits = [p for p in points if p.hit]
    misses = [p for p in points if not p.hit]
    common = dict(
        host=host,
        block_size=block_size,
        unit=unit,
        prefix_caching=prefix_caching,
        mamba_cache_mode=mamba_cache_mode,
        max_num_batched_tokens=max_num_batched_tokens,
        points=tuple(points),
        warnings=warnings,
        small_prompt_ttft_s=small_prompt_ttft_s,
    )
    evidence = tuple(
        f"L={p.prompt_tokens} (L mod U={p.l_mod_u}, U={unit}): cached {p.cached_tokens} of {p.due_tokens} due" for p in points
    )
    if not points:
        return ProbeReport(verdict=Verdict.INEFFECTIVE, detail="no point could be measured", **common)
    if not misses:
        detail = f"turn N+1 reused the cache at all {len(points)} lengths (unit {unit} tokens)"
        return ProbeReport(verdict=Verdict.EFFECTIVE, detail=detail, evidence=evidence, **common)
    mnbt = max_num_batched_tokens
    all_or_nothing = all(p.cached_tokens == 0 for p in misses)
    trap_possible = mamba_cache_mode == "align" and prefix_caching and unit == block_size and mnbt != block_size
    if hits and all_or_nothing and trap_possible:
        fixes = (
            f"--max-num-batched-tokens {block_size} (equal to the block size: prefill chunks end on block boundaries)",
            "--prefix-match-unit 128 (hits align to 128 tokens instead of whole blocks)",
        )
        detail = (
            f"chunk-alignment trap: {len(misses)} of {len(points)} turns N+1 got 0 cached tokens although "
            f"{'/'.join(str(p.due_tokens) for p in misses)} were due (hybrid, mamba_cache_mode=align, block "
            f"{block_size}, --max-num-batched-tokens {mnbt if mnbt else 'default'})"
        )
        return ProbeReport(verdict=Verdict.CHUNK_ALIGNMENT_TRAP, detail=detail, fixes=fixes, evidence=evidence, **common)
    why = "prefix caching is disabled on the server" if not prefix_caching else "due hits did not happen"
    fixes: tuple[str, ...] = ()
    if trap_possible and not hits:
        # Every length missing looks like a broken cache, but the trap can do that too: offer its fixes.
        why += " (a hybrid in align mode: possibly the chunk-alignment trap at every swept length)"
        fixes = (f"--max-num-batched-tokens {block_size}", "--prefix-match-unit 128")
    detail = f"{len(misses)} of {len(points)} turns N+1 re-processed cached history: {why}"
    return ProbeReport(verdict=Verdict.INEFFECTIVE, detail=detail, evidence=evidence, fixes=fixes, **common)
