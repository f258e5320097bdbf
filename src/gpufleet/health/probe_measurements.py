"""What the prompt re-processing probe measures: a step from turn N to N+1, and a turn of its session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProbePoint:
    """Turn N of `prompt_tokens` tokens, then the next turn."""

    prompt_tokens: int  # L
    next_prompt_tokens: int
    unit: int
    cached_tokens: int  # on turn N+1
    cold_cached_tokens: int  # on turn N, 0 when cold
    ttft_s: float
    next_ttft_s: float
    source: str  # "usage" or "metrics"
    kind: str = "sweep"  # sweep, multi-chunk or session
    chunk_tokens: int | None = None  # --max-num-batched-tokens

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
        """The least prefill chunks turn N needed, when the batching is known."""
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
    """One turn of the session, with every count the server reported."""

    turn: int  # 0 is turn N
    prompt_tokens: int
    cached_tokens: int  # the figure the probe judges by
    due_tokens: int
    usage_cached: int | None
    metrics_hits: int | None  # /metrics deltas
    metrics_queries: int | None
    metrics_computed: int | None
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
