"""The serving checks: does the new version serve correctly, not only answer? Each is a few greedy requests.

docs/verify.md (Serving checks) says what each asks; gpufleet.health.serving_rules judges the answers.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpufleet.health.answers import PATH, AnswerCheck, NotRun, not_run, once_more, unanswered
from gpufleet.health.api import HttpStatusError, fetch
from gpufleet.health.cache_counters import attributed_hits, read_metrics
from gpufleet.health.conversation import Conversation
from gpufleet.health.probe import probe
from gpufleet.health.serving_rules import (
    TOLERANCE_NATS,
    TOOL,
    Greedy,
    ServerFault,
    SessionJudgement,
    agreement,
    compare,
    completion_doc,
    judge_session,
    parse_greedy,
    reasoning_problem,
    text_tool_call_problem,
    tool_call_problem,
)
from gpufleet.remote.transport import BadAnswer, Transport
from gpufleet.wire.checks import SERVING_CHECKS, SPEED
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.identity import Expected, SpecArgs
from gpufleet.wire.metrics import Metrics

CHECK_TIMEOUT_S = 120.0  # per request, cold, on a server that just started
GREEDY_TOKENS = 6
TOP_LOGPROBS = 5
HIT_ATTEMPTS = 3  # a trapped hybrid may miss the first repeat and hit the next
VOID_READINGS = 3  # repeats that other traffic spoiled, before the check gives up
CALIBRATION_WORDS = 200
UNATTRIBUTABLE = (
    "/metrics' counters cannot tell its hits from theirs (fix: run the checks while the host takes no "
    "other traffic, or serve with --enable-prompt-tokens-details)"
)


@dataclass(frozen=True)
class Served:
    """What the checks need to know of the server's settings."""

    prefix_caching: bool = True
    tool_parser: bool = False  # with --enable-auto-tool-choice
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
        needs = {
            "speed": True,
            "prefix-cache": True,
            "cached-cold": self.prefix_caching,
            "sessions": self.prefix_caching,
            "tools": self.tool_parser,
            "reasoning": self.reasoning_parser,
        }
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
    """The checks among `names` that apply to `served`, in order; never raises. After a check that got no answer
    the rest are not sent."""
    run = _Checks(transport, expected, api_key, tolerance, timeout_s, os.urandom(4).hex())
    # speed is gpufleet.health.speed's.
    wanted = served.applicable([n for n in SERVING_CHECKS if n in names and n != SPEED])
    steps: dict[str, Callable[[], str]] = {
        "prefix-cache": lambda: run.prefix_cache(served.max_num_batched_tokens),
        "cached-cold": run.cached_cold,
        "sessions": run.sessions,
        "tools": run.tools,
        "reasoning": run.reasoning,
    }
    return tuple(run.result(name, steps[name]) for name in wanted)


def failed(checks: Sequence[AnswerCheck]) -> str | None:
    """One line naming the first failed check; None when all passed."""
    bad = next((c for c in checks if not c.ok), None)
    return f"check {bad.line()}" if bad else None


