"""The cache geometry a vLLM server resolved, and the settings it accepts because of it: pure arithmetic over its
vllm:cache_config_info labels (block sizes), read by the lint, the probe and the deploy's checks."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The unit measured to remove the trap on a 640-token block; never recommend a coarser one.
PREFERRED_UNIT = 128


def resolved_block_sizes(cache_config: Mapping[str, str]) -> tuple[int, ...]:
    """The KV cache block sizes a server resolved at start, from its vllm:cache_config_info labels.

    block_size is the attention block after vLLM enlarged it for the model's state size; effective_attention_block
    _size is the same including context parallelism. mamba_block_size is not read: in align mode vLLM gives the
    state groups the attention block (platforms/interface.py, Platform._align_hybrid_block_size), and the label
    can still show the value from before that (16 on vLLM 0.32).
    """
    sizes = []
    for key in ("block_size", "effective_attention_block_size"):
        value = cache_config.get(key)
        if value and value.isdigit() and int(value) > 0:
            sizes.append(int(value))
    return tuple(sorted(set(sizes)))


def legal_prefix_match_unit(block_sizes: Sequence[int], ceiling: int = PREFERRED_UNIT) -> int | None:
    """The largest unit not above `ceiling` that divides every block size (vLLM refuses any other:
    v1/core/kv_cache_utils.py, resolve_kv_cache_block_sizes). None when no block size is known.

    >>> legal_prefix_match_unit([640]), legal_prefix_match_unit([2096]), legal_prefix_match_unit([544])
    (128, 16, 68)
    """
    if not block_sizes:
        return None
    common = math.gcd(*block_sizes)
    return max(d for d in range(1, min(common, ceiling) + 1) if common % d == 0)


def legal_max_num_batched_tokens(block_sizes: Sequence[int]) -> int | None:
    """A --max-num-batched-tokens whose chunks end on every group's block boundary: their least common multiple."""
    return math.lcm(*block_sizes) if block_sizes else None


@dataclass(frozen=True)
class LegalFixes:
    """Settings that vLLM accepts on this server, computed from the block sizes it resolved."""

    block_sizes: tuple[int, ...]
    prefix_match_unit: int | None  # None: a single KV cache group (dense), where only the block size is accepted
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
