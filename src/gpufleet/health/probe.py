"""Prompt re-processing probe: does the next turn of a conversation reuse the cache the last one left behind?

Judged by token counts over several lengths, since a hybrid's hits depend on how a prompt was split into prefill
chunks. docs/verify.md (The prompt re-processing probe) describes the measurements and verdicts.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence

from gpufleet.health.api import Completion, stream_chat
from gpufleet.health.cache_counters import cached_tokens, counter_delta, read_metrics, warn_if_busy
from gpufleet.health.conversation import Conversation, filler_text
from gpufleet.health.probe_measurements import ProbePoint, SessionTurn
from gpufleet.health.probe_report import ProbeReport, judge
from gpufleet.remote.transport import Transport
from gpufleet.wire.geometry import LegalFixes
from gpufleet.wire.identity import Expected
from gpufleet.wire.metrics import HITS, PREFILL_COMPUTED, QUERIES, Metrics

# In cache units, spread over L mod U. Two sit just past a block boundary, where a trapped hybrid still hits.
DEFAULT_LENGTHS_IN_UNITS = (1.05, 1.3, 1.6, 2.05, 2.45, 2.85)
DEFAULT_LENGTHS_IN_CHUNKS = (1.5, 2.5)  # of --max-num-batched-tokens
# vLLM's default on H200-class GPUs (EngineArgs.get_batch_defaults).
ASSUMED_MAX_NUM_BATCHED_TOKENS = 8192
SESSION_TURNS = 4  # turns N, N+1, N+2, N+3
SESSION_MESSAGE_UNITS = 0.4  # a tool output's size
REPLY_TOKENS = 16
MAX_TWINS = 3  # length measurements per point
TOLERANCE_TOKENS = 4


def request_bound(sweep_points: int, long_points: int, session_turns: int) -> int:
    """The most requests probe() sends."""
    per_point = MAX_TWINS + 2
    session = MAX_TWINS + session_turns if session_turns > 1 else 0
    return 2 + (sweep_points + long_points) * per_point + session


def probe(
    transport: Transport,
    expected: Expected,
    *,
    max_num_batched_tokens: int | None = None,
    lengths_in_units: Sequence[float] = DEFAULT_LENGTHS_IN_UNITS,
    api_key: str | None = None,
    run_id: str | None = None,
    timeout_s: float = 120.0,
    lengths_in_chunks: Sequence[float] = DEFAULT_LENGTHS_IN_CHUNKS,
    session_turns: int = SESSION_TURNS,
    time_budget_s: float = 900.0,
) -> ProbeReport:
    """Measure prompt re-processing on one host and judge its prefix cache.

    Sends at most request_bound(...) requests, one at a time, and starts none after time_budget_s. run_id keeps
    this run's conversations apart from earlier probes'.
    """
    run = _Run(transport, expected, api_key, timeout_s, run_id or os.urandom(4).hex(), time_budget_s)
    metrics = run.metrics()
    block = metrics.block_size or 0
    if not block:
        raise ValueError(f"{transport.name}: vllm:cache_config_info has no block_size")
    unit = metrics.prefix_match_unit or block
    mamba = metrics.cache_config.get("mamba_cache_mode")
    chunk = max_num_batched_tokens or ASSUMED_MAX_NUM_BATCHED_TOKENS
    if not max_num_batched_tokens and lengths_in_chunks:
        run.warnings.append(f"--max-num-batched-tokens not known: multi-chunk lengths assume {chunk}")
    run.calibrate()
    plan = [("sweep", units * unit, f"{units} units") for units in lengths_in_units]
    plan += [("multi-chunk", chunks * chunk, f"{chunks} x {chunk} batched tokens") for chunks in lengths_in_chunks]
    points = [
        run.point(i, kind, int(length), unit, chunk)
        for i, (kind, length, label) in enumerate(plan)
        if run.room_for(int(length), unit, label)
    ]
    session: list[SessionTurn] = []
    if session_turns > 1:
        session_points, session = run.session(unit, chunk, session_turns)
        points += session_points
    return judge(
        host=transport.name,
        points=points,
        block_size=block,
        unit=unit,
        prefix_caching=metrics.cache_config.get("enable_prefix_caching") == "True",
        mamba_cache_mode=mamba if mamba not in (None, "None", "none") else None,
        max_num_batched_tokens=max_num_batched_tokens,
        warnings=tuple(dict.fromkeys(run.warnings)),
        small_prompt_ttft_s=run.small_prompt_ttft_s,
        session=tuple(session),
        legal=LegalFixes.from_cache_config(metrics.cache_config),
        requests=run.requests,
        request_bound=request_bound(len(lengths_in_units), len(lengths_in_chunks), session_turns),
        elapsed_s=time.monotonic() - run.started,
    )


class _Run:
    """One probe run on one server: its request count, time budget and warnings."""

    CALIBRATION_WORDS = (20, 200)

    def __init__(
        self,
        transport: Transport,
        expected: Expected,
        api_key: str | None,
        timeout_s: float,
        run_id: str,
        budget_s: float,
    ):
        self.transport, self.port, self.model = transport, expected.port, expected.served_model_name
        self.address = expected.address
        self.api_key, self.timeout_s, self.run_id, self.budget_s = api_key, timeout_s, run_id, budget_s
        self.limit = (expected.max_model_len or 1 << 30) - 2 * REPLY_TOKENS - 64  # room for the turns' growth
        self.started = time.monotonic()
        self.requests = 0
        self.warnings: list[str] = []
        self.per_word = 1.0
        self.small_prompt_ttft_s: float | None = None
        self._long_prompt_tokens = 0  # set by calibrate()

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Completion:
        self.requests += 1
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        return stream_chat(
            self.transport, self.port, body, api_key=self.api_key, timeout=self.timeout_s, address=self.address
        )

    def metrics(self) -> Metrics:
        return read_metrics(self.transport, self.port, self.address)

    def calibrate(self) -> None:
        """Warm the server up and measure tokens per filler word. The long prompt goes first, so the short one's
        TTFT is a warm server's."""
        short_words, long_words = self.CALIBRATION_WORDS
        long = self.chat(Conversation(f"{self.run_id}-c2", "calibration", long_words).messages, 1)
        short = self.chat(Conversation(f"{self.run_id}-c1", "calibration", short_words).messages, 1)
        if not (short.prompt_tokens and long.prompt_tokens):
            raise ValueError(f"{self.transport.name}: the server reports no usage.prompt_tokens in streamed responses")
        self._long_prompt_tokens = long.prompt_tokens
        self.per_word = max((long.prompt_tokens - short.prompt_tokens) / (long_words - short_words), 0.1)
        self.small_prompt_ttft_s = short.ttft_s

    def room_for(self, target: int, unit: int, label: str) -> bool:
        """Whether `target` tokens fit the context, can hit at all, and fit the time budget."""
        if target > self.limit:
            self.warnings.append(f"skipped {label}: max_model_len leaves room for {self.limit} tokens")
        elif target <= unit:
            self.warnings.append(f"skipped {label}: a point that short cannot hit")
        elif time.monotonic() - self.started > self.budget_s:
            self.warnings.append(f"skipped {label}: time budget of {self.budget_s:.0f} s spent")
        else:
            return True
        return False

    def conversation(self, seed: str, filler: str, target: int) -> Conversation:
        """A conversation of `target` prompt tokens, its length measured on twins that share no cache with it."""
        long_words = self.CALIBRATION_WORDS[1]
        words = max(1, round(long_words + (target - self._long_prompt_tokens) / self.per_word))
        for attempt in range(MAX_TWINS):
            twin = self.chat(Conversation(f"{seed}t{attempt}", filler, words).messages, 1)
            miss = target - (twin.prompt_tokens or target)
            if abs(miss) <= TOLERANCE_TOKENS:
                break
            words = max(1, words + round(miss / self.per_word))
        return Conversation(f"{seed}r", filler, words)

    def point(self, i: int, kind: str, target: int, unit: int, chunk: int) -> ProbePoint:
        """Turn N of a fresh conversation, then turn N+1."""
        conv = self.conversation(f"{self.run_id}-{i}", f"filler-{i}", target)
        turn_n = self.chat(conv.messages, REPLY_TOKENS)
        before = self.metrics()
        warn_if_busy(before, self.warnings)
        turn_next = self.chat(conv.next_turn(turn_n.text), 2)
        cached, source = cached_tokens(turn_next, before, self.metrics())
        if (turn_n.cached_tokens or 0) > 0:
            self.warnings.append(f"turn N of point {i} was not cold ({turn_n.cached_tokens} cached)")
        return ProbePoint(
            prompt_tokens=turn_n.prompt_tokens or 0,
            next_prompt_tokens=turn_next.prompt_tokens or 0,
            unit=unit,
            cached_tokens=cached,
            cold_cached_tokens=turn_n.cached_tokens or 0,
            ttft_s=turn_n.ttft_s,
            next_ttft_s=turn_next.ttft_s,
            source=source,
            kind=kind,
            chunk_tokens=chunk,
        )

    def session(self, unit: int, chunk: int, turns: int) -> tuple[list[ProbePoint], list[SessionTurn]]:
        """One conversation over `turns` turns: the steps between them as points, and every turn."""
        growth = turns * (int(SESSION_MESSAGE_UNITS * unit) + 2 * REPLY_TOKENS + 16)
        # Start past one prefill chunk, where a coding agent lives, when the context allows it.
        start = int(1.5 * chunk) if 1.5 * chunk + growth <= self.limit else int(2.3 * unit)
        if not self.room_for(start + growth, unit, "the session"):
            return [], []
        rng = random.Random(f"{self.run_id}-session")
        message_words = max(1, round(SESSION_MESSAGE_UNITS * unit / self.per_word))
        messages = list(self.conversation(f"{self.run_id}-s", "session", start).messages)
        points: list[ProbePoint] = []
        session: list[SessionTurn] = []
        previous: Completion | None = None
        for turn in range(turns):
            before = self.metrics()
            warn_if_busy(before, self.warnings)
            completion = self.chat(messages, REPLY_TOKENS)
            after = self.metrics()
            cached, source = cached_tokens(completion, before, after)
            prompt = completion.prompt_tokens or 0
            previous_prompt = (previous.prompt_tokens or 0) if previous else 0
            session.append(
                SessionTurn(
                    turn=turn,
                    prompt_tokens=prompt,
                    cached_tokens=cached,
                    due_tokens=(previous_prompt - 1) // unit * unit if previous_prompt else 0,
                    usage_cached=completion.cached_tokens,
                    metrics_hits=counter_delta(before, after, HITS),
                    metrics_queries=counter_delta(before, after, QUERIES),
                    metrics_computed=counter_delta(before, after, PREFILL_COMPUTED),
                    ttft_s=completion.ttft_s,
                )
            )
            if previous is not None:
                points.append(
                    ProbePoint(previous_prompt, prompt, unit, cached, 0, previous.ttft_s, completion.ttft_s, source,
                               kind="session", chunk_tokens=chunk)
                )  # fmt: skip
            tool_output = filler_text(rng, message_words)
            messages += [
                {"role": "assistant", "content": completion.text},
                {"role": "user", "content": f"Tool output {turn + 1}: {tool_output}. What next?"},
            ]
            previous = completion
        return points, session
