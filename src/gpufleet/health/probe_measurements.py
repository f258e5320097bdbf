"""What the prompt re-processing probe measures: one step of a conversation (turn N, then turn N+1) and one turn of
its session, each with the token counts the server reported (gpufleet.health.probe drives the requests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProbePoint:
    """One step of a conversation: a turn of `prompt_tokens` tokens, then the next turn."""

    prompt_tokens: int  # L, turn N
    next_prompt_tokens: int  # turn N+1
    unit: int
    cached_tokens: int  # on turn N+1
    cold_cached_tokens: int  # on turn N: should be 0 (the seed makes it unique)
    ttft_s: float  # turn N
    next_ttft_s: float  # turn N+1
    source: str  # "usage" (prompt_tokens_details) or "metrics" (deltas of /metrics counters)
    kind: str = "sweep"  # sweep, multi-chunk or session
    chunk_tokens: int | None = None  # --max-num-batched-tokens the lengths were scaled to

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

    @property
    def chunks(self) -> int | None:
        """Prefill chunks turn N needed (at least), when the batching is known."""
        return -(-self.prompt_tokens // self.chunk_tokens) if self.chunk_tokens else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "L": self.prompt_tokens,
            "L_mod_U": self.l_mod_u,
            "chunks": self.chunks,
            "due": self.due_tokens,
            "cached": self.cached_tokens,
            "next_prompt_tokens": self.next_prompt_tokens,
            "reprocessed": self.reprocessed_tokens,
            "hit_ratio": round(self.hit_ratio, 4),
            "ttft_ms": round(self.ttft_s * 1e3, 1),
            "next_ttft_ms": round(self.next_ttft_s * 1e3, 1),
            "source": self.source,
        }


@dataclass(frozen=True)
class SessionTurn:
    """One turn of the session, with every count the server reported for it."""

    turn: int  # 0 = turn N (cold)
    prompt_tokens: int  # usage.prompt_tokens
    cached_tokens: int  # the figure the probe judges by (usage when reported, else the /metrics hits delta)
    due_tokens: int  # from the previous turn's prompt: floor((L-1)/U)*U; 0 for turn N
    usage_cached: int | None  # usage.prompt_tokens_details.cached_tokens
    metrics_hits: int | None  # delta of vllm:prefix_cache_hits_total
    metrics_queries: int | None  # delta of vllm:prefix_cache_queries_total
    metrics_computed: int | None  # delta of vllm:request_prefill_kv_computed_tokens_sum
    ttft_s: float

    @property
    def reprocessed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def reprocessed_share(self) -> float:
        return self.reprocessed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "prompt_tokens": self.prompt_tokens,
            "cached": self.cached_tokens,
            "due": self.due_tokens,
            "reprocessed": self.reprocessed_tokens,
            "reprocessed_share": round(self.reprocessed_share, 4),
            "usage_cached": self.usage_cached,
            "metrics_hits": self.metrics_hits,
            "metrics_queries": self.metrics_queries,
            "metrics_computed": self.metrics_computed,
            "ttft_ms": round(self.ttft_s * 1e3, 1),
        }
