"""The stand-in `vllm serve` against the serving checks (gpufleet.health.serving) on loopback: a good server passes
every check; each bad nightly it emulates (STANDIN_MISBEHAVE, the sandbox image tags of the same names) and each
missing flag fails the check it should and no other; and the answer shapes it copies from vLLM 0.32 (logprobs,
the reasoning parser, tool calls and their 400s)."""

from __future__ import annotations

import itertools
import json

import pytest

from gpufleet.health.answers import AnswerCheck, check_answers
from gpufleet.health.serving import Served, run_checks
from gpufleet.health.serving_rules import Comparison, SessionFigures
from gpufleet.sandbox.image import TAGS
from gpufleet.wire.identity import Expected
from tests.loopback import LoopbackTransport
from tests.unit import test_standin_vllm_serve as standin

model, server = standin.model, standin.server  # the stand-in's fixtures: its tiny model, servers stopped after

GOOD = ("--served-model-name", "m", "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")  # fmt: skip
ALL = ("prefix-cache", "cached-cold", "sessions", "tools", "reasoning")
EVERY = Served(prefix_caching=True, tool_parser=True, reasoning_parser=True)  # every check applies
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}, "unit": {"type": "string"}},
        "required": ["city", "days"]}}}  # fmt: skip
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


def results(port: int, names: tuple[str, ...] = ALL) -> dict[str, AnswerCheck]:
    found = run_checks(LoopbackTransport(), Expected("vllm", port, "m"), EVERY, names, timeout_s=20)
    assert [c.name for c in found] == list(names)
    return {c.name: c for c in found}


def checks(port: int, names: tuple[str, ...] = ALL) -> dict[str, tuple[bool, str]]:
    return {name: (c.ok, c.detail) for name, c in results(port, names).items()}


def oks(found: dict[str, tuple[bool, str]]) -> dict[str, bool]:
    return {name: ok for name, (ok, _) in found.items()}


def ask(s, **body) -> dict:
    status, raw = s.chat({"model": "m", "messages": PARIS, "max_tokens": 6, "temperature": 0, **body})
    assert status == 200, raw
    return json.loads(raw)


def events(s, **body) -> list[dict]:
    status, raw = s.chat({"model": "m", "messages": PARIS, "max_tokens": 6, "stream": True, **body})
    assert status == 200, raw
    data = [e[len("data: ") :] for e in raw.decode().split("\n\n") if e]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# --- the serving checks --------------------------------------------------------------------------------------------
def test_a_good_server_passes_every_serving_check_and_the_answer_checks(server):
    s = server(*GOOD).wait()
    found = checks(s.port)
    assert oks(found) == dict.fromkeys(ALL, True), found
    assert "the same 6 tokens, logprobs within 0.0000" in found["cached-cold"][1]
    assert "could not be told from it" not in found["sessions"][1]  # the sessions stand apart at the first token
    answers = check_answers(LoopbackTransport(), Expected("vllm", s.port, "m"), timeout_s=10)
    assert [(c.name, c.ok) for c in answers] == [("completion", True), ("stream", True)], answers


def test_cache_corrupt_fails_cached_cold_and_sessions_and_passes_the_rest(server):
    s = server(*GOOD, env={"STANDIN_MISBEHAVE": "cache-corrupt"}).wait()
    got = results(s.port)
    found = {name: (c.ok, c.detail) for name, c in got.items()}
    assert oks(found) == {"prefix-cache": True, "cached-cold": False, "sessions": False, "tools": True,
                          "reasoning": True}, found  # fmt: skip
    assert found["cached-cold"][1].startswith("the cached answer differs from the cold one: token 0: "), found
    assert "got another answer than its own: token 0: " in found["sessions"][1], found
    # A failed check still carries what it judged on (a GPU run records it): the flip at the first token.
    cached = got["cached-cold"].figures["cached"]
    assert isinstance(cached, Comparison) and cached.flip == 0 and cached.lengths == (6, 6), got["cached-cold"]
    sessions = got["sessions"].figures
    assert set(sessions) == {"a", "b", "cached_tokens"} and all(sessions["cached_tokens"]), sessions
    assert all(isinstance(sessions[k], SessionFigures) and sessions[k].own.flip == 0 for k in "ab"), sessions
    assert got["sessions"].as_dict()["figures"]["a"]["own"]["flip"] == 0  # gpufleet verify --json carries them
    assert got["tools"].figures == {} and "figures" in got["tools"].as_dict()
    # what the probe (token counts) and the answer checks see is a healthy server
    answers = check_answers(LoopbackTransport(), Expected("vllm", s.port, "m"), timeout_s=10)
    assert all(c.ok for c in answers), answers


