"""The serving checks' rules over what a server answered: greedy answers compared, a parsed tool call, reasoning
apart from the content. docs/verify.md (Serving checks) has the measured bounds.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from gpufleet.health.answers import PATH
from gpufleet.wire.evidence import excerpt

# In nats; docs/verify.md has the measurements behind each bound.
TOLERANCE_NATS = 0.25
BATCH_DRIFT_NATS = 0.1
BATCH_TIE_NATS = 0.5
FIRST_TIE_NATS = 2 * BATCH_DRIFT_NATS
TOOL_NAME = "get_weather"
TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                   "required": ["city"]}}}  # fmt: skip
# A tool call the parser left in the text (Qwen's formats).
TOOL_MARKUP = ("<tool_call>", "<function=", '"name": "get_weather"')
THINK_MARKUP = ("<think>", "</think>")
# Generated markup that says nothing, such as <|im_end|>.
SILENT_MARKUP = re.compile(r"<\|[^|<>]*\|>|</?think>")


class ServerFault(Exception):
    """What the server did wrong, in one line."""


@dataclass(frozen=True)
class Greedy:
    """One greedy answer, token by token, with each position's top alternatives. Tokens may be `token_id:N`, since
    two ids may decode alike."""

    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    top: tuple[dict[str, float], ...]
    prompt_tokens: int
    cached_tokens: int | None  # None when the server does not say
    said: str = ""  # content, or reasoning

    @property
    def text(self) -> str:
        return self.said or "".join(self.tokens)


@dataclass(frozen=True)
class Comparison:
    """How answer b departs from answer a of the same prompt: the logprob gaps before the first differing token
    (flip), and there each one's lead over the other's token (margins) and over its last listed one (spans)."""

    gaps: tuple[float, ...]
    flip: int | None
    margins: tuple[float | None, float | None] = (None, None)
    lengths: tuple[int, int] = (0, 0)
    spans: tuple[float | None, float | None] = (None, None)
    parted: tuple[str, str] = ("", "")

    @property
    def drift(self) -> float:
        return max(self.gaps, default=0.0)

    @property
    def shared(self) -> int:
        return min(self.lengths) if self.flip is None else self.flip

    def tie_within(self, bound: float, *, unlisted_at_span: bool = False) -> bool:
        """Each lead within `bound`; unlisted_at_span counts a lead past the top list as the list's span."""
        leads = (s if m is None and unlisted_at_span else m for m, s in zip(self.margins, self.spans, strict=True))
        return all(m is not None and m <= bound for m in leads)


def compare(a: Greedy, b: Greedy) -> Comparison:
    lengths = (len(a.tokens), len(b.tokens))
    gaps: list[float] = []
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)):
        if x != y:
            return Comparison(
                tuple(gaps), i, (_margin(a, i, y), _margin(b, i, x)), lengths, (_span(a, i), _span(b, i)), (x, y)
            )
        gaps.append(abs(a.logprobs[i] - b.logprobs[i]))
    return Comparison(tuple(gaps), None, (None, None), lengths)


def _margin(answer: Greedy, i: int, token: str) -> float | None:
    alternative = answer.top[i].get(token)
    return None if alternative is None else answer.logprobs[i] - alternative


def _span(answer: Greedy, i: int) -> float | None:
    return answer.logprobs[i] - min(answer.top[i].values()) if answer.top[i] else None


def first_logprobs(answer: Greedy) -> dict[str, float]:
    """The first position's top logprobs, its chosen token's included."""
    return {**answer.top[0], answer.tokens[0]: answer.logprobs[0]} if answer.tokens else {}


def first_token_distance(a: Greedy, b: Greedy, over: AbstractSet[str]) -> float | None:
    """The largest logprob gap at the first position over the tokens of `over` both hold."""
    first_a, first_b = first_logprobs(a), first_logprobs(b)
    return max((abs(first_a[t] - first_b[t]) for t in over & first_a.keys() & first_b.keys()), default=None)


