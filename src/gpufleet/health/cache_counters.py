"""How many prompt tokens a request took from the cache."""

from __future__ import annotations

from gpufleet.health.api import Completion, get
from gpufleet.remote.transport import Transport
from gpufleet.wire.metrics import HITS, PREFILL_COMPUTED, QUERIES, RUNNING, WAITING, Metrics, parse_metrics


def warn_if_busy(before: Metrics, warnings: list[str]) -> None:
    """Deltas are one request's only when nothing else runs or waits."""
    if (before.get(RUNNING) or 0) + (before.get(WAITING) or 0) > 0:
        warnings.append("other requests were in flight: /metrics deltas are not attributable")


def read_metrics(transport: Transport, port: int, address: str) -> Metrics:
    status, body = get(transport, port, "/metrics", address=address)
    if status != 200:
        raise ValueError(f"{transport.name}: /metrics answered {status}")
    return parse_metrics(body)


def counter_delta(before: Metrics, after: Metrics, name: str) -> int | None:
    """None when the server does not export the counter."""
    if after.get(name) is None:
        return None
    return int((after.get(name) or 0) - (before.get(name) or 0))


def attributed_hits(before: Metrics, after: Metrics, prompt_tokens: int) -> int | None:
    """The hits delta when only our prompts looked the cache up."""
    queries, hits = counter_delta(before, after, QUERIES), counter_delta(before, after, HITS)
    if queries is None or hits is None or queries != prompt_tokens:
        return None
    return hits


def cached_tokens(turn: Completion, before: Metrics, after: Metrics) -> tuple[int, str]:
    """Cached tokens of a turn and where the figure came from."""
    if turn.cached_tokens is not None:
        return turn.cached_tokens, "usage"
    hits = (after.get(HITS) or 0) - (before.get(HITS) or 0)
    computed = (after.get(PREFILL_COMPUTED) or 0) - (before.get(PREFILL_COMPUTED) or 0)
    if not hits and computed and turn.prompt_tokens:
        # Without prefix caching the hit counters stay put.
        hits = max(turn.prompt_tokens - computed, 0)
    return int(hits), "metrics"