def test_cache_corrupt_answers_cold_prompts_right_and_cached_ones_confidently_wrong(server):
    good, bad = server(*GOOD).wait(), server(*GOOD, env={"STANDIN_MISBEHAVE": "cache-corrupt"}).wait()
    long = [{"role": "user", "content": "Tell me about rivers. " * 10}]
    body = {"messages": long, "logprobs": True, "top_logprobs": 5, "chat_template_kwargs": {"enable_thinking": False}}
    right = ask(good, **body)["choices"][0]["logprobs"]["content"]
    cold = ask(bad, **body)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["logprobs"]["content"] == right
    cached = ask(bad, **body)
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wrong = cached["choices"][0]["logprobs"]["content"]
    assert wrong[0]["token"] != right[0]["token"] and all(e["logprob"] > -1 for e in wrong)
    assert ask(good, **body)["choices"][0]["logprobs"]["content"] == right  # a good server's cached answer


def test_tools_broken_fails_the_tools_check_only(server):
    s = server(*GOOD, env={"STANDIN_MISBEHAVE": "tools-broken"}).wait()
    found = checks(s.port, ("cached-cold", "sessions", "tools", "reasoning"))
    assert oks(found) == {"cached-cold": True, "sessions": True, "tools": False, "reasoning": True}, found
    assert found["tools"][1].startswith('tool_choice "required": no parsed tool call; the text was \'<tool_call>'), (
        found
    )


def test_tools_broken_leaves_the_call_in_the_text_for_auto_too(server):
    s = server(*GOOD, env={"STANDIN_MISBEHAVE": "tools-broken"}).wait()
    for choice in ("required", "auto"):
        message = ask(s, tools=[WEATHER], tool_choice=choice)["choices"][0]["message"]
        assert not message["tool_calls"], message
        assert message["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
                                      "\n</tool_call>")  # fmt: skip


def test_without_auto_tool_choice_the_tools_check_fails_on_auto(server):
    s = server("--served-model-name", "m", "--enable-prompt-tokens-details", "--tool-call-parser", "qwen3_coder").wait()
    found = checks(s.port, ("cached-cold", "tools"))
    assert oks(found) == {"cached-cold": True, "tools": False}, found
    assert "answered 400" in found["tools"][1] and '\\"auto\\" tool choice requires' in found["tools"][1], found


def test_without_a_reasoning_parser_the_reasoning_check_fails(server):
    s = server("--served-model-name", "m", "--enable-prompt-tokens-details", "--enable-auto-tool-choice",
               "--tool-call-parser", "qwen3_coder").wait()  # fmt: skip
    found = checks(s.port, ("cached-cold", "tools", "reasoning"))
    assert oks(found) == {"cached-cold": True, "tools": True, "reasoning": False}, found
    assert found["reasoning"][1].startswith("no reasoning field in the answer"), found


@pytest.mark.parametrize("tag", ["good", "cache-corrupt", "tools-broken"])
def test_the_answer_checks_pass_on_tags_that_only_fail_serving(server, tag):
    s = server(*GOOD, env=TAGS[tag]).wait()
    answers = check_answers(LoopbackTransport(), Expected("vllm", s.port, "m"), timeout_s=10)
    assert [(c.name, c.ok) for c in answers] == [("completion", True), ("stream", True)], answers


def test_the_new_tags_set_the_behaviour_they_are_named_after():
    for tag in ("cache-corrupt", "tools-broken"):
        assert TAGS[tag]["STANDIN_MISBEHAVE"] == tag
    versions = [env["STANDIN_VLLM_VERSION"] for env in TAGS.values()]
    assert len(set(versions)) == len(versions)  # each tag its own digest


