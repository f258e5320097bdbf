"""The speed check: prefill, cached turn, decode and batch figures of one server (docs/verify.md, Speed)."""

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
DEFAULT_CONCURRENCY = 4  # when max-num-seqs is unset
MAX_CONCURRENCY = 16
# The batch's bound: its requests served one after another, times this, plus slack.
STALL_FACTOR = 5
STALL_SLACK_S = 10.0
HEALTH_EVERY_S = 0.5
REQUEST_TIMEOUT_S = 120.0
CALIBRATION_WORDS = 200
TURN_ROOM = 96  # tokens a next turn adds


class SpeedFault(ServerFault):
    """A stall, or a request that failed under load."""


def measure(
    transport: Transport,
    expected: Expected,
    served: Served,
    *,
    api_key: str | None = None,
    repeats: int = REPEATS,
    timeout_s: float = REQUEST_TIMEOUT_S,
    run_id: str | None = None,
) -> SpeedFigures:
    """The four stages on one server."""
    run = _Run(transport, expected, api_key, timeout_s, run_id or os.urandom(4).hex())
    words = run.words(served)
    concurrency = min(max(served.max_num_seqs or DEFAULT_CONCURRENCY, 2), MAX_CONCURRENCY)
    lengths, prefill, cached, decode, batch, single_s = [], [], [], [], [], []
    # A round holds one repeat of each stage, so a burst of load spoils no figure whole.
    for r in range(repeats):
        length, rate, ttfts = run.cold(words, r)
        lengths.append(length)
        prefill.append(rate)
        cached += ttfts
        rate, total = run.decode(r)
        decode.append(rate)
        single_s.append(total)
        batch.append(
            run.batch(concurrency, STALL_FACTOR * concurrency * statistics.median(single_s) + STALL_SLACK_S, r)
        )
    return SpeedFigures(
        tuple(prefill),
        tuple(cached),
        tuple(decode),
        tuple(batch),
        prompt_tokens=int(statistics.median(lengths)),
        decode_tokens=DECODE_TOKENS,
        concurrency=concurrency,
    )


def speed_check(
    transport: Transport,
    expected: Expected,
    served: Served,
    earlier: SpeedFigures | None,
    tolerance: float,
    *,
    api_key: str | None = None,
) -> tuple[AnswerCheck, SpeedFigures | None]:
    """measure(), held to the old version's figures."""
    try:
        figures = measure(transport, expected, served, api_key=api_key)
    except (ServerFault, BadAnswer, HttpStatusError) as wrong:
        return AnswerCheck(SPEED, False, excerpt(str(wrong), 300)), None
    except Exception as error:  # a request that got no answer
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

    def cold(self, words: int, r: int) -> tuple[int, float, list[float]]:
        """(prompt tokens, prefill tokens/s, each next turn's TTFT) of a cold prompt."""
        conversation = Conversation(f"{self.run_id}-{r}", "speed", words)
        cold = self._stream(conversation.messages, 8)
        length = _count(cold.prompt_tokens, "prompt_tokens")
        cached = [
            self._stream(conversation.next_turn(cold.text or "ok", f"And then, step {i + 1}?"), 1).ttft_s
            for i in range(FOLLOW_UPS)
        ]
        return length, length / max(cold.ttft_s, 1e-6), cached

    def decode(self, r: int) -> tuple[float, float]:
        """(tokens/s, seconds) of a fixed-length completion."""
        # Over the whole time, since a server may send its chunks in bursts.
        got = self._stream(self._short(f"decode-{r}"), DECODE_TOKENS, fixed=True)
        return _count(got.completion_tokens, "completion_tokens") / max(got.total_s, 1e-6), got.total_s

    def batch(self, n: int, bound_s: float, r: int) -> float:
        """Tokens/s of n completions at once; SpeedFault when one failed or outlasted bound_s."""
        results: dict[int, Completion | BaseException] = {}
        ended: dict[int, float] = {}
        start = time.monotonic()

        def send(i: int) -> None:
            try:
                results[i] = self._stream(self._short(f"batch-{r}-{i}"), DECODE_TOKENS, fixed=True, timeout_s=bound_s)
            except BaseException as error:  # judged below
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
            health = (
                f"/health answered 200 all along ({len(looks)} looks)"
                if not unhealthy
                else f"/health answered {unhealthy[0]} meanwhile"
            )
            raise SpeedFault(
                f"{len(stalled)} of {n} requests sent at once did not finish within {bound_s:.0f} s, "
                f"while {health}: the server stalls under load"
            )
        failed = [r for r in results.values() if isinstance(r, BaseException)]
        if failed:
            raise SpeedFault(
                f"{len(failed)} of {n} requests sent at once failed: {type(failed[0]).__name__}: {failed[0]}"
            )
        tokens = sum(
            _count(r.completion_tokens, "completion_tokens") for r in results.values() if isinstance(r, Completion)
        )
        return tokens / max(max(ended.values()) - start, 1e-6)

    # ---------------------------------------------------------------------------------------------- the requests
    def words(self, served: Served) -> int:
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

    def _stream(
        self, messages: list[dict[str, str]], max_tokens: int, fixed: bool = False, timeout_s: float | None = None
    ) -> Completion:
        body: dict[str, Any] = {
            "model": self.expected.served_model_name,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "seed": 0,
        }
        if fixed:  # exactly max_tokens tokens
            body |= {"ignore_eos": True, "min_tokens": max_tokens}
        return stream_chat(
            self.transport,
            self.expected.port,
            body,
            api_key=self.api_key,
            timeout=timeout_s or self.timeout_s,
            address=self.expected.address,
        )

    def _health(self) -> str:
        try:
            return str(get(self.transport, self.expected.port, "/health", timeout=5, address=self.expected.address)[0])
        except Exception as error:  # quoted in the fault
            return excerpt(f"{type(error).__name__}: {error}", 80)


def _count(value: int | None, name: str) -> int:
    if not isinstance(value, int) or value <= 0:
        raise SpeedFault(f"usage.{name} is {value!r} in a streamed answer: the speed check counts tokens by it")
    return value
