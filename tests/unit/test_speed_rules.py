"""The speed check's rules (gpufleet.wire.speed): how a new version's figures are held to the old one's on the same
host, how figures are written and read back, and the line each verdict gives."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from gpufleet.wire.speed import SpeedFigures, comparable, compare, speed_ratios, verdict

OLD = SpeedFigures(
    prefill_tokens_per_s=(30000.0, 31000.0, 29000.0),
    cached_ttft_s=(0.050, 0.052, 0.048),
    decode_tokens_per_s=(200.0, 202.0, 198.0),
    batch_tokens_per_s=(380.0, 384.0, 376.0),
    prompt_tokens=20480,
    decode_tokens=64,
    concurrency=2,
)


def test_ratios_are_speeds_new_over_old_with_times_inverted():
    new = replace(OLD, prefill_tokens_per_s=(15000.0,), cached_ttft_s=(0.1,))
    ratios = speed_ratios(OLD, new)
    assert ratios["prefill_tokens_per_s"] == pytest.approx(0.5) and ratios["cached_ttft_s"] == pytest.approx(0.5)
    assert ratios["decode_tokens_per_s"] == ratios["batch_tokens_per_s"] == 1.0


def test_a_figure_slower_beyond_the_tolerance_is_named_with_both_medians_worst_first():
    new = replace(OLD, prefill_tokens_per_s=(1500.0, 1520.0, 1480.0), cached_ttft_s=(0.45, 0.46, 0.44))
    assert compare(OLD, new, 0.35) == (
        "prefill 1500 tokens/s, was 30000 (0.05x the speed); cached TTFT 0.450 s, "
        "was 0.050 (0.11x the speed): every repeat more than 35% slower"
    )
    ok, line = verdict(OLD, new, 0.35)
    assert not ok and line == compare(OLD, new, 0.35)


def test_a_figure_within_the_tolerance_passes_and_the_line_gives_each_ratio():
    new = replace(OLD, decode_tokens_per_s=(140.0, 141.0, 139.0))  # 0.70x: within 35%
    assert compare(OLD, new, 0.35) is None
    ok, line = verdict(OLD, new, 0.35)
    assert ok and line == (
        "prefill 30000 tokens/s (1.00x), cached TTFT 0.050 s (1.00x), decode 140 tokens/s "
        "(0.70x), batch 380 tokens/s (1.00x): within 35% of the earlier figures"
    )
    assert compare(OLD, new, 0.25) is not None  # the same loss past a tighter tolerance


def test_a_median_beyond_the_tolerance_with_a_repeat_within_it_is_load_not_a_regression():
    # Load on the machine slows some repeats of a good version; a slower build slows every one.
    noisy = replace(OLD, cached_ttft_s=(0.030, 0.090, 0.250))  # median 0.09 (0.56x), one repeat as fast as before
    assert compare(OLD, noisy, 0.35) is None
    assert "cached TTFT 0.090 s (0.56x, a repeat within 35%)" in verdict(OLD, noisy, 0.35)[1]
    steady = replace(OLD, cached_ttft_s=(0.080, 0.090, 0.250))  # the same median, every repeat over 35% slower
    assert compare(OLD, steady, 0.35) == (
        "cached TTFT 0.090 s, was 0.050 (0.56x the speed): every repeat more than 35% slower"
    )


def test_a_slow_old_repeat_does_not_hide_a_slower_build():
    # The new repeats are held to the old median: one stalled old repeat widens no margin.
    stalled = replace(OLD, cached_ttft_s=(0.048, 0.050, 0.900))
    assert compare(stalled, replace(OLD, cached_ttft_s=(0.45, 0.46, 0.44)), 0.35) is not None


def test_without_earlier_figures_the_new_ones_pass_and_the_line_says_so():
    ok, line = verdict(None, OLD, 0.35)
    assert ok and line == (
        "no earlier figures on this host to compare: prefill 30000 tokens/s, cached TTFT 0.050 s, "
        "decode 200 tokens/s, batch 380 tokens/s; 20480-token prompt, 64 tokens each, 2 at once"
    )


def test_figures_of_another_workload_are_not_compared():
    other = replace(OLD, prompt_tokens=10240, prefill_tokens_per_s=(1000.0,))
    assert comparable(OLD, other) == "the workload changed: a 10240-token prompt, was 20480"
    assert compare(OLD, other, 0.35) is None
    ok, line = verdict(OLD, other, 0.35)
    assert ok and line.startswith("the workload changed: a 10240-token prompt, was 20480: prefill 1000 ")
    assert comparable(OLD, replace(OLD, concurrency=4)) == ("the workload changed: 64 tokens x 4 at once, was 64 x 2")
    assert comparable(OLD, replace(OLD, prompt_tokens=20500)) is None  # a seed's own few tokens


def test_figures_read_back_as_written_and_refuse_what_gpufleet_never_writes():
    assert SpeedFigures.from_dict(OLD.as_dict()) == OLD
    doc = OLD.as_dict()
    for bad, reason in (
        ([], "speed figures must be an object, not list"),
        ({k: v for k, v in doc.items() if k != "concurrency"}, "speed figures need exactly prefill_tokens_per_s, "),
        ({**doc, "concurrency": True}, "concurrency is True, not a positive integer"),
        ({**doc, "decode_tokens": 6.5}, "decode_tokens is 6.5, not a positive integer"),
        ({**doc, "prefill_tokens_per_s": []}, "prefill_tokens_per_s is [], not a list of positive numbers"),
        ({**doc, "cached_ttft_s": [0.1, float("nan")]}, "cached_ttft_s is [0.1, nan], not a list of positive"),
        ({**doc, "batch_tokens_per_s": 380.0}, "batch_tokens_per_s is 380.0, not a list of positive numbers"),
    ):
        with pytest.raises(ValueError, match=re.escape(reason)):
            SpeedFigures.from_dict(bad)
