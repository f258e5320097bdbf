"""The KV cache block sizes a vLLM server resolved, and the settings they allow (docs/vllm-traps.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Never recommend a unit coarser than the one measured (docs/vllm-traps.md).
PREFERRED_UNIT = 128


def resolved_block_sizes(cache_config: Mapping[str, str]) -> tuple[int, ...]:
    # Not mamba_block_size: in align mode its label may predate vLLM's alignment.
    sizes = []
    for key in ("block_size", "effective_attention_block_size"):
        value = cache_config.get(key)
        if value and value.isdigit() and int(value) > 0:
            sizes.append(int(value))
    return tuple(sorted(set(sizes)))


def legal_prefix_match_unit(block_sizes: Sequence[int], ceiling: int = PREFERRED_UNIT) -> int | None:
    """The largest unit up to `ceiling` that divides every block size, as vLLM requires."""
    if not block_sizes:
        return None
    common = math.gcd(*block_sizes)
    return max(d for d in range(1, min(common, ceiling) + 1) if common % d == 0)


def legal_max_num_batched_tokens(block_sizes: Sequence[int]) -> int | None:
    """The least token budget (--max-num-batched-tokens) whose chunks end on every KV cache group's block boundary."""
    return math.lcm(*block_sizes) if block_sizes else None


@dataclass(frozen=True)
class LegalFixes:
    block_sizes: tuple[int, ...]
    prefix_match_unit: int | None  # None on a dense model: only the block size is accepted
    max_num_batched_tokens: int | None

    @classmethod
    def from_cache_config(cls, cache_config: Mapping[str, str]) -> LegalFixes:
        blocks = resolved_block_sizes(cache_config)
        hybrid = cache_config.get("mamba_cache_mode") not in (None, "None", "none")
        return cls(blocks, legal_prefix_match_unit(blocks) if hybrid else None, legal_max_num_batched_tokens(blocks))

    def lines(self) -> tuple[str, ...]:
        blocks = "/".join(map(str, self.block_sizes)) or "?"
        out = []
        if self.prefix_match_unit:
            out.append(
                f"--prefix-match-unit {self.prefix_match_unit} (divides the block size {blocks}: hits align to "
                f"{self.prefix_match_unit} tokens instead of whole blocks; measured fix)"
            )
        if self.max_num_batched_tokens:
            out.append(
                f"--max-num-batched-tokens {self.max_num_batched_tokens} (equal to the block size: every prefill "
                "chunk ends on a block boundary; measured fix, but long prompts then prefill in small chunks)"
            )
        return tuple(out)
