"""The speed check (gpufleet.health.speed) against real vLLM: the tiny dense model measured against itself 20 times
raises no false alarm at the default tolerance, and the same model started with a batch budget so small that a
prompt prefills in 256 times the steps fails, naming prefill (bench/speed_bench.py vllm: the distributions)."""

from __future__ import annotations

import pytest

from gpufleet.defaults import DEFAULTS, SPEED_TOLERANCE_SETTING
from gpufleet.health.serving import Served
from gpufleet.health.speed import measure
from gpufleet.wire.speed import FIGURES, compare, speed_ratios
from tests.vllm.servers import ServerSpec, Started, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
RUNS = 20
TOLERANCE = DEFAULTS[SPEED_TOLERANCE_SETTING]
FLAGS = ["--enable-prefix-caching", "--max-num-seqs", "2"]
CHUNK = 1024
SLOWED_CHUNK = CHUNK // 256  # prefill in 640 steps, not 3: ~0.1x the speed (docs/verify.md)
# Both servers get the same workload: the one the first one's settings give (a 2.5-chunk prompt, 2 at once).
SERVED = Served(max_num_batched_tokens=CHUNK, max_num_seqs=2)


@pytest.fixture(scope="module")
def servers(pair_factory, tmp_path_factory) -> dict[str, Started]:
    model = models.build_dense(tmp_path_factory.mktemp("models") / "dense")
    normal, slowed = pair_factory([
        ServerSpec("normal", model, [*FLAGS, "--max-num-batched-tokens", str(CHUNK)], expected()),
        ServerSpec("slowed", model, [*FLAGS, "--max-num-batched-tokens", str(SLOWED_CHUNK)], expected()),
    ])  # fmt: skip
    return {"normal": normal, "slowed": slowed}


def test_one_server_measured_against_itself_20_times_raises_no_false_alarm(servers):
    s = servers["normal"]
    first = measure(s.transport, s.expected, SERVED)
    runs = [measure(s.transport, s.expected, SERVED) for _ in range(RUNS)]
    print(f"\n[speed] first: {first.line()}")
    for name in FIGURES:
        ratios = [speed_ratios(first, now)[name] for now in runs]
        print(f"[speed] {name}: {RUNS} runs against the first, speed ratio {min(ratios):.2f}..{max(ratios):.2f}")
    alarms = [problem for now in runs if (problem := compare(first, now, TOLERANCE))]
    assert alarms == []
    # The workload the settings give: a prompt of 2-3 chunks (it fits max_model_len), 2 completions at once.
    assert 2 * CHUNK <= first.prompt_tokens <= 3 * CHUNK and first.concurrency == 2


def test_a_batch_budget_that_prefills_in_many_more_steps_fails_naming_prefill(servers):
    normal, slowed = servers["normal"], servers["slowed"]
    before = measure(normal.transport, normal.expected, SERVED)
    after = measure(slowed.transport, slowed.expected, SERVED)
    print(f"\n[speed] batch budget {CHUNK}: {before.line()}\n[speed] batch budget {SLOWED_CHUNK}: {after.line()}")
    problem = compare(before, after, TOLERANCE)
    assert problem is not None and "prefill " in problem, problem