def agreement(cold: Greedy, cached: Greedy, tolerance: float = TOLERANCE_NATS) -> tuple[bool, str]:
    """(agree, one line): the same tokens within `tolerance`, or a split on a near tie."""
    c = compare(cold, cached)
    gap, line = _over(c, cold, cached, tolerance, ("cold", "cached"))
    if gap:
        return False, line
    if c.flip is not None:
        i = c.flip
        if c.tie_within(tolerance):
            return True, (
                f"the same {i} tokens, then a near tie at token {i} ({cold.tokens[i]!r} cold, "
                f"{cached.tokens[i]!r} cached, within {tolerance} nats); logprobs within {c.drift:.4f}"
            )
        return False, (
            f"token {i}: {cold.tokens[i]!r} cold, {cached.tokens[i]!r} cached ({excerpt(cold.text, 40)!r} "
            f"vs {excerpt(cached.text, 40)!r})"
        )
    if c.lengths[0] != c.lengths[1]:
        return False, f"{c.lengths[0]} tokens cold, {c.lengths[1]} cached"
    return True, f"the same {c.lengths[0]} tokens, logprobs within {c.drift:.4f}"


def _over(c: Comparison, a: Greedy, b: Greedy, bound: float, names: tuple[str, str]) -> tuple[bool, str]:
    i = next((i for i, gap in enumerate(c.gaps) if gap > bound), None)
    if i is None:
        return False, ""
    return True, (
        f"token {i} {a.tokens[i]!r}: logprob {a.logprobs[i]:.3f} {names[0]}, {b.logprobs[i]:.3f} {names[1]} "
        f"(differs by {c.gaps[i]:.3f} > {bound})"
    )


@dataclass(frozen=True)
class SessionFigures:
    """The figures judge_session decided on, for a GPU run to record. First-token distances are over the tokens all
    three top lists share, so a token one list lacks cannot make either look nearer."""

    own: Comparison
    first_own: float | None
    first_other: float | None
    apart: float | None
    shared_other: int

    @property
    def nearer_other(self) -> bool:
        return self.first_other is not None and self.first_own is not None and self.first_other < self.first_own

    @property
    def told_apart(self) -> bool:
        return self.apart is None or self.apart > 2 * BATCH_DRIFT_NATS

    @property
    def crossed(self) -> bool:
        """Takes the other session's path; evidence only where the sessions stand apart, or noise does it as often."""
        return self.told_apart and (self.nearer_other or self.shared_other > self.own.shared)


@dataclass(frozen=True)
class SessionJudgement:
    ok: bool
    line: str
    figures: SessionFigures


def judge_session(got: Greedy, own: Greedy, other: Greedy) -> SessionJudgement:
    """`got`, sent beside the other session, against both sessions' answers alone."""
    c = compare(own, got)
    common = first_logprobs(own).keys() & first_logprobs(other).keys() & first_logprobs(got).keys()
    figures = SessionFigures(
        c,
        first_token_distance(own, got, common),
        first_token_distance(other, got, common),
        first_token_distance(own, other, common),
        compare(other, got).shared,
    )
    return judge_figures(figures)


def judge_figures(figures: SessionFigures) -> SessionJudgement:
    """Batch noise passes; more is a fault, and so is being nearer the other session where the two stand apart."""
    c = figures.own
    problem = _batch_problem(c, unlisted_at_span=not figures.crossed)
    if problem is None and figures.told_apart and figures.nearer_other:
        problem = (
            f"its first token's logprobs are {figures.first_other:.3f} nats from the other session's alone, "
            f"{_nats(figures.first_own)} from its own"
        )
    if problem is not None:
        why = "beyond batch noise"
        if figures.crossed:
            why = "it takes the other session's path: cached state crossed sessions"
        return SessionJudgement(False, f"{problem}; {why}", figures)
    if c.flip is None:
        return SessionJudgement(True, f"the same {c.lengths[0]} tokens, logprobs within {c.drift:.4f}", figures)
    i, (alone, beside) = c.flip, c.parted
    return SessionJudgement(
        True,
        (
            f"the same {i} tokens (logprobs within {c.drift:.4f}), then a near tie at token {i} "
            f"({alone!r} alone, {beside!r} beside the other session)"
        ),
        figures,
    )


