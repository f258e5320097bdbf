"""Does the server answer the way clients call it? /health and /v1/models say a server is up; only a completion says
it serves. A nightly can pass both and still fail its first real request (a crash in the first batch, a broken
stream, a tokenizer or chat-template regression), so a version is held to real answers before it is committed.

Two short greedy requests, as an OpenAI client sends them, each bounded in time and through the same transport
(the SSH channel) with the host's API key:

    completion   POST /v1/chat/completions: 200, a JSON object with a choice whose message carries text (content,
                 or reasoning with a reasoning parser) or tool calls, a known finish_reason, and usage counts
    stream       the same with stream=true: every `data:` chunk parses, a choice arrives, a finish_reason ends it,
                 usage comes in the last chunk and the stream closes with [DONE]

A request that got no answer at all is sent once more; with none again, its check could not run (`ran` false).

    >>> checks = check_answers(transport, Expected("vllm", 8000, "qwen35"), api_key=key)
    >>> [c.name for c in checks if not c.ok]
    []
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from gpufleet.health.api import HttpStatusError, fetch, stream_chat
from gpufleet.remote.transport import BadAnswer, Transport, TransportError
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.identity import Expected

ANSWER_TIMEOUT_S = 60.0  # per request: a few tokens from a served model, even the first batch after a cold start
MAX_TOKENS = 8
FINISH_REASONS = ("stop", "length", "tool_calls")
PATH = "/v1/chat/completions"
T = TypeVar("T")


@dataclass(frozen=True)
class AnswerCheck:
    """One request's verdict: `detail` is one line, what came back when it passed and what was wrong when not.
    ran=False: it could not run, which says nothing against the server. figures: what a serving check judged on
    (gpufleet.health.serving_rules' dataclasses by name), passed or not, for a GPU run to record."""

    name: str
    ok: bool
    detail: str
    ran: bool = True
    figures: Mapping[str, object] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.name}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.name, "ok": self.ok, "detail": self.detail, "ran": self.ran,
                "figures": asdict(self)["figures"]}


class NotRun(Exception):
    """The check could not tell, through nothing the server answered wrong (one line)."""


def unanswered(error: BaseException) -> bool:
    """No answer at all (a timeout, a refused or reset connection, the SSH link), not a wrong one (BadAnswer)."""
    return isinstance(error, (OSError, TransportError)) and not isinstance(error, BadAnswer)


def once_more(request: Callable[[], T]) -> T:
    """request(), sent again once when it got no answer; the second error stands."""
    try:
        return request()
    except Exception as error:
        if not unanswered(error):
            raise
    return request()


def not_run(name: str, error: BaseException) -> AnswerCheck:
    why = str(error) if isinstance(error, NotRun) else f"{type(error).__name__}: {error}"
    return AnswerCheck(name, False, excerpt(f"could not run: {why}", 300), ran=False)


class _Wrong(Exception):
    """What makes an answer not one a client can use (one line)."""


