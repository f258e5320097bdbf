"""The answer checks: a short chat completion, plain and streamed, must come back as a client expects.

docs/verify.md (Answers) says why and what each check asks.
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

ANSWER_TIMEOUT_S = 60.0  # per request, enough for the first batch after a cold start
MAX_TOKENS = 8
FINISH_REASONS = ("stop", "length", "tool_calls")
PATH = "/v1/chat/completions"
T = TypeVar("T")


@dataclass(frozen=True)
class AnswerCheck:
    """One request's verdict in one line. ran=False says nothing against the server; figures are what a serving
    check judged on."""

    name: str
    ok: bool
    detail: str
    ran: bool = True
    figures: Mapping[str, object] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.name}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.name,
            "ok": self.ok,
            "detail": self.detail,
            "ran": self.ran,
            "figures": asdict(self)["figures"],
        }


class NotRun(Exception):
    """The check could not tell, through no fault of the server."""


def unanswered(error: BaseException) -> bool:
    """No answer at all, as opposed to a wrong one (BadAnswer)."""
    return isinstance(error, (OSError, TransportError)) and not isinstance(error, BadAnswer)


def once_more(request: Callable[[], T]) -> T:
    """request(), sent once more when it got no answer."""
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
    """An answer a client cannot use."""


def request_body(expected: Expected) -> dict[str, Any]:
    """Greedy and short, so a check costs the server next to nothing."""
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
    """Both checks, in order; never raises. After one that got no answer the next is not sent."""
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
    """The non-streaming check alone, as the deploy's soak sends it."""
    return _run("completion", _completion, transport, expected, api_key, timeout_s)


def failed(checks: Sequence[AnswerCheck]) -> str | None:
    """One line naming every failed check; None when all passed."""
    bad = [c.line() for c in checks if not c.ok]
    return "; ".join(bad) if bad else None


def _run(name: str, fn: Any, transport: Transport, expected: Expected, api_key: str | None,
         timeout_s: float) -> AnswerCheck:  # fmt: skip
    try:
        return AnswerCheck(name, True, once_more(lambda: fn(transport, expected, api_key, timeout_s)))
    except (_Wrong, BadAnswer, HttpStatusError) as wrong:
        return AnswerCheck(name, False, excerpt(str(wrong), 300))
    except Exception as error:  # whatever the request met is this check's result
        if unanswered(error):
            return not_run(name, error)
        return AnswerCheck(name, False, excerpt(f"{type(error).__name__}: {error}", 300))


def _completion(transport: Transport, expected: Expected, api_key: str | None, timeout_s: float) -> str:
    answer = fetch(
        transport,
        expected.port,
        PATH,
        timeout=timeout_s,
        api_key=api_key,
        json_body=request_body(expected),
        address=expected.address,
    )
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
    # A reasoning parser may move all the text to reasoning, and the text may be empty.
    texts = [message[k] for k in ("content", "reasoning", "reasoning_content") if isinstance(message.get(k), str)]
    if not texts and not message.get("tool_calls"):
        raise _Wrong(f"POST {PATH} choice 0 carries no text and no tool call: {excerpt(json.dumps(message))}")
    finish = _finish_reason(choice.get("finish_reason"))
    prompt, completion = _usage(doc.get("usage"))
    said = next((t for t in texts if t), "" if texts else "a tool call")
    return f"{completion} tokens ({finish}) for a {prompt}-token prompt: {excerpt(said, 40)!r}"


def _stream(transport: Transport, expected: Expected, api_key: str | None, timeout_s: float) -> str:
    got = stream_chat(
        transport, expected.port, request_body(expected), api_key=api_key, timeout=timeout_s, address=expected.address
    )
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
    """(prompt tokens, completion tokens) as the server counted them."""
    if not isinstance(usage, dict):
        raise _Wrong("no usage counts in the answer")
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not (isinstance(prompt, int) and prompt > 0):
        raise _Wrong(f"usage.prompt_tokens is {excerpt(json.dumps(prompt), 20)}, not a positive count")
    if not (isinstance(completion, int) and 0 < completion <= MAX_TOKENS):
        raise _Wrong(
            f"usage.completion_tokens is {excerpt(json.dumps(completion), 20)}, not 1..{MAX_TOKENS} "
            f"(max_tokens {MAX_TOKENS})"
        )
    return prompt, completion
