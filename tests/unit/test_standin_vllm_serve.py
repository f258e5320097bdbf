"""The stand-in `vllm serve` on loopback: argparse rejections, loading, endpoints, auth, prefix caching, death, keep-alive."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpufleet import sandbox
from gpufleet.health import HealthState, check
from gpufleet.sandbox.image import write_tiny_model
from gpufleet.vllm import flags as vllm_flags
from gpufleet.wire.identity import Expected
from tests.loopback import LoopbackTransport
from tests.ports import free_port

SERVE = Path(sandbox.__file__).parent / "standin" / "vllm_serve.py"
HELP = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "serve-help-all.txt"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / "tiny"
    write_tiny_model(d)
    return d


def _serve(*args: str, env: dict | None = None, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SERVE), "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "STANDIN_LOAD_SECONDS": "0", **(env or {})},
    )


class Server:
    def __init__(self, model: Path, *args: str, env: dict | None = None, load: float = 0.0):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVE), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "STANDIN_LOAD_SECONDS": str(load), **(env or {})},
        )

    def wait(self, timeout: float = 10) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise AssertionError("stand-in never listened")

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def chat(self, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(
            self.base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)


@pytest.fixture
def server(model):
    started: list[Server] = []

    def start(*args: str, **kw) -> Server:
        s = Server(model, *args, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.stop()


def test_flag_table_is_generated_from_the_recorded_help():
    assert json.loads(vllm_flags.FLAGS_JSON.read_text()) == vllm_flags.parse_help(HELP.read_text())
    flags = {n: f for f in vllm_flags.parse_help(HELP.read_text())["flags"] for n in f["names"]}
    assert flags["--performance-mode"]["choices"] == ["balanced", "interactivity", "throughput"]
    assert flags["--port"]["type"] == "int" and flags["--served-model-name"]["nargs"] == "+"
    assert flags["-pp"] is flags["--pipeline-parallel-size"]
    assert flags["--enable-prefix-caching"]["kind"] == "bool"
    assert flags["--tool-call-parser"]["choices"][-1] == "xlam" and flags["--tool-call-parser"]["open"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--performance-mode", "fast"], "argument --performance-mode: invalid choice: 'fast'"),
        (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
        (["--mamba-cache-mode", "all"], "argument --mamba-cache-mode: invalid choice: 'all'"),  # 0.32 knows align|none
        (["--max-model"], "unrecognized arguments: --max-model"),  # no abbreviations, like vLLM
        (["--max-model-len", "lots"], "argument --max-model-len: invalid human_readable_int value: 'lots'"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(model, args, named):
    out = _serve(str(model), *args)
    assert out.returncode == 2
    assert out.stderr.startswith("usage: vllm serve [model_tag] [options]\n")
    assert named in out.stderr


def test_an_older_vllm_rejects_a_newer_flag(model):
    out = _serve(str(model), "--performance-mode", "interactivity", env={"STANDIN_UNKNOWN_FLAGS": "--performance-mode"})
    assert out.returncode == 2 and "unrecognized arguments: --performance-mode" in out.stderr


def test_model_without_config_json_exits_1(tmp_path):
    out = _serve("--model", str(tmp_path))
    assert out.returncode == 1
    assert f"Invalid repository ID or local directory specified: '{tmp_path}'" in out.stderr


def test_refuses_connections_while_loading_then_serves(server, model):
    s = server("--served-model-name", "qwen3.5-awq", "--max-model-len", "225000", load=1.5)
    time.sleep(0.5)
    assert s.proc.poll() is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", s.port), timeout=1)
    s.wait()
    assert s.get("/health") == (200, b"")
    models = json.loads(s.get("/v1/models")[1])["data"]
    assert [(m["id"], m["root"], m["max_model_len"]) for m in models] == [("qwen3.5-awq", str(model), 225000)]
    assert json.loads(s.get("/version")[1])["version"].startswith("0.32")


def test_seed_flags_are_accepted(server):
    seed = [
        "--served-model-name",
        "qwen3.5-awq",
        "--max-model-len",
        "225000",
        "--max-num-batched-tokens",
        "8192",
        "--pipeline-parallel-size",
        "3",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--max-num-seqs",
        "2",
        "--tool-call-parser",
        "qwen3_coder",
        "--reasoning-parser",
        "qwen3",
        "--enable-auto-tool-choice",
        "--optimization-level",
        "3",
        "--enable-prefix-caching",
        "--trust-remote-code",
        "--language-model-only",
        "--performance-mode",
        "interactivity",
        "--mamba-cache-mode",
        "align",
        "--mamba-block-size",
        "8",
        "--enable-chunked-prefill",
        "--async-scheduling",
        "--override-generation-config",
        '{"temperature": 0.6}',
    ]
    s = server(*seed).wait()
    assert s.get("/health")[0] == 200
    assert 'mamba_cache_mode="align"' in s.get("/metrics")[1].decode()


def test_prefix_caching_counts_block_aligned_hits(server):
    s = server("--served-model-name", "m", "--enable-prompt-tokens-details", "--block-size", "16").wait()
    convo = [{"role": "user", "content": "x" * 100}]
    first = json.loads(s.chat({"model": "m", "messages": convo})[1])["usage"]
    second = json.loads(s.chat({"model": "m", "messages": convo})[1])["usage"]
    length = first["prompt_tokens"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": (length - 1) // 16 * 16}
    grown = convo + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    third = json.loads(s.chat({"model": "m", "messages": grown})[1])["usage"]
    # the grown conversation starts with the whole first prompt (it ended in the assistant header)
    assert third["prompt_tokens"] > length
    assert third["prompt_tokens_details"]["cached_tokens"] == (length - 1) // 16 * 16
    metrics = s.get("/metrics")[1].decode()
    hits = second["prompt_tokens_details"]["cached_tokens"] + third["prompt_tokens_details"]["cached_tokens"]
    for line in (
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {float(hits)}',
        f'vllm:prompt_tokens_cached_total{{engine="0",model_name="m"}} {float(hits)}',
        'vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 3.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3.0',
    ):
        assert line in metrics
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:request_prefill_kv_computed_tokens_sum",
    ):
        assert f"\n{name}{{" in metrics
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
    for label in ('block_size="16"', 'enable_prefix_caching="True"', 'mamba_cache_mode="none"', 'cache_dtype="auto"'):
        assert label in info


def test_no_cached_tokens_field_without_the_flag_and_no_hits_without_prefix_caching(server):
    s = server("--served-model-name", "m", "--no-enable-prefix-caching").wait()
    body = {"model": "m", "messages": [{"role": "user", "content": "y" * 200}]}
    s.chat(body)
    usage = json.loads(s.chat(body)[1])["usage"]
    assert usage["prompt_tokens_details"] is None
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0' in s.get("/metrics")[1].decode()


def test_streaming_sse_with_usage(server):
    s = server("--served-model-name", "m", "--enable-prompt-tokens-details").wait()
    status, raw = s.chat(
        {
            "model": "m",
            "stream": True,
            "max_tokens": 3,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    events = [e[len("data: ") :] for e in raw.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]][1:]
    assert len(deltas) == 3 and all(deltas)  # one token a chunk
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    # the same greedy answer as without streaming
    plain = json.loads(s.chat({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})[1])
    assert "".join(deltas) == plain["choices"][0]["message"]["content"]


def test_api_key_guards_v1_only(server):
    s = server("--served-model-name", "m", env={"VLLM_API_KEY": "sekrit"}).wait()
    assert s.get("/v1/models")[0] == 401
    assert s.get("/v1/models", {"Authorization": "Bearer sekrit"})[0] == 200
    assert s.chat({"model": "m", "messages": []})[0] == 401
    assert s.get("/health")[0] == 200 and s.get("/metrics")[0] == 200 and s.get("/version")[0] == 200


def test_unknown_model_is_404(server):
    s = server("--served-model-name", "m").wait()
    status, body = s.chat({"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and "The model `other` does not exist." in body.decode()


def test_engine_death_503_then_exit_1(server):
    s = server("--served-model-name", "m", env={"STANDIN_DIE_AFTER": "0.5", "STANDIN_DEAD_SECONDS": "1.5"}).wait()
    assert s.get("/health")[0] == 200
    time.sleep(0.8)
    assert s.get("/health")[0] == 503
    assert s.proc.wait(10) == 1
    assert "EngineDeadError" in s.proc.stdout.read()


def test_a_different_suffix_reuses_only_the_common_whole_blocks(server):
    s = server("--served-model-name", "m", "--enable-prompt-tokens-details").wait()
    header = 3  # "<|im_start|>", "user", "\n"
    s.chat({"model": "m", "messages": [{"role": "user", "content": "x" * 160}]})
    usage = json.loads(s.chat({"model": "m", "messages": [{"role": "user", "content": "x" * 120 + "z" * 40}]})[1])[
        "usage"
    ]
    # the stand-in's words are tokens of up to 4 characters: 30 tokens of "xxxx" in common after the header
    assert usage["prompt_tokens_details"]["cached_tokens"] == (header + 120 // 4) // 16 * 16 == 32


@pytest.mark.parametrize(
    ("mode", "detail"),
    [
        ("models-not-json", "/v1/models is not JSON: <html><head><title>502 Bad Gateway</title>"),
        ("not-http", "GET /health: the port does not answer HTTP: -ERR unknown command 'GET'"),
    ],
)
def test_misbehaving_modes_are_what_the_health_checks_call_misconfigured(server, mode, detail):
    # The sandbox image tags of the same names run these: the deploy must roll them back, not crash on them.
    s = server("--served-model-name", "m", env={"STANDIN_MISBEHAVE": mode}).wait()
    report = check(LoopbackTransport(s.proc), Expected("vllm", s.port, "m"), timeout_s=5)
    assert report.state is HealthState.MISCONFIGURED, report.detail
    assert report.detail.startswith(detail), report.detail


# --- keep-alive, as uvicorn: the host snapshot's curl --next asks /health, /v1/models and /metrics on one connection
def _ask(conn: http.client.HTTPConnection, method: str, path: str, body: dict | bytes | None = None, **headers: str):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers=headers)
    r = conn.getresponse()
    return r.status, r.read(), r


def test_one_connection_carries_every_request(server):
    s = server("--served-model-name", "m", env={"VLLM_API_KEY": "sekrit"}).wait()
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    auth = {"Authorization": "Bearer sekrit"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _ask(conn, "GET", "/health")[0] == 200
    sock = conn.sock
    assert json.loads(_ask(conn, "GET", "/v1/models", **auth)[1])["data"][0]["id"] == "m"
    assert b"vllm:cache_config_info{" in _ask(conn, "GET", "/metrics")[1]
    assert json.loads(_ask(conn, "POST", "/v1/chat/completions", chat, **auth)[1])["usage"]["completion_tokens"] == 2
    # answers given before the body was looked at still read it all: it must not be parsed as the next request
    assert _ask(conn, "POST", "/v1/chat/completions", chat)[0] == 401
    assert _ask(conn, "POST", "/v1/completions", chat, **auth)[0] == 404
    assert _ask(conn, "POST", "/v1/chat/completions", b"{not json", **auth)[0] == 400
    assert _ask(conn, "POST", "/v1/chat/completions", {**chat, "model": "x"}, **auth)[0] == 404
    assert _ask(conn, "GET", "/nowhere")[0] == 404
    status, body, r = _ask(conn, "GET", "/health")
    assert (status, body, r.will_close) == (200, b"", False)
    assert conn.sock is sock  # http.client reconnects when the server closes: it never had to


def test_kept_alive_answers_are_not_delayed(server):
    # Head and body written apart waited for the client's delayed ACK: ~40 ms a request on a kept-alive connection.
    s = server("--served-model-name", "m").wait()
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    start = time.monotonic()
    for _ in range(30):
        for path in ("/health", "/v1/models", "/metrics"):
            assert _ask(conn, "GET", path)[0] == 200
    assert time.monotonic() - start < 1.5


@pytest.mark.skipif(not shutil.which("curl"), reason="no curl here")
def test_curl_next_asks_everything_on_one_connection(server):
    s = server("--served-model-name", "m").wait()
    out = subprocess.run(
        [
            "curl",
            "-sv",
            "--max-time",
            "5",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}\\n",
            f"{s.base}/health",
            "--next",
            "-s",
            "--max-time",
            "5",
            f"{s.base}/v1/models",
            "--next",
            "-s",
            "--max-time",
            "5",
            f"{s.base}/metrics",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("200\n{") and "vllm:cache_config_info{" in out.stdout
    assert out.stderr.count("Re-using existing connection") == 2
    assert out.stderr.count("Connected to") == 1


def test_streaming_closes_its_connection(server):
    s = server("--served-model-name", "m").wait()
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    assert _ask(conn, "GET", "/health")[0] == 200
    body = {"model": "m", "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, raw, r = _ask(conn, "POST", "/v1/chat/completions", body)
    assert status == 200 and r.will_close and raw.endswith(b"data: [DONE]\n\n")
    assert r.getheader("content-length") is None and r.getheader("connection") == "close"
    assert _ask(conn, "GET", "/health")[0] == 200  # on a new connection


def _exchange(port: int, data: bytes) -> bytes:
    """What the server sends on one raw connection, up to its close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_body_that_cannot_be_framed_closes_the_connection(server):
    s = server("--served-model-name", "m").wait()
    then = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # never answered: the connection closed before it
    bad_length = _exchange(
        s.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: lots\r\n\r\n" + then
    )
    assert bad_length.startswith(b"HTTP/1.1 400 ") and bad_length.count(b"HTTP/1.1") == 1
    chunked = _exchange(
        s.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
        + then,
    )
    assert chunked.startswith(b"HTTP/1.1 404 ") and chunked.count(b"HTTP/1.1") == 1


def test_idle_connections_are_dropped_and_do_not_delay_the_stop(server):
    s = server("--served-model-name", "m", env={"STANDIN_KEEP_ALIVE_S": "0.5"}).wait()
    idle = socket.create_connection(("127.0.0.1", s.port), timeout=5)  # never sends anything
    answered = _exchange(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # returns once the server closes
    assert answered.startswith(b"HTTP/1.1 200 ") and answered.endswith(b"\r\n\r\n")
    assert idle.recv(1) == b""
    kept = [http.client.HTTPConnection("127.0.0.1", s.port, timeout=5) for _ in range(3)]
    for conn in kept:
        assert _ask(conn, "GET", "/health")[0] == 200
    start = time.monotonic()
    s.proc.terminate()  # docker stop: SIGTERM, with kept-alive connections still open
    assert s.proc.wait(5) == 0 and time.monotonic() - start < 1
    log = s.proc.stdout.read()
    assert "Traceback" not in log and "timed out" not in log


def test_not_http_answers_one_line_then_closes(server):
    s = server("--served-model-name", "m", env={"STANDIN_MISBEHAVE": "not-http"}).wait()
    two = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    assert _exchange(s.port, two) == b"-ERR unknown command 'GET', with args beginning with: '/health'\r\n"
