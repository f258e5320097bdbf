"""Readiness, identity and the probe against a real dense vLLM (Qwen2-style tiny model): caching on vs off."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from gpufleet.health import HealthState, check, wait_until_ready
from gpufleet.health.answers import check_answers, failed
from gpufleet.health.probe import probe
from gpufleet.health.probe_report import Verdict
from gpufleet.remote.transport import SshTransport
from gpufleet.wire.identity import Expected
from tests.vllm.servers import ServerSpec, Started, expected
from tests.vllm_peer import models

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
API_KEY = "sk-gf-test-0d3c"
# vLLM's default --max-num-batched-tokens for a server on the CPU (engine/arg_utils.py, get_batch_defaults).
CPU_DEFAULT_BATCH = 2048


@pytest.fixture(scope="module")
def dense(pair_factory, tmp_path_factory) -> dict[str, Started]:
    model = models.build_dense(tmp_path_factory.mktemp("models") / "dense")
    on, off = pair_factory(
        [
            # The reasoning parser moves all text into `reasoning` (content null): the checks must not need content.
            ServerSpec(
                "on", model, ["--enable-prefix-caching", "--reasoning-parser", "qwen3"], expected(enable_prefix_caching="True")
            ),
            # With --api-key: /v1/* needs the key, /health and /metrics do not.
            ServerSpec(
                "off", model, ["--no-enable-prefix-caching"], expected(enable_prefix_caching="False"), api_key=API_KEY
            ),
        ]
    )  # fmt: skip
    return {"on": on, "off": off}


def test_loading_server_is_starting_not_ready(dense):
    # Checked right after spawn: vLLM refuses connections while it loads, the process runs.
    for s in dense.values():
        assert s.while_loading.state is HealthState.STARTING, s.while_loading.detail
        assert "not answering" in s.while_loading.detail


def test_ready_report_carries_identity_and_load(dense):
    r = check(dense["on"].transport, dense["on"].expected)
    assert r.state is HealthState.READY, r.detail
    assert r.served_model == "tiny"
    assert r.max_model_len == 4096
    assert r.vllm_version and r.vllm_version.startswith("0.32")
    assert r.cache_config["block_size"] == "128"
    assert r.kv_cache_usage is not None and 0.0 <= r.kv_cache_usage <= 1.0
    assert (r.running, r.waiting) == (0, 0)


def test_wrong_served_name_is_misconfigured(dense):
    s = dense["on"]
    want = Expected("vllm", s.server.port, "qwen35", 4096, {"enable_prefix_caching": "True"})
    r = check(s.transport, want)
    assert r.state is HealthState.MISCONFIGURED
    assert "serves tiny, expected qwen35" in r.detail
    # wait_until_ready does not wait for what waiting cannot fix.
    t0 = time.monotonic()
    assert wait_until_ready(s.transport, want, timeout_s=60).state is HealthState.MISCONFIGURED
    assert time.monotonic() - t0 < 5


def test_wrong_max_model_len_and_cache_label_are_misconfigured(dense):
    s = dense["off"]
    want = Expected("vllm", s.server.port, "tiny", 8192, {"enable_prefix_caching": "True"})
    r = check(s.transport, want, api_key=API_KEY)
    assert r.state is HealthState.MISCONFIGURED
    assert "max_model_len 4096, expected 8192" in r.detail
    assert "enable_prefix_caching=False, expected True" in r.detail


def test_api_key_is_needed_for_identity_not_for_liveness(dense):
    s = dense["off"]
    without = check(s.transport, s.expected)
    assert without.state is HealthState.MISCONFIGURED and "401" in without.detail
    assert check(s.transport, s.expected, api_key=API_KEY).state is HealthState.READY
    assert check(s.transport, s.expected, api_key="sk-wrong").state is HealthState.MISCONFIGURED


def test_reasoning_parser_leaves_content_empty_and_probe_still_reads_reply(dense):
    s = dense["on"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "cache block token"}], "max_tokens": 8}
    conn = s.transport.http(s.server.port, 30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    message = json.loads(conn.getresponse().read())["choices"][0]["message"]
    conn.close()
    assert not message.get("content")
    assert message.get("reasoning")


def test_answer_checks_pass_on_real_vllm_twenty_runs_in_a_row(dense):
    # Both servers: the reasoning parser's (content null, text in reasoning) and the key-guarded one.
    for s in dense.values():
        for run in range(20):
            checks = check_answers(s.transport, s.expected, api_key=s.api_key)
            assert failed(checks) is None, (s.transport.name, run, checks)


def test_answer_checks_fail_on_real_vllm_when_the_request_cannot_be_served(dense):
    s = dense["off"]
    wrong_key = check_answers(s.transport, s.expected, api_key="sk-wrong")
    assert [c.ok for c in wrong_key] == [False, False] and all("401" in c.detail for c in wrong_key), wrong_key
    other_model = check_answers(s.transport, Expected("vllm", s.server.port, "qwen35"), api_key=API_KEY)
    assert [c.ok for c in other_model] == [False, False] and all("404" in c.detail for c in other_model), other_model


def test_probe_reports_hits_on_turn_n_plus_1_with_prefix_caching(dense):
    s = dense["on"]
    report = probe(s.transport, s.expected, max_num_batched_tokens=CPU_DEFAULT_BATCH)
    print("\n[probe dense on]", json.dumps(report.as_dict(), indent=1))
    assert report.verdict is Verdict.EFFECTIVE, report.evidence
    assert report.unit == 128
    assert [p.chunks for p in report.points if p.kind == "multi-chunk"] == [2]  # 2.5 chunks exceed max_model_len
    assert any("skipped 2.5 x 2048" in w for w in report.warnings)
    for p in report.points:
        assert p.cold_cached_tokens == 0  # turn N was cold: the seed makes each conversation unique
        assert p.cached_tokens >= p.due_tokens > 0
        assert p.source == "usage"
    assert report.hit_ratio > 0.3
    assert report.legal is not None and report.legal.prefix_match_unit is None  # one KV cache group: no unit
    for t in report.session:
        assert t.usage_cached == t.metrics_hits and t.metrics_computed == t.reprocessed_tokens


def test_probe_says_ineffective_without_prefix_caching(dense):
    s = dense["off"]
    report = probe(s.transport, s.expected, lengths_in_units=(1.5, 2.5, 3.5), api_key=API_KEY, lengths_in_chunks=())
    print("\n[probe dense off]", json.dumps(report.as_dict(), indent=1))
    assert report.verdict is Verdict.INEFFECTIVE
    assert "prefix caching is disabled" in report.detail
    assert all(p.cached_tokens == 0 and p.due_tokens > 0 for p in report.points)
    # Every session turn re-processes its whole prompt.
    assert [t.reprocessed_share for t in report.session] == [1.0] * 4
    assert report.reprocessed_per_turn == sorted(t.prompt_tokens for t in report.session[1:])[1]


class _TunnelToLocalServer(SshTransport):
    """HTTP through the real sshd's direct-tcpip channel; the "container" is the local server process.

    (The docker query over SSH needs a docker daemon: tests/integration covers it on the test hosts.)
    """

    def __init__(self, client, started: Started):
        super().__init__(client, name="ssh-loopback")
        self._local = started.transport

    def container(self, service):
        return self._local.container(service)

    def logs(self, service, tail=30):
        return self._local.logs(service, tail)


def test_checks_and_probe_through_ssh(dense, sshd):
    s = dense["on"]
    client = sshd.client()
    try:
        t = _TunnelToLocalServer(client, s)
        r = check(t, s.expected)
        assert r.state is HealthState.READY, r.detail
        assert (r.served_model, r.max_model_len, r.vllm_version) == ("tiny", 4096, "0.32.0")
        wrong = Expected("vllm", s.server.port, "qwen35", 4096, {})
        assert check(t, wrong).state is HealthState.MISCONFIGURED
        assert failed(check_answers(t, s.expected)) is None  # a client's requests, through the SSH channel
        report = probe(t, s.expected, lengths_in_units=(1.5, 2.5), lengths_in_chunks=(), session_turns=0)
        assert report.verdict is Verdict.EFFECTIVE, report.evidence
        # Nothing listens on another port: refused through the tunnel -> starting (the process runs).
        closed = Expected("vllm", _unused_port(), "tiny")
        assert check(t, closed).state is HealthState.STARTING
    finally:
        client.close()
    assert check(t, s.expected).state is HealthState.SSH_UNREACHABLE


def _unused_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Last in the module: it kills the "on" server's engine.
def test_killed_engine_is_dead_then_exited(dense):
    s = dense["on"]
    os.kill(s.server.engine_core_pid(), signal.SIGKILL)
    seen = []
    deadline = time.monotonic() + 60
    while s.server.proc.poll() is None and time.monotonic() < deadline:
        r = check(s.transport, s.expected)
        seen.append((r.state, r.detail))
        time.sleep(0.1)
    # The API server answers 503 (EngineDeadError) for a few seconds, then closes its port and exits. On a loaded
    # machine the 503 window can pass between two looks (seen once in a CI run: refused, then exited), so the looks
    # are held to that order of states, not to catching the window; the 503 -> dead mapping is unit-tested.
    assert s.server.proc.poll() is not None, "the API server did not exit after its engine died"
    allowed = {HealthState.READY, HealthState.DEAD, HealthState.STARTING}
    assert all(st in allowed for st, _ in seen), seen[-5:]
    assert all("503" in d or "exited" in d for st, d in seen if st is HealthState.DEAD), seen[-5:]
    first_dead = next((i for i, (st, _) in enumerate(seen) if st is HealthState.DEAD), None)
    # Once dead, never ready again.
    assert first_dead is None or all(st is not HealthState.READY for st, _ in seen[first_dead:]), seen[-5:]
    final = wait_until_ready(s.transport, s.expected, timeout_s=30)
    assert final.state is HealthState.DEAD and "exited" in final.detail
    assert final.logs, "a failed wait must carry the server's last log lines"
    assert list(final.logs) == s.server.log_path.read_text(errors="replace").splitlines()[-30:]
