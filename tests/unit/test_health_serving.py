"""The serving checks' rules over what a server answers (gpufleet.health.serving_rules) and how checks are listed
and applied (gpufleet.health.serving, gpufleet.wire.checks): how two greedy answers are compared, what counts as a
parsed tool call or separate reasoning."""

from __future__ import annotations

import json

import pytest

from gpufleet.health.serving import Served
from gpufleet.health.serving_rules import (
    Greedy,
    ServerFault,
    agreement,
    closer_to,
    parse_greedy,
    reasoning_problem,
    text_tool_call_problem,
    tool_call_problem,
)
from gpufleet.hoststate.ledger import Ledger, Pending, Version, parse, render, roll_back
from gpufleet.vllm.settings import SettingErrors, resolve_host
from gpufleet.wire.checks import SERVING_CHECKS, parse_checks, verify_checks


def greedy(tokens: str, logprobs: list[float], alternatives: list[dict[str, float]] | None = None) -> Greedy:
    top = alternatives or [{} for _ in tokens]
    return Greedy(tuple(tokens), tuple(logprobs), tuple({t: lp, **alt} for t, lp, alt in zip(tokens, logprobs, top,
                                                                                               strict=True)),
                  100, 64)


def test_the_same_tokens_with_close_logprobs_agree_and_say_how_close():
    ok, line = agreement(greedy("abc", [-0.1, -0.2, -0.3]), greedy("abc", [-0.12, -0.2, -0.3]), tolerance=0.05)
    assert ok and "the same 3 tokens, logprobs within 0.0200" in line


def test_the_same_tokens_with_logprobs_apart_beyond_the_tolerance_disagree():
    ok, line = agreement(greedy("abc", [-0.1, -0.2, -0.3]), greedy("abc", [-0.1, -1.2, -0.3]), tolerance=0.25)
    assert not ok and "token 1 'b'" in line and "differs by 1.000 > 0.25" in line


def test_a_split_on_a_near_tie_agrees_and_a_confident_split_does_not():
    cold = greedy("ab", [-0.1, -0.50], [{}, {"x": -0.55}])
    tie = greedy("ax", [-0.1, -0.52], [{}, {"b": -0.56}])
    ok, line = agreement(cold, tie, tolerance=0.1)
    assert ok and "near tie at token 1 ('b' cold, 'x' cached" in line
    confident = greedy("ax", [-0.1, -0.05], [{}, {"b": -3.0}])
    ok, line = agreement(cold, confident, tolerance=0.1)
    assert not ok and line.startswith("token 1: 'b' cold, 'x' cached")
    absent = greedy("ax", [-0.1, -0.52])  # the cold token is not even among the cached answer's alternatives
    assert not agreement(cold, absent, tolerance=0.1)[0]


def test_answers_of_different_lengths_disagree():
    assert agreement(greedy("abc", [-0.1] * 3), greedy("ab", [-0.1] * 2))[0] is False


def test_an_answer_nearer_the_other_sessions_cold_answer_is_crossed_state():
    own = greedy("abc", [-1.0, -1.0, -1.0])
    other = greedy("abc", [-1.2, -1.2, -1.2])
    assert not closer_to(greedy("abc", [-1.0, -1.01, -1.0]), other, own)  # its own, within noise
    assert closer_to(greedy("abc", [-1.2, -1.19, -1.2]), other, own)  # the other session's state
    assert not closer_to(greedy("abc", [-1.2, -1.2, -1.2]), own, own)  # identical cold answers: cannot tell
    assert not closer_to(greedy("abc", [-1.0] * 3), greedy("abd", [-1.0] * 3), own)  # other parts earlier


def completion(message: dict, logprobs: object = None, usage: dict | None = None) -> bytes:
    return json.dumps({"choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": "length"}],
                       "usage": usage or {"prompt_tokens": 10, "completion_tokens": 2}}).encode()


def test_parse_greedy_reads_tokens_logprobs_alternatives_and_cached_tokens():
    body = completion({"role": "assistant", "content": None, "reasoning": "ab"},
                      {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5},
                                                                                     {"token": "z", "logprob": -2.0}]},
                                   {"token": "b", "logprob": -0.25, "top_logprobs": []}]},
                      {"prompt_tokens": 1036, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 640}})
    got = parse_greedy(body)
    assert got.tokens == ("a", "b") and got.logprobs == (-0.5, -0.25) and got.top[0] == {"a": -0.5, "z": -2.0}
    assert (got.prompt_tokens, got.cached_tokens, got.text) == (1036, 640, "ab")


