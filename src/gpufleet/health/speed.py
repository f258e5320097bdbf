"""The speed check: how fast a server serves, measured through its transport (docs/verify.md, Speed).

    prefill  a cold prompt of PREFILL_CHUNKS prefill chunks: prompt tokens / time to first token
    cached   the next turn of that conversation, its prefix cached: time to first token
    decode   a greedy completion of DECODE_TOKENS tokens (ignore_eos): tokens after the first / their time
    batch    max-num-seqs of them at once while /health is polled: tokens / time; one that never ends is a stall

    >>> figures = measure(transport, expected, Served.from_spec(spec), api_key=key)
    >>> compare(old, figures, tolerance=0.35)  # None, or one line naming each slower figure and both values
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpufleet.health.answers import AnswerCheck
from gpufleet.health.api import Completion, HttpStatusError, get, stream_chat
from gpufleet.health.conversation import Conversation
from gpufleet.health.probe import ASSUMED_MAX_NUM_BATCHED_TOKENS
from gpufleet.health.serving import Served
from gpufleet.health.serving_rules import ServerFault
from gpufleet.remote.transport import BadAnswer, Transport
from gpufleet.wire.checks import SPEED
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.identity import Expected
from gpufleet.wire.speed import SpeedFigures, compare, verdict

__all__ = ["SpeedFault", "SpeedFigures", "compare", "measure", "speed_check"]

PREFILL_CHUNKS = 2.5
REPEATS = 3
FOLLOW_UPS = 3  # cached turns per cold prompt
DECODE_TOKENS = 64
DEFAULT_CONCURRENCY = 4  # max-num-seqs unset: vLLM's own default (256 or more) is no check's load
MAX_CONCURRENCY = 16
# The batch's bound: this many times its requests served one after another, plus room for a loaded machine.
STALL_FACTOR = 5
STALL_SLACK_S = 10.0
HEALTH_EVERY_S = 0.5
REQUEST_TIMEOUT_S = 120.0
CALIBRATION_WORDS = 200
TURN_ROOM = 96  # tokens the next turn adds to the cold prompt


class SpeedFault(ServerFault):
    """A stall, or a request failed under the batch's load, in one line."""


def measure(transport: Transport, expected: Expected, served: Served, *, api_key: str | None = None,
            repeats: int = REPEATS, timeout_s: float = REQUEST_TIMEOUT_S, run_id: str | None = None) -> SpeedFigures:
    """The four stages on one server. SpeedFault for a stall or a failure under load; other errors propagate."""
    run = _Run(transport, expected, api_key, timeout_s, run_id or os.urandom(4).hex())
    prompt_tokens, prefill, cached = run.prefill(served, repeats)
    decode, single_s = run.decode(repeats)
    concurrency = min(max(served.max_num_seqs or DEFAULT_CONCURRENCY, 2), MAX_CONCURRENCY)
    bound = STALL_FACTOR * concurrency * single_s + STALL_SLACK_S
    batch = tuple(run.batch(concurrency, bound) for _ in range(repeats))
    return SpeedFigures(prefill_tokens_per_s=prefill, cached_ttft_s=cached, decode_tokens_per_s=decode,
                        batch_tokens_per_s=batch, prompt_tokens=prompt_tokens, decode_tokens=DECODE_TOKENS,
                        concurrency=concurrency)


def speed_check(transport: Transport, expected: Expected, served: Served, earlier: SpeedFigures | None,
                tolerance: float, *, api_key: str | None = None) -> tuple[AnswerCheck, SpeedFigures | None]:
    """measure(), held to `earlier` (the old version's figures on this host) within `tolerance`. Never raises for
    what the server or the way to it does: that is a failed check, without figures."""
    try:
        figures = measure(transport, expected, served, api_key=api_key)
    except (ServerFault, BadAnswer, HttpStatusError) as wrong:
        return AnswerCheck(SPEED, False, excerpt(str(wrong), 300)), None
    except Exception as error:  # noqa: BLE001 - the transport's errors: a request that got no answer
        return AnswerCheck(SPEED, False, excerpt(f"{type(error).__name__}: {error}", 300)), None
    ok, line = verdict(earlier, figures, tolerance)
    return AnswerCheck(SPEED, ok, line), figures


