"""/metrics of vLLM and vllm-router, parsed with prometheus_client."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from gpufleet.wire.evidence import excerpt

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
PREFILL_COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"
KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG = "vllm:cache_config_info"

Sample = tuple[str, dict[str, str], float]


@dataclass(frozen=True)
class Metrics:
    """Values summed over label sets (one per engine), and the cache config labels."""

    values: dict[str, float] = field(default_factory=dict)
    cache_config: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> float | None:
        """The summed value; None when absent or not finite."""
        value = self.values.get(name)
        return value if value is not None and math.isfinite(value) else None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Token hit rate since the server started; None before any query."""
        hits, queries = self.get(HITS), self.get(QUERIES)
        return hits / queries if hits is not None and queries else None

    @property
    def block_size(self) -> int | None:
        return _int_label(self.cache_config.get("block_size"))

    @property
    def prefix_match_unit(self) -> int | None:
        return _int_label(self.cache_config.get("prefix_match_unit"))


def samples(text: str) -> list[Sample]:
    """Every sample as (name, labels, value), in order; ValueError quoting the parser's complaint."""
    try:
        return [
            (s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples
        ]
    except ValueError as e:
        raise ValueError(f"is not Prometheus text: {excerpt(str(e) or 'unparsable', 100)}") from e


def parse_metrics(text: str) -> Metrics:
    values: dict[str, float] = {}
    cache_config: dict[str, str] = {}
    for name, labels, value in samples(text):
        values[name] = values.get(name, 0.0) + value
        if name == CACHE_CONFIG and not cache_config:
            # An info metric holds its config in its labels, the same on every engine.
            cache_config = {k: v for k, v in labels.items() if k != "engine"}
    return Metrics(values, cache_config)


def _int_label(value: str | None) -> int | None:
    # vLLM renders unset fields as the string "None".
    try:
        return int(value) if value not in (None, "None", "") else None
    except ValueError:
        return None