# --- answer shapes, as vLLM 0.32 ---------------------------------------------------------------------------------
def test_greedy_answers_are_a_function_of_the_whole_prompt_with_vllm_logprobs(server):
    s = server("--served-model-name", "m").wait()
    first = ask(s, logprobs=True, top_logprobs=5)["choices"][0]
    entries = first["logprobs"]["content"]
    assert len(entries) == 6 and "".join(e["token"] for e in entries) == first["message"]["content"]
    for e in entries:
        top = e["top_logprobs"]
        assert len(top) == 5 and top[0] == {k: e[k] for k in ("token", "logprob", "bytes")}
        assert e["bytes"] == list(e["token"].encode()) and -1 < e["logprob"] < 0
        gaps = [a["logprob"] - b["logprob"] for a, b in itertools.pairwise(top)]
        assert all(0.9 < g < 1.3 for g in gaps), top
        assert len({t["token"] for t in top}) == 5
    assert ask(s, logprobs=True, top_logprobs=5)["choices"][0]["logprobs"] == first["logprobs"]  # cached: the same
    assert ask(s, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == top_of(
        entries[0], 2
    )
    as_ids = ask(s, logprobs=True, top_logprobs=5, return_tokens_as_token_ids=True)["choices"][0]
    assert as_ids["message"] == first["message"]
    for e, by_id in zip(entries, as_ids["logprobs"]["content"], strict=True):
        assert by_id["token"].startswith("token_id:") and (by_id["logprob"], by_id["bytes"]) == (
            e["logprob"],
            e["bytes"],
        )
        top_ids = [t["token"] for t in by_id["top_logprobs"]]
        assert (
            top_ids[0] == by_id["token"] and len(set(top_ids)) == 5 and all(t.startswith("token_id:") for t in top_ids)
        )
    plain = ask(s)["choices"][0]
    assert plain["logprobs"] is None and plain["message"]["content"] == first["message"]["content"]
    assert ask(s, max_tokens=3)["choices"][0]["message"]["content"] == "".join(e["token"] for e in entries[:3])
    other = ask(s, messages=[{"role": "user", "content": "What is the weather in Rome?"}])["choices"][0]
    assert other["message"]["content"] != first["message"]["content"]


def top_of(entry: dict, n: int) -> list[dict]:
    return entry["top_logprobs"][:n]


def test_streamed_chunks_carry_one_token_and_its_logprobs_each(server):
    s = server("--served-model-name", "m").wait()
    whole = ask(s, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    chunks = [c["choices"][0] for c in events(s, logprobs=True, top_logprobs=3)][1:]
    assert [c["logprobs"]["content"] for c in chunks] == [[e] for e in whole]
    assert [c["delta"]["content"] for c in chunks] == [e["token"] for e in whole]
    assert chunks[-1]["finish_reason"] == "length"


def test_reasoning_parser_puts_the_answer_in_reasoning_unless_thinking_is_off(server):
    s = server("--served-model-name", "m", "--reasoning-parser", "qwen3").wait()
    thinking = ask(s)
    message = thinking["choices"][0]["message"]
    assert message["content"] is None and message["reasoning"]
    assert {"refusal", "annotations", "audio", "function_call"} <= set(message)
    assert thinking["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    off = ask(s, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert off["content"] and off["reasoning"] is None
    deltas = [c["choices"][0]["delta"] for c in events(s) if c["choices"]][1:]
    assert all("reasoning" in d and "content" not in d for d in deltas), deltas
    default_off = server("--served-model-name", "m", "--reasoning-parser", "qwen3",
                         "--default-chat-template-kwargs", '{"enable_thinking": false}').wait()  # fmt: skip
    assert ask(default_off)["choices"][0]["message"]["reasoning"] is None
    assert ask(default_off, chat_template_kwargs={"enable_thinking": True})["choices"][0]["message"]["reasoning"]


def test_without_a_reasoning_parser_the_text_is_content(server):
    s = server("--served-model-name", "m").wait()
    message = ask(s)["choices"][0]["message"]
    assert message["content"] and message["reasoning"] is None


def test_required_and_named_tool_choice_return_a_parsed_call_with_or_without_a_parser(server):
    s = server("--served-model-name", "m").wait()  # vLLM forces the call's JSON by structured output
    shout = {"type": "function", "function": {"name": "shout", "parameters": {"type": "object", "properties": {}}}}
    for choice, name, arguments in (("required", "get_weather", {"city": "Paris", "days": 1}),
                                    ({"type": "function", "function": {"name": "shout"}}, "shout", {})):  # fmt: skip
        answer = ask(s, tools=[WEATHER, shout], tool_choice=choice, max_tokens=64)["choices"][0]
        assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] == ""
        (call,) = answer["message"]["tool_calls"]
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
        assert call["function"]["name"] == name and json.loads(call["function"]["arguments"]) == arguments
    streamed = [c["choices"][0] for c in events(s, tools=[WEATHER], tool_choice="required") if c["choices"]]
    assert streamed[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert streamed[-1]["finish_reason"] == "tool_calls"


def test_auto_tool_choice_needs_both_flags_as_vllm(server):
    message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    for flags in ((), ("--enable-auto-tool-choice",), ("--tool-call-parser", "qwen3_coder")):
        s = server("--served-model-name", "m", *flags).wait()
        for body in ({"tools": [WEATHER], "tool_choice": "auto"}, {"tools": [WEATHER]}):  # "auto" is the default
            status, raw = s.chat({"model": "m", "messages": PARIS, **body})
            assert (status, json.loads(raw)) == (400, {"error": {"message": message, "type": "BadRequestError",
                                                                 "param": None, "code": 400}}), flags  # fmt: skip
    s = server("--served-model-name", "m", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder").wait()
    answer = ask(s, tools=[WEATHER], tool_choice="auto")["choices"][0]
    assert answer["message"]["content"] and not answer["message"]["tool_calls"]
    status, raw = s.chat({"model": "m", "messages": PARIS, "tool_choice": "required"})
    assert status == 400 and "`tools` must be set" in json.loads(raw)["error"]["message"]
    status, raw = s.chat({"model": "m", "messages": PARIS, "tools": [WEATHER],
                          "tool_choice": {"type": "function", "function": {"name": "nope"}}})  # fmt: skip
    assert status == 400 and "does not match any of the specified `tools`" in json.loads(raw)["error"]["message"]