class _Checks:
    """One run of the checks on one server: its conversations and their cold answers."""

    def __init__(
        self,
        transport: Transport,
        expected: Expected,
        api_key: str | None,
        tolerance: float,
        timeout_s: float,
        run_id: str,
    ):
        self.transport, self.expected, self.api_key = transport, expected, api_key
        self.tolerance, self.timeout_s, self.run_id = tolerance, timeout_s, run_id
        self.words: int | None = None  # once calibrated
        self.cold: dict[str, tuple[Conversation, Greedy]] = {}
        self.silent: str | None = None  # the check that got no answer
        self.figures: dict[str, dict[str, object]] = {}

    def result(self, name: str, step: Callable[[], str]) -> AnswerCheck:
        """The check's verdict, with the figures it judged on."""
        return replace(self._verdict(name, step), figures=self.figures.get(name, {}))

    def _verdict(self, name: str, step: Callable[[], str]) -> AnswerCheck:
        if self.silent is not None:
            return AnswerCheck(name, False, f"not sent: {self.silent} got no answer", ran=False)
        try:
            return AnswerCheck(name, True, step())
        except (ServerFault, BadAnswer, HttpStatusError) as wrong:
            return AnswerCheck(name, False, excerpt(str(wrong), 300))
        except NotRun as unknown:
            return not_run(name, unknown)
        except Exception as error:
            if unanswered(error):
                self.silent = name
                return not_run(name, error)
            return AnswerCheck(name, False, excerpt(f"{type(error).__name__}: {error}", 300))

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
        self.figures["cached-cold"] = {"cached": compare(cold, cached)}
        agree, line = agreement(cold, cached, self.tolerance)
        if not agree:
            raise ServerFault(f"the cached answer differs from the cold one: {line}")
        return f"{line} ({cached.cached_tokens} of {cached.prompt_tokens} prompt tokens cached)"

    def sessions(self) -> str:
        judged, hits = self.judged_sessions()
        self.figures["sessions"] = {**{label: found.figures for label, found in judged.items()}, "cached_tokens": hits}
        lines = []
        for label, found in judged.items():
            if not found.ok:
                raise ServerFault(
                    f"session {label}, sent beside the other, got another answer than its own: {found.line}"
                )
            lines.append(f"{label}: {found.line}")
        apart = judged["a"].figures.apart
        if not judged["a"].figures.told_apart:
            lines.append(
                f"the sessions' first tokens are {apart:.3f} nats apart alone, within batch noise: crossed "
                "state could not be told from it"
            )
        return "; ".join(lines) + f" (cached tokens: {hits})"

    def judged_sessions(self) -> tuple[dict[str, SessionJudgement], list[int | None]]:
        """Both sessions alone, then at once from the cache: each judged, and their cached tokens."""
        sessions = {"a": self._cold("a"), "b": self._cold("b")}
        for conversation, _ in sessions.values():
            self._until_hit(conversation)
        before = self._metrics() if self._counts_from_metrics else None
        answers: dict[str, Greedy | BaseException] = {}

        def send(label: str) -> None:
            try:
                answers[label] = self._greedy(sessions[label][0].messages)
            except BaseException as error:  # raised below
                answers[label] = error

        threads = [threading.Thread(target=send, args=(label,)) for label in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got: dict[str, Greedy] = {}
        for label, answer in answers.items():
            if isinstance(answer, BaseException):
                raise answer
            got[label] = answer
        hits = [got[label].cached_tokens for label in sessions]
        if before is not None:
            both = attributed_hits(before, self._metrics(), sum(g.prompt_tokens for g in got.values()))
            if both is None:
                raise NotRun(f"other requests used the prefix cache while the sessions were sent: {UNATTRIBUTABLE}")
            hits = [both]
        if not all(hits):
            raise ServerFault(
                f"the sessions were not served from the cache (cached tokens {hits}): the check did not "
                "exercise cached state"
            )
        return {
            label: judge_session(got[label], cold, sessions["b" if label == "a" else "a"][1])
            for label, (_, cold) in sessions.items()
        }, hits

    def tools(self) -> str:
        for choice, rule in (("required", tool_call_problem), ("auto", text_tool_call_problem)):
            try:
                problem = rule(self._post(self.tool_request(choice)))
            except ServerFault as wrong:  # vLLM answers 400 without the parser flags
                problem = str(wrong)
            if problem:
                raise ServerFault(f'tool_choice "{choice}": {problem}')
        return 'tool_choice "required" returned a get_weather call with JSON arguments; "auto" accepted'

    def tool_request(self, choice: str) -> dict[str, Any]:
        """The tools check's request; docs/verify.md says why each field."""
        body = self._body([{"role": "user", "content": "What is the weather in Paris? Use the tool."}], 64)
        body |= {"tools": [TOOL], "tool_choice": choice, "chat_template_kwargs": {"enable_thinking": False}}
        return body | ({"include_reasoning": False} if choice == "required" else {"max_tokens": 32, "logprobs": True})

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
        """Session `label`'s fresh conversation and its cold answer, once."""
        if label not in self.cold:
            # The label first, so the two sessions share no cache block however the run id tokenizes.
            conversation = Conversation(f"{label}-{self.run_id}", f"serving-{label}", self._words())
            cold = self._greedy(conversation.messages)
            if cold.cached_tokens:
                raise ServerFault(
                    f"session {label}'s fresh prefix was served from the cache ({cold.cached_tokens} "
                    "tokens): its cold answer cannot be taken"
                )
            self.cold[label] = (conversation, cold)
        return self.cold[label]

    def _until_hit(self, conversation: Conversation) -> Greedy:
        """The same prompt again until its prefix comes from the cache."""
        misses, void = 0, 0
        while True:
            answer = self._greedy(conversation.messages, counted=True)
            if answer.cached_tokens:
                return answer
            if answer.cached_tokens is None:
                void += 1
                if void > VOID_READINGS:
                    raise NotRun(
                        f"other requests used the prefix cache during {void} sends of one prompt: {UNATTRIBUTABLE}"
                    )
                continue
            misses += 1
            if misses == HIT_ATTEMPTS:
                raise ServerFault(
                    f"a {answer.prompt_tokens}-token prompt sent {HIT_ATTEMPTS} times never came from the "
                    "prefix cache: the cached path cannot be compared (see the prefix-cache check)"
                )

    @property
    def _counts_from_metrics(self) -> bool:
        # Without --enable-prompt-tokens-details only /metrics counts cached tokens.
        return any(cold.cached_tokens is None for _, cold in self.cold.values())

    def _words(self) -> int:
        """Filler words for a prompt of ~1.5 cache units, short yet due a whole unit on its repeat."""
        if self.words is None:
            metrics = self._metrics()
            unit = metrics.prefix_match_unit or metrics.block_size
            if not unit:
                raise ServerFault("vllm:cache_config_info has no block_size: no prompt length can be planned")
            target = int(1.5 * unit) + 16
            room = (self.expected.max_model_len or 1 << 30) - GREEDY_TOKENS - 16
            if target > room:
                raise ServerFault(f"max_model_len leaves {room} prompt tokens, a prompt that can hit needs {target}")
            sample = self._greedy(Conversation(f"calibration-{self.run_id}", "calibration", CALIBRATION_WORDS).messages)
            per_word = max(sample.prompt_tokens / CALIBRATION_WORDS, 0.1)
            self.words = max(1, math.ceil(target / per_word))
        return self.words

    def _metrics(self) -> Metrics:
        return once_more(lambda: read_metrics(self.transport, self.expected.port, self.expected.address))

    def _body(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.expected.served_model_name,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "seed": 0,
        }

    def _greedy(self, messages: list[dict[str, str]], counted: bool = False) -> Greedy:
        """counted: cached tokens from /metrics where the server gives none."""
        body = self._body(messages, GREEDY_TOKENS) | {
            "logprobs": True,
            "top_logprobs": TOP_LOGPROBS,
            "return_tokens_as_token_ids": True,
        }
        before = self._metrics() if counted and self._counts_from_metrics else None
        answer = parse_greedy(self._post(body))
        if before is None:
            return answer
        return replace(answer, cached_tokens=attributed_hits(before, self._metrics(), answer.prompt_tokens))

    def _post(self, body: dict[str, Any]) -> bytes:
        answer = once_more(
            lambda: fetch(
                self.transport,
                self.expected.port,
                PATH,
                timeout=self.timeout_s,
                api_key=self.api_key,
                json_body=body,
                address=self.expected.address,
            )
        )
        if answer.status != 200:
            raise ServerFault(f"POST {PATH} answered {answer.status}: {excerpt(answer.text)}")
        return answer.body