def _batch_problem(c: Comparison, *, unlisted_at_span: bool) -> str | None:
    i = next((i for i, gap in enumerate(c.gaps) if gap > BATCH_DRIFT_NATS), None)
    if i is not None:
        return (
            f"token {i}'s logprob differs by {c.gaps[i]:.3f} alone and beside the other session (> {BATCH_DRIFT_NATS})"
        )
    if c.flip is not None:
        i, bound = c.flip, FIRST_TIE_NATS if c.flip == 0 else BATCH_TIE_NATS
        if not c.tie_within(bound, unlisted_at_span=unlisted_at_span):
            alone, beside = (_lead(m, s) for m, s in zip(c.margins, c.spans, strict=True))
            return (
                f"token {i}: {c.parted[0]!r} alone, {c.parted[1]!r} beside the other session, not a near tie "
                f"(each led the other's token by {alone} alone, {beside} beside; a tie is within {bound} nats)"
            )
        return None
    if c.lengths[0] != c.lengths[1]:
        return f"{c.lengths[0]} tokens alone, {c.lengths[1]} beside the other session"
    return None


def _lead(margin: float | None, span: float | None) -> str:
    if margin is not None:
        return f"{margin:.3f} nats"
    return "past its top logprobs" + ("" if span is None else f" (which span {span:.3f} nats)")


def _nats(value: float | None) -> str:
    return "not in the top logprobs" if value is None else f"{value:.3f}"


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
        top.append(
            {
                t["token"]: float(t["logprob"])
                for t in entry.get("top_logprobs") or []
                if isinstance(t, dict) and isinstance(t.get("token"), str) and _finite(t.get("logprob"))
            }
        )
    usage = doc.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    message = choice.get("message") or {}
    said = next((t for t in (message.get("content"), message.get("reasoning")) if isinstance(t, str) and t), "")
    return Greedy(
        tuple(tokens),
        tuple(logprobs),
        tuple(top),
        int(usage.get("prompt_tokens") or 0),
        cached if isinstance(cached, int) else None,
        said,
    )


def tool_call_problem(body: bytes) -> str | None:
    """`tool_choice: "required"`: what is wrong with the parsed call, if anything."""
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
    """`tool_choice: "auto"`: a tool call must come back parsed, not as text nor dropped."""
    message = completion_doc(body)["choices"][0].get("message") or {}
    content = str(message.get("content") or "")
    if not message.get("tool_calls") and any(m in content for m in TOOL_MARKUP):
        return f"a tool call came back as plain text: {excerpt(content, 60)!r}"
    return dropped_tool_call_problem(body)


def dropped_tool_call_problem(body: bytes) -> str | None:
    """A call the parser dropped: finish_reason tool_calls without one, or generated text that came back as nothing.
    A call cut off at max_tokens may rightly be dropped."""
    choice = completion_doc(body)["choices"][0]
    message = choice.get("message") or {}
    if message.get("tool_calls"):
        return None
    if choice.get("finish_reason") == "tool_calls":
        return "finish_reason is tool_calls, but no tool call came back: the tool parser dropped it"
    said = [message.get(k) for k in ("content", "reasoning", "reasoning_content")]
    if choice.get("finish_reason") != "stop" or any(isinstance(t, str) and t.strip() for t in said):
        return None
    entries = (choice.get("logprobs") or {}).get("content")
    if isinstance(entries, list):
        generated = "".join(str(e.get("token", "")) for e in entries if isinstance(e, dict))
        if not SILENT_MARKUP.sub("", generated).strip():
            return None
        what = repr(excerpt(generated, 60))
    else:
        completion = (completion_doc(body).get("usage") or {}).get("completion_tokens")
        if not (isinstance(completion, int) and completion > 1):
            return None
        what = f"{completion} tokens"
    return f"the model generated {what}, which came back as neither content, reasoning nor a tool call: dropped"


def reasoning_problem(body: bytes) -> str | None:
    """The reasoning must come in its own field, with no think markup left in the content."""
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