def request_body(expected: Expected) -> dict[str, Any]:
    """Greedy and short: the same few tokens every time, so a check costs the server next to nothing."""
    return {
        "model": expected.served_model_name,
        "messages": [{"role": "user", "content": "Reply with one word: are you ready?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": 0,
    }


def check_answers(
    transport: Transport,
    expected: Expected,
    api_key: str | None = None,
    timeout_s: float = ANSWER_TIMEOUT_S,
) -> tuple[AnswerCheck, ...]:
    """Both checks, in order; never raises for what the server (or the way to it) does. After one that got no answer
    the next is not sent."""
    found: list[AnswerCheck] = []
    for name, fn in (("completion", _completion), ("stream", _stream)):
        if found and not found[-1].ran:
            found.append(AnswerCheck(name, False, f"not sent: {found[-1].name} got no answer", ran=False))
        else:
            found.append(_run(name, fn, transport, expected, api_key, timeout_s))
    return tuple(found)


def check_completion(
    transport: Transport,
    expected: Expected,
    api_key: str | None = None,
    timeout_s: float = ANSWER_TIMEOUT_S,
) -> AnswerCheck:
    """The non-streaming check alone: the traffic the deploy's soak sends at a bounded rate."""
    return _run("completion", _completion, transport, expected, api_key, timeout_s)


def failed(checks: Sequence[AnswerCheck]) -> str | None:
    """One line naming every failed check with its evidence; None when all passed."""
    bad = [c.line() for c in checks if not c.ok]
    return "; ".join(bad) if bad else None


def _run(name: str, fn: Any, transport: Transport, expected: Expected, api_key: str | None,
         timeout_s: float) -> AnswerCheck:  # fmt: skip
    try:
        return AnswerCheck(name, True, once_more(lambda: fn(transport, expected, api_key, timeout_s)))
    except (_Wrong, BadAnswer, HttpStatusError) as wrong:  # what came back, said in one line already
        return AnswerCheck(name, False, excerpt(str(wrong), 300))
    except Exception as error:  # whatever the request met is this check's result
        if unanswered(error):
            return not_run(name, error)
        return AnswerCheck(name, False, excerpt(f"{type(error).__name__}: {error}", 300))


def _completion(transport: Transport, expected: Expected, api_key: str | None, timeout_s: float) -> str:
    answer = fetch(transport, expected.port, PATH, timeout_s, api_key, json_body=request_body(expected),
                   address=expected.address)
    if answer.status != 200:
        raise _Wrong(f"POST {PATH} answered {answer.status}: {excerpt(answer.text)}")
    try:
        doc = json.loads(answer.body)
    except (ValueError, RecursionError):
        raise _Wrong(f"POST {PATH} is not JSON: {excerpt(answer.text) or 'an empty body'}") from None
    if not isinstance(doc, dict):
        raise _Wrong(f"POST {PATH} is a JSON {type(doc).__name__}, not a completion object")
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _Wrong(f"POST {PATH} has no choice: {excerpt(answer.text)}")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _Wrong(f"POST {PATH} choice 0 has no message: {excerpt(json.dumps(choice))}")
    # The text is content, or reasoning when a reasoning parser took it all; it may be empty (a model may stop at
    # once), but a message without any text field and without tool calls is not an answer.
    texts = [message[k] for k in ("content", "reasoning", "reasoning_content") if isinstance(message.get(k), str)]
    if not texts and not message.get("tool_calls"):
        raise _Wrong(f"POST {PATH} choice 0 carries no text and no tool call: {excerpt(json.dumps(message))}")
    finish = _finish_reason(choice.get("finish_reason"))
    prompt, completion = _usage(doc.get("usage"))
    said = next((t for t in texts if t), "" if texts else "a tool call")
    return f"{completion} tokens ({finish}) for a {prompt}-token prompt: {excerpt(said, 40)!r}"


def _stream(transport: Transport, expected: Expected, api_key: str | None, timeout_s: float) -> str:
    # stream_chat raises BrokenAnswer for a chunk that does not parse, HttpStatusError for another status than 200.
    got = stream_chat(transport, expected.port, request_body(expected), api_key=api_key, timeout=timeout_s,
                      address=expected.address)
    if not got.chunks:
        raise _Wrong(f"POST {PATH} (stream) sent no chunk with a choice")
    finish = _finish_reason(got.finish_reason)
    if not got.done:
        raise _Wrong(f"POST {PATH} (stream) ended without data: [DONE] after {got.chunks} chunks")
    _prompt, completion = _usage({"prompt_tokens": got.prompt_tokens, "completion_tokens": got.completion_tokens})
    return f"{got.chunks} chunks, {completion} tokens ({finish}), first after {got.ttft_s:.2f} s"


def _finish_reason(value: object) -> str:
    if value not in FINISH_REASONS:
        raise _Wrong(f"finish_reason is {excerpt(json.dumps(value), 40)}, not one of {', '.join(FINISH_REASONS)}")
    return str(value)


def _usage(usage: object) -> tuple[int, int]:
    """(prompt tokens, completion tokens), both counted by the server: a reply of 1..MAX_TOKENS tokens."""
    if not isinstance(usage, dict):
        raise _Wrong("no usage counts in the answer")
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not (isinstance(prompt, int) and prompt > 0):
        raise _Wrong(f"usage.prompt_tokens is {excerpt(json.dumps(prompt), 20)}, not a positive count")
    if not (isinstance(completion, int) and 0 < completion <= MAX_TOKENS):
        raise _Wrong(f"usage.completion_tokens is {excerpt(json.dumps(completion), 20)}, not 1..{MAX_TOKENS} "
                     f"(max_tokens {MAX_TOKENS})")
    return prompt, completion
