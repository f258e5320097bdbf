"""Does the new version serve correctly, not only answer? The canary's checks, each a few greedy requests through
the host's transport, with its API key, bounded in time:

    prefix-cache  the prompt re-processing probe (gpufleet.health.probe): a prefix cache that never hits fails
    cached-cold   one greedy prompt, cold (a fresh prefix), then again once its prefix is cached: the same tokens
    sessions      two sessions with different prefixes, sent at once with their prefixes cached: each gets its own
                  cold answer back (no state of one session in the other's)
    tools         with a tool parser and auto tool choice set: `tool_choice: "required"` returns a parsed tool call
                  whose arguments are a JSON object, and `"auto"` is accepted and never returns the call as text
    reasoning     with a reasoning parser set: the reasoning arrives in its own field, apart from the content

How the answers are judged (cached against cold within a logprob tolerance, a parsed tool call, reasoning apart)
lives in gpufleet.health.serving_rules.

    >>> results = run_checks(transport, expected, Served.from_spec(spec), ("cached-cold", "tools"), api_key=key)
    >>> [r.line() for r in results if not r.ok]
    []
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.health.answers import PATH, AnswerCheck
from gpufleet.health.api import HttpStatusError, fetch
from gpufleet.health.cache_counters import read_metrics
from gpufleet.health.conversation import Conversation
from gpufleet.health.probe import probe
from gpufleet.health.serving_rules import (
    TOLERANCE_NATS,
    TOOL,
    Greedy,
    ServerFault,
    agreement,
    closer_to,
    completion_doc,
    parse_greedy,
    reasoning_problem,
    text_tool_call_problem,
    tool_call_problem,
)
from gpufleet.remote.transport import BadAnswer, Transport
from gpufleet.wire.checks import SERVING_CHECKS, SPEED
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.identity import Expected, SpecArgs
from gpufleet.wire.metrics import HITS, Metrics

CHECK_TIMEOUT_S = 120.0  # per request: a prompt of ~1.5 cache units, cold, on a server that just started
GREEDY_TOKENS = 6
TOP_LOGPROBS = 5
HIT_ATTEMPTS = 3  # an align-mode hybrid may miss on the first repeat (the chunk-alignment trap) and hit on the next
CALIBRATION_WORDS = 200


@dataclass(frozen=True)
class Served:
    """What the checks need to know of the server's settings: which parsers it runs, its prefill chunk and how many
    requests it batches."""

    prefix_caching: bool = True
    tool_parser: bool = False  # --enable-auto-tool-choice with a --tool-call-parser
    reasoning_parser: bool = False
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None

    @classmethod
    def from_spec(cls, spec: SpecArgs) -> Served:
        return cls(
            prefix_caching=bool(spec.prefix_caching),
            tool_parser=bool(spec.arg("enable-auto-tool-choice")) and bool(spec.arg("tool-call-parser")),
            reasoning_parser=bool(spec.arg("reasoning-parser")),
            max_num_batched_tokens=_count(spec, "max-num-batched-tokens"),
            max_num_seqs=_count(spec, "max-num-seqs"),
        )

    def applicable(self, names: Sequence[str] = SERVING_CHECKS) -> tuple[str, ...]:
        """The checks among `names` that this server's settings give something to check."""
        # The probe runs whenever asked: a server without prefix caching is what it exists to catch.
        needs = {"speed": True, "prefix-cache": True, "cached-cold": self.prefix_caching,
                 "sessions": self.prefix_caching, "tools": self.tool_parser, "reasoning": self.reasoning_parser}
        return tuple(n for n in names if needs[n])


def _count(spec: SpecArgs, flag: str) -> int | None:
    value = str(spec.arg(flag) or "").replace("_", "")
    return int(value) if value.isdigit() else None


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
    # speed is gpufleet.health.speed's: it measures figures to compare, not only a verdict.
    wanted = served.applicable([n for n in SERVING_CHECKS if n in names and n != SPEED])
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
    except (ServerFault, BadAnswer, HttpStatusError) as wrong:
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
            raise ServerFault(f"probe {found.verdict}: {found.detail}{fixes}")
        return f"probe {found.verdict}: {found.detail}"

    def cached_cold(self) -> str:
        conversation, cold = self._cold("a")
        cached = self._until_hit(conversation)
        agree, line = agreement(cold, cached, self.tolerance)
        if not agree:
            raise ServerFault(f"the cached answer differs from the cold one: {line}")
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
                raise ServerFault(f"session {label}, sent beside the other, got another answer than its own cold one: "
                             f"{line}")
            if closer_to(got, other, cold):
                raise ServerFault(f"session {label}'s answer is nearer the other session's cold answer than its own: "
                             "cached state crossed sessions")
            lines.append(f"{label}: {line.split(',')[0]}")
        hits = [answers[label].cached_tokens for label in sessions]  # type: ignore[union-attr]
        if None not in hits and not all(hits):
            raise ServerFault(f"the sessions were not served from the cache (cached tokens {hits}): the check did not "
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
            except ServerFault as wrong:  # vLLM refuses tool calls without a tool parser (400), "auto" without both flags
                problem = str(wrong)
            if problem:
                raise ServerFault(f'tool_choice "{choice}": {problem}')
        return 'tool_choice "required" returned a get_weather call with JSON arguments; "auto" accepted'

    def reasoning(self) -> str:
        body = self._body([{"role": "user", "content": "Think briefly, then answer: what is 2 + 2?"}], 16)
        answer = self._post(body)
        problem = reasoning_problem(answer)
        if problem:
            raise ServerFault(problem)
        message = completion_doc(answer)["choices"][0]["message"]
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
                raise ServerFault(f"session {label}'s fresh prefix was served from the cache ({cold.cached_tokens} "
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
        raise ServerFault(f"a {answer.prompt_tokens}-token prompt sent {HIT_ATTEMPTS} times never came from the prefix "
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
                raise ServerFault("vllm:cache_config_info has no block_size: no prompt length can be planned")
            target = int(1.5 * unit) + 16
            room = (self.expected.max_model_len or 1 << 30) - GREEDY_TOKENS - 16
            if target > room:
                raise ServerFault(f"max_model_len leaves {room} prompt tokens, a prompt that can hit needs {target}")
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
            raise ServerFault(f"POST {PATH} answered {answer.status}: {excerpt(answer.text)}")
        return answer.body