@pytest.mark.parametrize("logprobs, wrong", [
    (None, "no logprobs in the answer"),
    ({"content": []}, "no logprobs in the answer"),
    ({"content": [{"token": "a", "logprob": "NaN"}]}, "a logprob entry is malformed"),
])  # fmt: skip
def test_an_answer_without_usable_logprobs_is_wrong(logprobs, wrong):
    with pytest.raises(ServerFault, match=wrong):
        parse_greedy(completion({"content": "a"}, logprobs))


def test_a_required_tool_call_must_be_parsed_and_carry_a_json_object():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert tool_call_problem(completion({"content": "", "tool_calls": [call]})) is None
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert tool_call_problem(completion({"content": text, "tool_calls": []})).startswith("no parsed tool call")
    broken = {**call, "function": {"name": "get_weather", "arguments": '{"city": "Par'}}
    assert "arguments are not JSON" in tool_call_problem(completion({"content": "", "tool_calls": [broken]}))
    listed = {**call, "function": {"name": "get_weather", "arguments": "[1]"}}
    assert "a JSON list, not an object" in tool_call_problem(completion({"content": "", "tool_calls": [listed]}))
    other = {**call, "function": {"name": "rm_rf", "arguments": "{}"}}
    assert "names \"rm_rf\"" in tool_call_problem(completion({"content": "", "tool_calls": [other]}))
    assert text_tool_call_problem(completion({"content": text})).startswith("a tool call came back as plain text")
    assert text_tool_call_problem(completion({"content": "It is sunny."})) is None


def test_reasoning_must_arrive_in_its_own_field():
    assert reasoning_problem(completion({"content": None, "reasoning": "Let me think"})) is None
    assert reasoning_problem(completion({"content": "x", "reasoning_content": "hmm"})) is None
    assert reasoning_problem(completion({"content": "<think>hmm</think>4"})).startswith(
        "the reasoning came back inside the content")
    assert reasoning_problem(completion({"content": "4", "reasoning": None})).startswith("no reasoning field")


def test_checks_apply_where_the_settings_give_them_something_to_check():
    assert Served().applicable() == ("speed", "prefix-cache", "cached-cold", "sessions")
    assert Served(prefix_caching=False, tool_parser=True).applicable() == ("speed", "prefix-cache", "tools")
    assert Served(tool_parser=True, reasoning_parser=True).applicable(("reasoning", "tools")) == ("reasoning", "tools")


def test_checks_are_listed_by_name_all_or_none_in_one_order():
    assert parse_checks("all") == SERVING_CHECKS and parse_checks("none") == () and parse_checks([]) == ()
    assert parse_checks("tools, cached-cold") == ("cached-cold", "tools")
    assert verify_checks(("tools",), probe=True) == ("prefix-cache", "tools")
    with pytest.raises(ValueError, match=r"unknown check tool \(known: speed, prefix-cache, "):
        parse_checks(["tool"])


def test_an_unknown_check_in_the_inventory_is_one_line_naming_the_setting_and_the_fix():
    with pytest.raises(SettingErrors) as raised:
        resolve_host("gpu1", {"gpufleet_verify_checks": ["cached-cold", "tool"]})
    line = str(raised.value)
    assert "gpu1" in line and "gpufleet_verify_checks" in line and "unknown check tool" in line
    assert 'or "all" or "none"' in line and "\n" not in line.strip()


def test_the_failure_mark_names_the_failed_check_and_survives_a_reread():
    version = Version(image="vllm/vllm-openai:nightly", ref="vllm/vllm-openai@sha256:" + "a" * 64,
                      unit_sha256="b" * 64, spec_hash="c" * 12, service="vllm", port=8000)
    ledger = Ledger(pending=Pending(version, "2026-12-02T00:00:00Z", "me@laptop pid 1"))
    marked = roll_back(ledger, "misconfigured: check tools: no parsed tool call", "2026-12-02T00:01:00Z",
                       check="tools")
    again = parse(render(marked))
    assert again.failed[-1].check == "tools" and again == marked
    assert "check" not in json.loads(render(roll_back(ledger, "dead: exited", "t")))["failed"][0]