@dataclass
class _Run:
    transport: Transport
    expected: Expected
    api_key: str | None
    timeout_s: float
    run_id: str

    def prefill(self, served: Served, repeats: int) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
        """(median prompt tokens, each prefill's tokens/s, each cached turn's TTFT)."""
        words = self._words(served)
        lengths, rates, cached = [], [], []
        for r in range(repeats):
            # A fresh seed opens each prompt: nothing of it is cached.
            conversation = Conversation(f"{self.run_id}-{r}", "speed", words)
            cold = self._stream(conversation.messages, 8)
            lengths.append(_count(cold.prompt_tokens, "prompt_tokens"))
            rates.append(lengths[-1] / max(cold.ttft_s, 1e-6))
            for i in range(FOLLOW_UPS):
                turn = conversation.next_turn(cold.text or "ok", f"And then, step {i + 1}?")
                cached.append(self._stream(turn, 1).ttft_s)
        return int(statistics.median(lengths)), tuple(rates), tuple(cached)

    def decode(self, repeats: int) -> tuple[tuple[float, ...], float]:
        """(each completion's decode tokens/s, the median time of one)."""
        rates, totals = [], []
        for r in range(repeats):
            got = self._stream(self._short(f"decode-{r}"), DECODE_TOKENS, fixed=True)
            tokens = _count(got.completion_tokens, "completion_tokens")
            if tokens < 2:
                raise SpeedFault(f"a completion asked for {DECODE_TOKENS} tokens with ignore_eos gave {tokens}: no "
                                 "decode rate can be measured")
            rates.append((tokens - 1) / max(got.total_s - got.ttft_s, 1e-6))
            totals.append(got.total_s)
        return tuple(rates), statistics.median(totals)

    def batch(self, n: int, bound_s: float) -> float:
        """n completions at once, /health polled until they end or bound_s passed: tokens per second. SpeedFault
        when one did not end (naming what /health said meanwhile) or failed."""
        results: dict[int, Completion | BaseException] = {}
        ended: dict[int, float] = {}
        start = time.monotonic()

        def send(i: int) -> None:
            try:
                results[i] = self._stream(self._short(f"batch-{i}"), DECODE_TOKENS, fixed=True, timeout_s=bound_s)
            except BaseException as error:  # noqa: BLE001 - judged below, on this thread's behalf
                results[i] = error
            ended[i] = time.monotonic()

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        looks: list[str] = []
        while len(ended) < n and time.monotonic() - start < bound_s + 2 * HEALTH_EVERY_S:
            looks.append(self._health())
            time.sleep(HEALTH_EVERY_S)
        for t in threads:
            t.join(max(start + bound_s + 5 - time.monotonic(), 0.1))
        unhealthy = [look for look in looks if look != "200"]
        stalled = [i for i in range(n) if i not in ended or isinstance(results.get(i), TimeoutError)]
        if stalled:
            health = (f"/health answered 200 all along ({len(looks)} looks)" if not unhealthy
                      else f"/health answered {unhealthy[0]} meanwhile")
            raise SpeedFault(f"{len(stalled)} of {n} requests sent at once did not finish within {bound_s:.0f} s, "
                             f"while {health}: the server stalls under load")
        failed = [r for r in results.values() if isinstance(r, BaseException)]
        if failed:
            raise SpeedFault(f"{len(failed)} of {n} requests sent at once failed: {type(failed[0]).__name__}: "
                             f"{failed[0]}")
        tokens = sum(_count(r.completion_tokens, "completion_tokens") for r in results.values()
                     if isinstance(r, Completion))
        return tokens / max(max(ended.values()) - start, 1e-6)

    # ---------------------------------------------------------------------------------------------- the requests
    def _words(self, served: Served) -> int:
        """Filler words for a cold prompt of PREFILL_CHUNKS chunks, within max_model_len."""
        chunk = served.max_num_batched_tokens or ASSUMED_MAX_NUM_BATCHED_TOKENS
        target = PREFILL_CHUNKS * chunk
        if self.expected.max_model_len:
            target = min(target, 0.95 * (self.expected.max_model_len - TURN_ROOM))
        sample = self._stream(Conversation(f"{self.run_id}-calibration", "speed", CALIBRATION_WORDS).messages, 1)
        per_word = max(_count(sample.prompt_tokens, "prompt_tokens") / CALIBRATION_WORDS, 0.1)
        return max(1, math.floor(target / per_word))

    def _short(self, label: str) -> list[dict[str, str]]:
        return Conversation(f"{self.run_id}-{label}", "speed-short", 20).messages

    def _stream(self, messages: list[dict[str, str]], max_tokens: int, fixed: bool = False,
                timeout_s: float | None = None) -> Completion:
        body: dict[str, Any] = {"model": self.expected.served_model_name, "messages": messages,
                                "max_tokens": max_tokens, "temperature": 0, "seed": 0}
        if fixed:  # vLLM's sampling extensions: exactly max_tokens tokens
            body |= {"ignore_eos": True, "min_tokens": max_tokens}
        return stream_chat(self.transport, self.expected.port, body, api_key=self.api_key,
                           timeout=timeout_s or self.timeout_s, address=self.expected.address)

    def _health(self) -> str:
        try:
            return str(get(self.transport, self.expected.port, "/health", timeout=5,
                           address=self.expected.address)[0])
        except Exception as error:  # noqa: BLE001 - quoted in the fault
            return excerpt(f"{type(error).__name__}: {error}", 80)


def _count(value: int | None, name: str) -> int:
    if not isinstance(value, int) or value <= 0:
        raise SpeedFault(f"usage.{name} is {value!r} in a streamed answer: the speed check counts tokens by it")
    return value
