"""The canary's serving checks (gpufleet.health.serving) against real vLLM: the tiny hybrid (Qwen-3.5 style, align
mode) with seeded random weights, served as the qwen35 profile serves it (qwen3 reasoning parser, auto tool choice
with the qwen3_coder parser), and the same model started without the parsers (the faults made real).

What the engine does between its cached and cold paths on this machine is measured here, not assumed: the largest
logprob gap seen over 20 runs is printed and must stay within the checks' tolerance."""

from __future__ import annotations

import pytest

from gpufleet.health.serving import Served, _Checks, run_checks
from gpufleet.health.serving_rules import TOLERANCE_NATS
from tests.vllm.servers import ALIGN, ALIGN_FLAGS, ServerSpec, Started, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
RUNS = 20
PARSERS = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
AS_THE_PROFILE = Served(prefix_caching=True, tool_parser=True, reasoning_parser=True)
NEW_CHECKS = ("cached-cold", "sessions", "tools", "reasoning")


@pytest.fixture(scope="module")
def servers(pair_factory, venv, tmp_path_factory) -> dict[str, Started]:
    model = models.with_random_weights(models.build_hybrid(tmp_path_factory.mktemp("models") / "hybrid"), venv)
    weights = ["--load-format", "safetensors"]  # after base_args' dummy: the last one wins
    good, bare = pair_factory([
        ServerSpec("good", model, [*ALIGN_FLAGS, *weights, *PARSERS], expected(**ALIGN)),
        ServerSpec("bare", model, [*ALIGN_FLAGS, *weights], expected(**ALIGN)),
    ])  # fmt: skip
    return {"good": good, "bare": bare}


def test_every_check_passes_on_a_good_server_20_times_out_of_20(servers):
    s = servers["good"]
    failures = []
    for run in range(RUNS):
        results = run_checks(s.transport, s.expected, AS_THE_PROFILE, NEW_CHECKS)
        assert [r.name for r in results] == list(NEW_CHECKS)
        failures += [f"run {run}: {r.line()}" for r in results if not r.ok]
        if run == 0:
            print("\n" + "\n".join(r.line() for r in results))
    assert failures == [], failures


def test_cached_and_cold_paths_stay_within_the_tolerance_and_the_prompts_answers_differ(servers):
    """The bound the checks compare within, measured: one cold and one cached answer per run, fresh prefixes."""
    s = servers["good"]
    gaps, answers = [], set()
    for run in range(RUNS):
        checks = _Checks(s.transport, s.expected, None, TOLERANCE_NATS, 120.0, f"bound{run}")
        conversation, cold = checks._cold("a")
        cached = checks._until_hit(conversation)
        assert cached.cached_tokens and cached.tokens == cold.tokens, (cold.tokens, cached.tokens)
        gaps.append(max(abs(a - b) for a, b in zip(cold.logprobs, cached.logprobs, strict=True)))
        answers.add(cold.tokens)
    print(f"\n[serving] cached vs cold, {RUNS} prompts: largest logprob gap {max(gaps):.6f} nats "
          f"(tolerance {TOLERANCE_NATS}); {len(answers)} distinct greedy answers")
    assert max(gaps) <= TOLERANCE_NATS
    # The weights make answers depend on the prompt: a check comparing them can tell sessions apart.
    assert len(answers) > 1


def test_a_server_started_without_the_parsers_fails_the_tool_and_reasoning_checks(servers):
    s = servers["bare"]
    results = {r.name: r for r in run_checks(s.transport, s.expected, AS_THE_PROFILE, NEW_CHECKS)}
    assert results["cached-cold"].ok and results["sessions"].ok, results
    # vLLM 0.32 refuses even a forced tool call without a tool parser (400), before "auto" is tried.
    assert not results["tools"].ok, results["tools"]
    assert results["tools"].detail.startswith('tool_choice "required": POST /v1/chat/completions answered 400')
    assert "requires --tool-call-parser" in results["tools"].detail
    assert not results["reasoning"].ok and "no reasoning field" in results["reasoning"].detail, results["reasoning"]
