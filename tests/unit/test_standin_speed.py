"""The speed check (gpufleet.health.speed) against the stand-in `vllm serve` on loopback: a good server passes against
itself; the sandbox tags `slow` (correct answers, prefill 20x slower, 0.4 s more per request) and
`stalls-under-load` (one request at a time is served, a second in flight never ends while /health answers) fail it;
and the sampling extensions the check sends (ignore_eos, min_tokens) work as vLLM's do."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from dataclasses import replace

import pytest
from rich.console import Console

from gpufleet.cli.health_tables import speed_table
from gpufleet.defaults import DEFAULTS, SPEED_TOLERANCE_SETTING
from gpufleet.health import speed
from gpufleet.health.answers import check_answers
from gpufleet.health.runner import HostTarget, check_host
from gpufleet.health.serving import Served
from gpufleet.health.speed import measure, speed_check
from gpufleet.remote.transport import ContainerInfo
from gpufleet.sandbox.image import TAGS
from gpufleet.wire.identity import Expected
from gpufleet.wire.speed import compare, speed_ratios
from tests.loopback import LoopbackTransport
from tests.unit import test_standin_vllm_serve as standin

model, server = standin.model, standin.server  # the stand-in's fixtures: its tiny model, servers stopped after

ARGS = ("--served-model-name", "m", "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len",
        "225000")  # fmt: skip
# A smaller chunk than the profile's 8192 keeps the slow tag's cold prompts short; the rules are the same.
SERVED = Served(max_num_batched_tokens=1024, max_num_seqs=2)
TOLERANCE = DEFAULTS[SPEED_TOLERANCE_SETTING]


def expected(s: standin.Server) -> Expected:
    return Expected("vllm", s.port, "m", 225000)


def test_the_good_tags_pass_against_each_other_and_record_their_workload(server):
    good, nightly = server(*ARGS, env=TAGS["good"]).wait(), server(*ARGS, env=TAGS["good-next"]).wait()
    first = measure(LoopbackTransport(), expected(good), SERVED)
    check, again = speed_check(LoopbackTransport(), expected(nightly), SERVED, first, TOLERANCE)
    assert check.ok and check.detail.endswith(f"within {TOLERANCE:.0%} of the earlier figures"), check.detail
    assert again is not None and compare(first, again, TOLERANCE) is None
    # A prompt of 2.5 chunks (within a few tokens), completions of a fixed length, max-num-seqs of them at once.
    assert 2 * 1024 < first.prompt_tokens <= 2.5 * 1024 and (first.decode_tokens, first.concurrency) == (64, 2)
    assert len(first.prefill_tokens_per_s) == 3 and len(first.cached_ttft_s) == 9 and len(first.batch_tokens_per_s) == 3
    # The stand-in decodes a token every 5 ms (STANDIN_DECODE_SECONDS_PER_TOKEN): the figure reads the server's pace.
    assert 50 < first.median("decode_tokens_per_s") <= 205, first.line()


def test_the_speed_tags_set_the_behaviour_they_are_named_after():
    assert TAGS["slow"]["STANDIN_MISBEHAVE"] == "slow"
    assert TAGS["stalls-under-load"]["STANDIN_MISBEHAVE"] == "stalls-under-load"


def test_slow_answers_right_and_fails_naming_prefill(server):
    good, slow = server(*ARGS).wait(), server(*ARGS, env=TAGS["slow"]).wait()
    assert all(c.ok for c in check_answers(LoopbackTransport(), expected(slow), timeout_s=10))
    before = measure(LoopbackTransport(), expected(good), SERVED, repeats=1)
    after = measure(LoopbackTransport(), expected(slow), SERVED, repeats=1)
    ratios = speed_ratios(before, after)
    assert ratios["prefill_tokens_per_s"] < 0.2 and after.median("cached_ttft_s") > 0.4, after.line()
    problem = compare(before, after, TOLERANCE)
    assert problem is not None and "prefill " in problem, problem


def test_stalls_under_load_fails_on_the_batch_while_health_answers(server, monkeypatch):
    monkeypatch.setattr(speed, "STALL_SLACK_S", 1.0)  # the bound: 5x two requests' time, plus this
    s = server(*ARGS, env=TAGS["stalls-under-load"]).wait()
    assert all(c.ok for c in check_answers(LoopbackTransport(), expected(s), timeout_s=10))  # one at a time: fine
    started = time.monotonic()
    check, figures = speed_check(LoopbackTransport(), expected(s), SERVED, None, TOLERANCE)  # SpeedFault's line
    assert time.monotonic() - started < 30
    assert (check.name, check.ok, figures) == ("speed", False, None)
    assert re.fullmatch(
        r"1 of 2 requests sent at once did not finish within \d+ s, while /health answered 200 all "
        r"along \(\d+ looks\): the server stalls under load",
        check.detail,
    ), check.detail
    assert s.get("/health") == (200, b"")


def test_a_second_request_in_flight_on_stalls_under_load_never_ends_and_stays_running(server):
    s = server(*ARGS, env=TAGS["stalls-under-load"]).wait()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "ignore_eos": True}
    first = threading.Thread(target=s.chat, args=(body,), daemon=True)
    first.start()
    time.sleep(0.05)  # the first is decoding (64 tokens, 5 ms each) when the second arrives
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=1)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()
    first.join(5)
    assert s.get("/health") == (200, b"")
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 1.0' in s.get("/metrics")[1].decode()


def test_ignore_eos_and_min_tokens_make_the_answer_as_long_as_asked(server):
    s = server("--served-model-name", "m").wait()

    def tokens(**body) -> int:
        status, raw = s.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
        assert status == 200, raw
        return json.loads(raw)["usage"]["completion_tokens"]

    assert tokens(max_tokens=64) == 16  # the "model" ends its answer after 16 tokens
    assert tokens(max_tokens=64, ignore_eos=True) == 64
    assert tokens(max_tokens=64, min_tokens=40) == 40
    assert tokens(max_tokens=8, min_tokens=40) == 8


# --- `gpufleet verify --checks speed`: held to what the ledger recorded for the digest that runs --------------------
REF = "reg:5000/vllm/vllm-openai@sha256:" + "a" * 64


class Container(LoopbackTransport):
    """The stand-in process as the container started from REF."""

    def container(self, service: str) -> ContainerInfo | None:
        return ContainerInfo(id="local", state="running", image=REF)


def test_verify_holds_a_host_to_the_figures_recorded_for_the_digest_it_runs(server):
    s = server(*ARGS, env=TAGS["good"]).wait()
    recorded = measure(LoopbackTransport(), expected(s), SERVED)
    target = HostTarget("gpu1", {}, expected(s), served=SERVED)
    result = check_host(
        target,
        transport=Container(),
        answer=True,
        checks=("speed", "cached-cold"),
        committed=lambda target, transport: (REF, recorded),
    )
    assert [(c.name, c.ok) for c in result.checks] == [("speed", True), ("cached-cold", True)], result.checks
    assert result.speed_earlier == recorded and result.speed is not None
    assert result.checks[0].detail.startswith("prefill "), result.checks[0].detail
    # Another digest runs than the one the figures were recorded for: nothing to hold it to.
    other = check_host(
        target,
        transport=Container(),
        answer=True,
        checks=("speed",),
        committed=lambda target, transport: (REF.replace("a", "b"), recorded),
    )
    assert other.speed_earlier is None
    assert other.checks[0].detail.startswith("no earlier figures on this host to compare: prefill "), other.checks
    # The table: each figure now, and in brackets the one recorded at commit where there is one.
    console = Console(record=True, width=200)
    console.print(speed_table([result, replace(other, target=replace(target, name="gpu2"))]))
    lines = {line.split()[1]: line for line in console.export_text().splitlines() if " gpu" in line}
    decode = "decode_tokens_per_s"
    assert f"{result.speed.median(decode):.0f} ({recorded.median(decode):.0f})" in lines["gpu1"], lines
    assert (
        other.speed is not None and f"{other.speed.median(decode):.0f} " in lines["gpu2"] and "(" not in lines["gpu2"]
    )
