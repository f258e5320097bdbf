"""The prompt re-processing probe's verdict, judged from the measured steps alone, with the fixes this server
would accept (docs/verify.md)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import Any

from gpufleet.health.probe_measurements import ProbePoint, SessionTurn
from gpufleet.wire.geometry import LegalFixes, legal_prefix_match_unit


class Verdict(StrEnum):
    EFFECTIVE = "effective"
    INEFFECTIVE = "ineffective"
    CHUNK_ALIGNMENT_TRAP = "chunk-alignment-trap"


@dataclass(frozen=True)
class ProbeReport:
    host: str
    verdict: Verdict
    detail: str  # one line
    block_size: int
    unit: int  # what hits align to
    prefix_caching: bool
    mamba_cache_mode: str | None
    max_num_batched_tokens: int | None  # as configured, when known
    points: tuple[ProbePoint, ...] = ()
    fixes: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    small_prompt_ttft_s: float | None = None
    session: tuple[SessionTurn, ...] = ()
    legal: LegalFixes | None = None  # the fixes this server accepts, whatever the verdict
    requests: int = 0
    request_bound: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.EFFECTIVE

    @property
    def hit_ratio(self) -> float:
        return statistics.median(p.hit_ratio for p in self.points) if self.points else 0.0

    @property
    def reprocessed_per_turn(self) -> float:
        """Median over the session's later turns, else over the points."""
        later = [t.reprocessed_tokens for t in self.session[1:]]
        if later:
            return statistics.median(later)
        return statistics.median(p.reprocessed_tokens for p in self.points) if self.points else 0.0

    @property
    def ttft_ratio(self) -> float:
        return statistics.median(p.ttft_ratio for p in self.points) if self.points else float("nan")

    @property
    def ttft_is_signal(self) -> bool:
        """Whether a cold prefill is slow enough for TTFT to tell hits from misses."""
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
            "legal": None
            if self.legal is None
            else {
                "block_sizes": list(self.legal.block_sizes),
                "prefix_match_unit": self.legal.prefix_match_unit,
                "max_num_batched_tokens": self.legal.max_num_batched_tokens,
            },
            "evidence": list(self.evidence),
            "warnings": list(self.warnings),
            "requests": self.requests,
            "request_bound": self.request_bound,
            "elapsed_s": round(self.elapsed_s, 1),
            "points": [p.as_dict() for p in self.points],
            "session": [t.as_dict() for t in self.session],
        }


def judge(
    host: str,
    points: Sequence[ProbePoint],
    *,
    block_size: int,
    unit: int,
    prefix_caching: bool,
    mamba_cache_mode: str | None,
    max_num_batched_tokens: int | None,
    warnings: tuple[str, ...] = (),
    small_prompt_ttft_s: float | None = None,
    session: tuple[SessionTurn, ...] = (),
    legal: LegalFixes | None = None,
    requests: int = 0,
    request_bound: int = 0,
    elapsed_s: float = 0.0,
) -> ProbeReport:
    """The verdict from the measured points. Without `legal`, the fixes are derived from block_size alone."""
    if legal is None:
        blocks = (block_size,)
        legal = LegalFixes(blocks, legal_prefix_match_unit(blocks) if mamba_cache_mode else None, block_size)
    hits = [p for p in points if p.hit]
    misses = [p for p in points if not p.hit]
    report = partial(
        ProbeReport,
        host=host,
        block_size=block_size,
        unit=unit,
        prefix_caching=prefix_caching,
        mamba_cache_mode=mamba_cache_mode,
        max_num_batched_tokens=max_num_batched_tokens,
        points=tuple(points),
        warnings=warnings,
        small_prompt_ttft_s=small_prompt_ttft_s,
        session=session,
        legal=legal,
        requests=requests,
        request_bound=request_bound,
        elapsed_s=elapsed_s,
    )
    evidence = tuple(_evidence(p, unit) for p in points)
    if not points:
        return report(verdict=Verdict.INEFFECTIVE, detail="no point could be measured")
    if not misses:
        detail = f"the next turn reused the cache at all {len(points)} measured steps (unit {unit} tokens)"
        return report(verdict=Verdict.EFFECTIVE, detail=detail, evidence=evidence)
    mnbt = max_num_batched_tokens
    # The trap loses whole units: the checkpoint at the last boundary is missing.
    whole_units_lost = all(p.cached_tokens % unit == 0 for p in misses)
    trap_possible = mamba_cache_mode == "align" and prefix_caching and unit == block_size and mnbt != block_size
    if hits and whole_units_lost and trap_possible:
        got = "/".join(str(p.cached_tokens) for p in misses)
        detail = (
            f"chunk-alignment trap: {len(misses)} of {len(points)} next turns got {got} cached tokens although "
            f"{'/'.join(str(p.due_tokens) for p in misses)} were due (hybrid, mamba_cache_mode=align, block "
            f"{block_size}, --max-num-batched-tokens {mnbt if mnbt else 'default'})"
        )
        return report(verdict=Verdict.CHUNK_ALIGNMENT_TRAP, detail=detail, fixes=legal.lines(), evidence=evidence)
    why = "prefix caching is disabled on the server" if not prefix_caching else "due hits did not happen"
    fixes: tuple[str, ...] = ()
    if trap_possible and not hits:
        # The trap can miss at every length too.
        why += " (a hybrid in align mode: possibly the chunk-alignment trap at every measured length)"
        fixes = legal.lines()
    detail = f"{len(misses)} of {len(points)} next turns re-processed cached history: {why}"
    return report(verdict=Verdict.INEFFECTIVE, detail=detail, evidence=evidence, fixes=fixes)


def _evidence(p: ProbePoint, unit: int) -> str:
    chunks = f", {p.chunks} chunks" if p.kind == "multi-chunk" and p.chunks else ""
    where = "" if p.kind == "sweep" else f"{p.kind} "
    return f"{where}L={p.prompt_tokens} (L mod U={p.l_mod_u}, U={unit}{chunks}): cached {p.cached_tokens} of {p.due_tokens} due"
