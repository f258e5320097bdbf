#!/usr/bin/python3
"""Stand-in for `vllm serve` (the vllm/vllm-openai image's entrypoint), stdlib only.

It is what the sandbox's vLLM image runs, and it is testable on loopback directly:

    STANDIN_LOAD_SECONDS=0.5 python3 vllm_serve.py serve /models/m --served-model-name m --port 8123

Behaves like vLLM where gpufleet depends on it:
- argv is parsed with the flags, choices and aliases of the real `vllm serve --help=all` (vllm_flags.json next to
  this file): an unknown or malformed flag exits 2 naming it, as argparse does in vLLM;
- the model (positional or --model) must be a directory with config.json, else exit 1 with vLLM's message;
- nothing listens while the engine "loads" (STANDIN_LOAD_SECONDS, default 2): connections are refused;
- then /health, /ping, /version, /metrics (vLLM's metric names), /v1/models and /v1/chat/completions (also SSE),
  with prefix caching simulated on block-aligned prefixes of the chat-formatted prompt (Qwen's ChatML; its tokens are
  a crude sub-word split: a chat marker is one token, a word is cut in pieces of up to 4 letters or digits, any
  other character is one token); prefill sleeps STANDIN_PREFILL_SECONDS_PER_TOKEN (default 5e-6) per uncached
  prompt character, as when a token was a character;
- greedy answers: the generated tokens, their logprobs and top alternatives (`logprobs`, `top_logprobs`, also per
  streamed chunk) are a function of the whole prompt and the position, so a prompt gets the same answer whether
  its prefix was cached or not, and prompts that differ anywhere get different answers; the chosen token leads its
  alternatives by about one nat;
- --reasoning-parser: the answer is the reasoning (`message.reasoning`, `delta.reasoning`; content null) unless
  `chat_template_kwargs` (or --default-chat-template-kwargs) sets enable_thinking false;
- tools: `tool_choice` "required" (or a named function) returns a parsed call of the (first) tool, its required
  parameters filled in (an enum's first value, else a short value of its type); "auto" (the default with tools)
  answers 400 unless --enable-auto-tool-choice and --tool-call-parser are both set, as vLLM, then answers text;
- HTTP/1.1 with keep-alive, as uvicorn: several requests on one connection (curl --next) are all answered on it,
  and a connection idle for STANDIN_KEEP_ALIVE_S (default 5, uvicorn's) is closed;
- VLLM_API_KEY or --api-key guards /v1/* (health, metrics, version stay open);
- a compile cache keyed by its version, as vLLM's torch.compile cache: a start whose entry for (version, model
  config, parallel sizes) is absent from $VLLM_CACHE_ROOT (default ~/.cache/vllm, the profile's mount) "compiles"
  for STANDIN_COMPILE_SECONDS (default 2 in the image, 0 = no compile cache elsewhere) before it listens, and writes
  the entry as vLLM 0.32 does (torch_compile_cache/torch_aot_compile/<hash>/rank_0_0/model and an inductor_cache/
  beside it: written to a temp dir, then renamed); a start that finds a valid entry logs vLLM's "Directly load AOT
  compilation from path ..." and skips the compile; a damaged one is compiled again, with vLLM's warning; -O0
  and --enforce-eager compile nothing;
- STANDIN_DIE_AFTER=S: the engine dies S seconds after serving starts (/health 503, then the server exits 1);
- STANDIN_UNKNOWN_FLAGS=--a,--b: flags this "older vLLM" does not know (exit 2 if used);
- STANDIN_MISBEHAVE: a server the health checks must survive, once serving starts: "models-not-json" (/health
  200, /v1/models 200 with an HTML page) or "not-http" (every connection gets a line of another protocol); or one
  that passes every surface check and fails its clients: "completions-fail" (every completion answers 500, as an
  engine that crashes in its first batch), "stream-broken" (a streamed completion sends a chunk that does not
  parse, then closes), "cache-corrupt" (a request whose prefix comes from the cache is answered from a wrong
  state: other tokens, as confident) or "tools-broken" (the tool parser leaves every tool call in the text:
  `<tool_call>` JSON in the content, no `tool_calls`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn

# In the image the table sits next to this file; run from a checkout, it is the package's compiled table.
_HERE = Path(__file__).resolve()
FLAGS_FILE = Path(os.environ.get("STANDIN_FLAGS") or next(
    p for p in (_HERE.with_name("vllm_flags.json"), _HERE.parents[2] / "data" / "vllm-serve-flags.json") if p.exists()
))
VERSION = os.environ.get("STANDIN_VLLM_VERSION", "0.32.0")
MISBEHAVE = os.environ.get("STANDIN_MISBEHAVE", "")
KEEP_ALIVE_S = float(os.environ.get("STANDIN_KEEP_ALIVE_S", "5"))  # uvicorn's default --timeout-keep-alive
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_TYPES = {"int": int, "float": float, "str": str}


# ------------------------------------------------------------------------------------------------ argv, as vLLM
def build_parser(spec: dict[str, Any], unknown: set[str]) -> argparse.ArgumentParser:
    # allow_abbrev=False: vLLM's FlexibleArgumentParser does not accept abbreviated flags either.
    parser = argparse.ArgumentParser(prog=spec["prog"], usage=spec["usage"], allow_abbrev=False, add_help=False)
    parser.add_argument(spec["positional"], nargs="?", default=None)
    for flag in spec["flags"]:
        names = [n for n in flag["names"] if not n.startswith("--no-")]
        if set(names) & unknown:
            continue
        if flag["kind"] == "flag":
            parser.add_argument(*names, action="store_true")
        elif flag["kind"] == "bool":
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=None)
        else:
            kw: dict[str, Any] = {"type": _TYPES[flag["type"]], "default": None}
            if flag["choices"]:
                kw["choices"] = flag["choices"]
            if flag["nargs"]:
                kw["nargs"] = flag["nargs"]
            parser.add_argument(*names, **kw)
    return parser


def normalise(argv: list[str]) -> list[str]:
    """vLLM's argv conveniences: -O3 means --optimization-level 3; --max_model_len means --max-model-len."""
    out = []
    for arg in argv:
        if re.fullmatch(r"-O\d", arg):
            out += ["--optimization-level", arg[2:]]
        elif arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            key, sep, value = arg.partition("=")
            out.append(key.replace("_", "-") + sep + value)
        else:
            out.append(arg)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    spec = json.loads(FLAGS_FILE.read_text())
    unknown = {f for f in os.environ.get("STANDIN_UNKNOWN_FLAGS", "").split(",") if f}
    parser = build_parser(spec, unknown)
    if any(a == "-h" or a.startswith("--help") for a in argv):
        parser.print_usage()
        print("\n".join(", ".join(f["names"]) for f in spec["flags"] if not set(f["names"]) & unknown))
        sys.exit(0)
    argv = normalise(argv)
    extras = unrecognized(argv, set(parser._option_string_actions))
    if extras:
        # Listed with their values, as vLLM lists them (its top-level parser words it "vllm: error: ...").
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return parser.parse_args(argv)


def unrecognized(argv: list[str], known: set[str]) -> list[str]:
    """The unknown options and the values that follow them, as argparse lists them for vLLM."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and arg.split("=", 1)[0] not in known:
            out.append(arg)
            value = argv[i + 1] if i + 1 < len(argv) else ""
            if "=" not in arg and value and not value.startswith("-"):
                out.append(value)
    return out


def human_int(value: str | None) -> int | None:
    """--max-model-len accepts 1k / 2M / 225000 like vLLM's human_readable_int."""
    if value is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value)
    if not m:
        fail(
            2,
            f"usage: vllm serve [model_tag] [options]\nvllm serve: error: argument --max-model-len: "
            f"invalid human_readable_int value: '{value}'",
        )
    scale = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 1024**2, "g": 10**9, "G": 1024**3}[m.group(2)]
    return int(float(m.group(1)) * scale)


def fail(rc: int, message: str) -> NoReturn:
    print(message, file=sys.stderr, flush=True)
    sys.exit(rc)


# ------------------------------------------------------------------------------------------------------ engine
class Engine:
    """The model-facing state: served names, limits, the prefix cache and the counters /metrics reports."""

    def __init__(self, args: argparse.Namespace, model: str, config: dict[str, Any]):
        self.args = args
        self.model = model
        self.names = args.served_model_name or [model]
        derived = int(config.get("max_position_embeddings", 2048))
        self.max_model_len = human_int(args.max_model_len) or derived
        if self.max_model_len > derived:
            fail(
                1,
                f"ValueError: User-specified max_model_len ({self.max_model_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={derived} in model's config.json).",
            )
        self.prefix_caching = args.enable_prefix_caching is not False
        self.block_size = int(args.block_size or 16)
        self.match_unit = int(args.prefix_match_unit) if getattr(args, "prefix_match_unit", None) else None
        self.api_keys = list(args.api_key or []) or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else [])
        try:  # --default-chat-template-kwargs '{"enable_thinking": false}': what a request's own kwargs override
            self.template_kwargs = dict(json.loads(args.default_chat_template_kwargs or "{}"))
        except (ValueError, TypeError):
            fail(2, f"vllm serve: error: argument --default-chat-template-kwargs: invalid loads value: "
                    f"'{args.default_chat_template_kwargs}'")
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.dead = False
        self.running = 0
        self.counters = {
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prompt_tokens_cached": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "kv_sum": 0,
            "kv_count": 0,
        }
        self.ttft: list[float] = []
        # Per prompt character (tokens were characters once: a rate that callers set keeps its meaning).
        self.seconds_per_char = float(os.environ.get("STANDIN_PREFILL_SECONDS_PER_TOKEN", "0.000005"))

    def cached_tokens(self, tokens: list[str]) -> int:
        """Longest previously seen block-aligned prefix, never the whole prompt: floor((L-1)/B)*B at most."""
        if not self.prefix_caching:
            return 0
        unit = self.match_unit or self.block_size
        running, hashes = hashlib.sha256(), []
        for k in range(unit, len(tokens), unit):  # a block's hash covers every token before it, as vLLM's chain
            for t in tokens[k - unit : k]:
                b = t.encode()
                running.update(len(b).to_bytes(4, "little") + b)
            hashes.append(running.hexdigest())
        with self.lock:
            hit = 0
            for k, h in zip(range(unit, len(tokens), unit), hashes, strict=False):
                if h not in self.seen:
                    break
                hit = k
            self.seen.update(hashes)
        return hit

    def account(self, prompt: int, cached: int, generated: int, ttft: float) -> None:
        with self.lock:
            c = self.counters
            c["prefix_cache_queries"] += prompt if self.prefix_caching else 0
            c["prefix_cache_hits"] += cached
            c["prompt_tokens_cached"] += cached
            c["prompt_tokens"] += prompt
            c["generation_tokens"] += generated
            c["kv_sum"] += prompt - cached
            c["kv_count"] += 1
            self.ttft.append(ttft)

    def cache_config(self) -> dict[str, Any]:
        a = self.args
        info = {
            "block_size": self.block_size,
            "cache_dtype": a.kv_cache_dtype or "auto",
            "enable_prefix_caching": self.prefix_caching,
            "gpu_memory_utilization": a.gpu_memory_utilization or 0.92,
            "is_attention_free": False,
            "kv_cache_memory_bytes": a.kv_cache_memory_bytes,
            "mamba_block_size": a.mamba_block_size,
            "mamba_cache_dtype": getattr(a, "mamba_cache_dtype", None) or "auto",
            "mamba_cache_mode": a.mamba_cache_mode or "none",
            "num_cpu_blocks": 0,
            "num_gpu_blocks": 8192,
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": None,
        }
        if self.match_unit:
            info["prefix_match_unit"] = self.match_unit
        return {k: str(v) for k, v in sorted(info.items())}

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.names[0]}"'
        c = self.counters
        out: list[str] = []

        def metric(name: str, kind: str, value: float, help_text: str, extra: str = "") -> None:
            out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
            suffix = "_total" if kind == "counter" else ""
            out.append(f"{name}{suffix}{{{labels}{extra}}} {float(value)}\n")

        with self.lock:
            metric("vllm:num_requests_running", "gauge", self.running, "Number of requests in model execution batches.")
            metric("vllm:num_requests_waiting", "gauge", 0, "Number of requests waiting to be processed.")
            metric(
                "vllm:kv_cache_usage_perc", "gauge", min(1.0, len(self.seen) / 8192), "KV-cache usage. 1 means 100 percent usage."
            )
            metric(
                "vllm:prefix_cache_queries",
                "counter",
                c["prefix_cache_queries"],
                "Prefix cache queries, in terms of number of queried tokens.",
            )
            metric(
                "vllm:prefix_cache_hits",
                "counter",
                c["prefix_cache_hits"],
                "Prefix cache hits, in terms of number of cached tokens.",
            )
            metric("vllm:prompt_tokens", "counter", c["prompt_tokens"], "Number of prefill tokens processed.")
            metric(
                "vllm:prompt_tokens_cached",
                "counter",
                c["prompt_tokens_cached"],
                "Number of cached prompt tokens (local + external).",
            )
            metric("vllm:generation_tokens", "counter", c["generation_tokens"], "Number of generation tokens processed.")
            out.append(
                "# HELP vllm:request_prefill_kv_computed_tokens Histogram of new KV tokens computed during "
                "prefill (excluding cached tokens).\n# TYPE vllm:request_prefill_kv_computed_tokens histogram\n"
            )
            out.append(f"vllm:request_prefill_kv_computed_tokens_sum{{{labels}}} {float(c['kv_sum'])}\n")
            out.append(f"vllm:request_prefill_kv_computed_tokens_count{{{labels}}} {float(c['kv_count'])}\n")
            out.append(
                "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n"
                "# TYPE vllm:time_to_first_token_seconds histogram\n"
            )
            for b in TTFT_BUCKETS:
                n = sum(1 for t in self.ttft if t <= b)
                out.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{b}"}} {float(n)}\n')
            out.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {float(len(self.ttft))}\n')
            out.append(f"vllm:time_to_first_token_seconds_count{{{labels}}} {float(len(self.ttft))}\n")
            out.append(f"vllm:time_to_first_token_seconds_sum{{{labels}}} {sum(self.ttft)}\n")
        cache_labels = ",".join(f'{k}="{v}"' for k, v in self.cache_config().items())
        out.append(
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"
        )
        out.append(f'vllm:cache_config_info{{{cache_labels},engine="0"}} 1.0\n')
        return "".join(out)


def chat_prompt(messages: list[dict[str, Any]], tools: list[Any] | None = None, thinking: bool = True) -> str:
    """A ChatML rendering (Qwen3's template shape): what the token count, prefix matching and answers run on.

    Tools go into the system prompt; enable_thinking false closes an empty think block after the assistant header.
    """
    parts = []
    if tools:
        listed = "\n".join(json.dumps(t) for t in tools)
        system = ""
        if messages and messages[0].get("role") == "system":
            system, messages = f"{_text(messages[0])}\n\n", messages[1:]
        parts.append(f"<|im_start|>system\n{system}# Tools\n\nYou may call one or more functions to assist with the user "
                     f"query.\n\n<tools>\n{listed}\n</tools><|im_end|>\n")
    for m in messages:
        parts.append(f"<|im_start|>{m.get('role', 'user')}\n{_text(m)}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")


def _text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


# A chat marker is one token, a word (letters and digits) is cut in pieces of up to 4 characters (about a real BPE's
# rate on English), any other character is a token of its own.
_TOKEN = re.compile(r"<\|[a-z_]+\|>|</?think>|</?tool_call>| ?[A-Za-z0-9]{1,4}|.", re.S)


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


# What the stand-in "model" says: words of this vocabulary, one token each.
VOCABULARY = (
    "the a cache river garden answer model token light paper window silver morning quiet table bridge number "
    "engine north summer stone letter orange music simple careful early second people field market harbour "
    "winter yellow forest signal motor valley copper island planet rain blue green seven eleven ninety open "
    "closed ready steady small large warm cold fast slow bright dark left right upper lower inner outer"
).split()
MAX_TOP_LOGPROBS = 20


def greedy_tokens(prompt: str, n: int, top: int, state: bytes = b"") -> list[dict[str, Any]]:
    """The greedy answer to `prompt`: n logprob entries as vLLM returns them (token, logprob, bytes, top_logprobs).

    Each position's distribution comes from sha256 of the prompt (and `state`: b"" is the right one) and the
    position: the chosen token is the argmax, its logprob in [-0.9, -0.5], each next alternative ~1 nat lower.
    """
    base = hashlib.sha256(b"standin-greedy\0" + state + b"\0" + prompt.encode()).digest()
    entries = []
    for i in range(n):
        rng = random.Random(hashlib.sha256(base + i.to_bytes(4, "big")).digest())
        picks = rng.sample(range(len(VOCABULARY)), MAX_TOP_LOGPROBS)  # always as many: the answer must not vary with top
        logprob = -(0.5 + 0.4 * rng.random())
        ranked = []
        for index in picks:
            word = VOCABULARY[index]
            token = word.capitalize() if i == 0 else f" {word}"
            ranked.append({"token": token, "logprob": round(logprob, 4), "bytes": list(token.encode())})
            logprob -= 1.0 + 0.2 * rng.random()
        entries.append({**ranked[0], "top_logprobs": ranked[:top]})
    return entries


def stale_tokens(prompt: str, n: int, top: int) -> list[dict[str, Any]]:
    """STANDIN_MISBEHAVE=cache-corrupt: the answer of a wrong cached state, as confident, never the right first token."""
    right = greedy_tokens(prompt, 1, 1)[0]["token"]
    for attempt in range(8):
        wrong = greedy_tokens(prompt, n, top, state=f"stale-{attempt}".encode())
        if not wrong or wrong[0]["token"] != right:
            break
    return wrong


def tool_arguments(tool: dict[str, Any]) -> dict[str, Any]:
    """Each required parameter of the tool's JSON schema filled in: an enum's first value, else a short value."""
    schema = (tool.get("function") or {}).get("parameters") or {}
    properties = schema.get("properties") or {}
    examples = {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    out: dict[str, Any] = {}
    for name in schema.get("required") or []:
        spec = properties.get(name) or {}
        out[name] = spec["enum"][0] if spec.get("enum") else examples.get(str(spec.get("type")), "example")
    return out


# -------------------------------------------------------------------------------------------------------- HTTP
class Handler(BaseHTTPRequestHandler):
    engine: Engine
    server_version = "uvicorn"
    sys_version = ""
    # Keep-alive like uvicorn: every answer is framed (content-length, or connection: close) so the connection can
    # carry the next request. A socket idle this long is dropped (a request stalled mid-way too), so idle clients
    # do not keep threads forever.
    protocol_version = "HTTP/1.1"
    timeout = KEEP_ALIVE_S
    # A response's head and body leave in one write (wfile is flushed after each request and each SSE event):
    # written apart on a kept-alive connection, the body waited ~40 ms for the client's delayed ACK (Nagle).
    # TCP_NODELAY, as asyncio sets it for uvicorn, covers a body larger than the buffer.
    wbufsize = -1
    disable_nagle_algorithm = True

    def handle(self) -> None:
        if MISBEHAVE != "not-http":
            super().handle()
            return
        # Another protocol on vLLM's port. The request is read first, so the close is clean, not a reset.
        try:
            while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                pass
        except TimeoutError:
            return
        self.wfile.write(b"-ERR unknown command 'GET', with args beginning with: '/health'\r\n")
        print("INFO:     answered a request with a line of another protocol (STANDIN_MISBEHAVE=not-http)", flush=True)

    def log_message(self, fmt: str, *args: Any) -> None:  # one access-log line per request, like uvicorn's
        line = getattr(self, "requestline", "")
        print(f'INFO:     {self.client_address[0]} - "{line}" {args[1] if len(args) > 1 else ""}', flush=True)

    def log_error(self, fmt: str, *args: Any) -> None:
        if args and isinstance(args[0], TimeoutError):
            return  # an idle keep-alive connection timed out: uvicorn closes those silently
        super().log_error(fmt, *args)

    def _body(self) -> bytes | None:
        """The request's body, read in full so that the next request on the connection starts where it should.

        None when it cannot be framed: a 400 is sent and the connection closes. A chunked body is not read (the
        stand-in never needed one): the request is answered as if it had none, then the connection closes.
        """
        if self.headers.get("transfer-encoding"):
            self.close_connection = True
            return b""
        try:
            length = int(self.headers.get("content-length") or 0)
            if length < 0:
                raise ValueError(length)
        except ValueError:
            self.send_error(400, "Invalid HTTP request received.")
            return None
        return self.rfile.read(length) if length else b""

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        keys = self.engine.api_keys
        if not keys or not self.path.startswith("/v1"):
            return True
        if self.headers.get("Authorization", "") in {f"Bearer {k}" for k in keys}:
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:
        e = self.engine
        if self._body() is None:
            return
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/ping"):
            self.send_response(503 if e.dead else 200)
            self.send_header("content-length", "0")
            self.end_headers()
        elif path == "/version":
            self._json(200, {"version": VERSION})
        elif path == "/metrics":
            data = e.metrics().encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path == "/v1/models" and MISBEHAVE == "models-not-json":
            if self._authorised():
                page = b"<html><head><title>502 Bad Gateway</title></head><body>502 Bad Gateway</body></html>\n"
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.send_header("content-length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)
        elif path == "/v1/models":
            if self._authorised():
                now = int(time.time())
                self._json(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": name,
                                "object": "model",
                                "created": now,
                                "owned_by": "vllm",
                                "root": e.model,
                                "parent": None,
                                "max_model_len": e.max_model_len,
                                "permission": [
                                    {
                                        "id": f"modelperm-{uuid.uuid4().hex}",
                                        "object": "model_permission",
                                        "created": now,
                                        "allow_sampling": True,
                                        "allow_view": True,
                                        "is_blocking": False,
                                        "organization": "*",
                                        "group": None,
                                    }
                                ],
                            }
                            for name in e.names
                        ],
                    },
                )
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        e = self.engine
        # Read before any answer, even a 404 or a 401: an unread body would be parsed as the next request.
        body = self._body()
        if body is None:
            return
        if self.path.split("?", 1)[0] != "/v1/chat/completions":
            self._json(404, {"detail": "Not Found"})
            return
        if not self._authorised():
            return
        try:
            req = json.loads(body or b"{}")
        except json.JSONDecodeError as err:
            self._json(
                400, {"error": {"message": f"JSON decode error: {err}", "type": "BadRequestError", "param": None, "code": 400}}
            )
            return
        if req.get("model") not in e.names:
            self._json(
                404,
                {
                    "error": {
                        "message": f"The model `{req.get('model')}` does not exist.",
                        "type": "NotFoundError",
                        "param": "model",
                        "code": 404,
                    }
                },
            )
            return
        problem = self._tool_problem(req)
        if problem:
            self._json(400, {"error": {"message": problem, "type": "BadRequestError", "param": None, "code": 400}})
            return
        # A dead engine, or one that crashes in every batch (STANDIN_MISBEHAVE=completions-fail): vLLM's 500.
        if e.dead or MISBEHAVE == "completions-fail":
            self._json(
                500,
                {
                    "error": {
                        "message": "EngineCore encountered an issue.",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
            )
            return
        kwargs = {**e.template_kwargs, **(req.get("chat_template_kwargs") or {})}
        thinking = kwargs.get("enable_thinking", True) is not False
        text = chat_prompt(req.get("messages") or [], req.get("tools"), thinking)
        tokens = tokenize(text)
        max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        if len(tokens) + max_tokens > e.max_model_len:
            self._json(
                400,
                {
                    "error": {
                        "message": f"This model's maximum context length is {e.max_model_len} tokens. "
                        f"However, you requested {len(tokens) + max_tokens} tokens.",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
            )
            return
        with e.lock:
            e.running += 1
        try:
            self._complete(req, text, tokens, max_tokens, thinking)
        finally:
            with e.lock:
                e.running -= 1

    def _tool_problem(self, req: dict[str, Any]) -> str | None:
        """vLLM's 400s for tool use: a tool_choice without tools, "auto" without the parser flags, an unknown name."""
        tools, choice = req.get("tools") or [], req.get("tool_choice")
        if choice in (None, "none"):
            if not tools or choice == "none":
                return None
            choice = "auto"  # vLLM's default when tools are given
        if not tools:
            return "When using `tool_choice`, `tools` must be set."
        args = self.engine.args
        if choice == "auto" and not (args.enable_auto_tool_choice and args.tool_call_parser):
            return '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        if choice not in ("auto", "required") and _named_tool(req) is None:
            return "The tool specified in `tool_choice` does not match any of the specified `tools`"
        return None

    def _complete(self, req: dict[str, Any], text: str, tokens: list[str], max_tokens: int, thinking: bool) -> None:
        e = self.engine
        t0 = time.monotonic()
        cached = e.cached_tokens(tokens)
        time.sleep(len("".join(tokens[cached:])) * e.seconds_per_char)  # prefill: only the uncached part costs time
        want_logprobs = bool(req.get("logprobs"))
        top = int(req.get("top_logprobs") or 0) if want_logprobs else 0
        tools = req.get("tools") or []
        forced = _named_tool(req) if req.get("tool_choice") != "required" else tools[0]
        auto = bool(tools) and req.get("tool_choice") in (None, "auto")
        calls: list[dict[str, Any]] = []
        entries: list[dict[str, Any]] = []
        content: str | None = None
        reasoning: str | None = None
        if forced is not None or (auto and MISBEHAVE == "tools-broken"):
            # The model "writes" the call as Qwen does; the tool parser takes it out of the text (unless broken).
            tool = forced or tools[0]
            name, arguments = (tool.get("function") or {}).get("name"), tool_arguments(tool)
            written = json.dumps({"name": name, "arguments": arguments})
            n_out = min(len(tokenize(written)), max_tokens)
            if MISBEHAVE == "tools-broken":
                content, finish = f"<tool_call>\n{written}\n</tool_call>", "stop"
                pieces = tokenize(content)
            else:
                call = {"name": name, "arguments": json.dumps(arguments)}
                calls = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function", "function": call}]
                content, pieces, finish = "", [], "tool_calls"
        else:
            n_out = min(max_tokens, 16)
            answer = stale_tokens if MISBEHAVE == "cache-corrupt" and cached else greedy_tokens
            entries = answer(text, n_out, top)
            pieces = [entry["token"] for entry in entries]
            if e.args.reasoning_parser and thinking:  # the parser finds no end of thinking: all of it is reasoning
                reasoning = "".join(pieces)
            else:
                content = "".join(pieces)
            finish = "length" if n_out == max_tokens else "stop"
        usage: dict[str, Any] = {
            "prompt_tokens": len(tokens),
            "total_tokens": len(tokens) + n_out,
            "completion_tokens": n_out,
            "prompt_tokens_details": {"cached_tokens": cached} if e.args.enable_prompt_tokens_details else None,
        }
        if reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": n_out}
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req["model"]
        if not req.get("stream"):
            e.account(len(tokens), cached, n_out, time.monotonic() - t0)
            message = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
                       "function_call": None, "tool_calls": calls, "reasoning": reasoning}  # fmt: skip
            self._json(
                200,
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "logprobs": {"content": entries} if want_logprobs and entries else None,
                            "finish_reason": finish,
                            "stop_reason": None,
                        }
                    ],
                    "usage": usage,
                    "prompt_logprobs": None,
                },
            )
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("connection", "close")
        self.end_headers()

        def send(choices: list[dict[str, Any]], **extra: Any) -> None:
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        e.account(len(tokens), cached, n_out, time.monotonic() - t0)
        if MISBEHAVE == "stream-broken":
            self.wfile.write(b'data: {"id": "' + rid.encode() + b'", "choices": [{"index": 0, "delta": {"content": "st\n\n')
            self.close_connection = True
            return
        if calls:
            delta = {"tool_calls": [{"index": 0, **calls[0]}]}
            send([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])
        field = "reasoning" if reasoning is not None else "content"
        for i, piece in enumerate(pieces):
            logprobs = {"content": [entries[i]]} if want_logprobs and entries else None
            last = i == len(pieces) - 1
            send([{"index": 0, "delta": {field: piece}, "logprobs": logprobs, "finish_reason": finish if last else None}])
        if (req.get("stream_options") or {}).get("include_usage"):
            send([], usage=usage)
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


def _named_tool(req: dict[str, Any]) -> dict[str, Any] | None:
    """The tool a `tool_choice: {"type": "function", "function": {"name": ...}}` names, among the request's tools."""
    choice = req.get("tool_choice")
    if not isinstance(choice, dict):
        return None
    name = (choice.get("function") or {}).get("name")
    return next((t for t in req.get("tools") or [] if (t.get("function") or {}).get("name") == name), None)


# ----------------------------------------------------------------------------------------- the compile cache
# The image sets VLLM_USAGE_SOURCE as the real one does: there a start compiles by default; run from a checkout
# (the unit tests), nothing is compiled or written unless STANDIN_COMPILE_SECONDS says so.
IN_IMAGE = os.environ.get("VLLM_USAGE_SOURCE") == "production-docker-image"
ARTIFACT_BYTES = 64 * 1024


def compile_seconds() -> float:
    return float(os.environ.get("STANDIN_COMPILE_SECONDS") or (2.0 if IN_IMAGE else 0.0))


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_CACHE_ROOT") or Path.home() / ".cache" / "vllm")


def compile_key(args: argparse.Namespace, config: dict[str, Any]) -> str:
    """What vLLM's cache dir hash covers, in small: its version, the model's config, the parallel layout."""
    factors = {"version": VERSION, "config": config, "tp": args.tensor_parallel_size,
               "pp": args.pipeline_parallel_size, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}
    return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()


def artifact(key: str) -> bytes:
    """The compiled "model" for a key: deterministic bytes, so a damaged or foreign file is told apart."""
    out, block = bytearray(), hashlib.sha256(key.encode()).digest()
    while len(out) < ARTIFACT_BYTES:
        block = hashlib.sha256(block).digest()
        out += block
    return bytes(out[:ARTIFACT_BYTES])


def warm_or_compile(args: argparse.Namespace, config: dict[str, Any]) -> None:
    """Load this version's compiled artifact from the cache, or "compile" (sleep) and save it, as vLLM logs it."""
    seconds = compile_seconds()
    if seconds <= 0 or args.enforce_eager or args.optimization_level == 0:  # vLLM compiles nothing then either
        return
    key = compile_key(args, config)
    aot = cache_root() / "torch_compile_cache" / "torch_aot_compile"
    path = aot / key / "rank_0_0" / "model"
    tag = "(Worker pid=%d) " % os.getpid()
    try:
        if path.read_bytes() == artifact(key):
            print(f"{tag}INFO [decorators.py:320] [backbone] Directly load AOT compilation from path {path}",
                  flush=True)
            return
        reason = "Compile cache file corrupted."
    except FileNotFoundError:
        reason = ""
    except OSError as e:
        reason = str(e)
    if reason:
        print(f"{tag}WARNING [decorators.py:333] [backbone] Compiling model again due to a load failure from {path}, "
              f"reason: {reason}", flush=True)
    started = time.monotonic()
    time.sleep(seconds)
    try:
        tmp = aot / f".tmp-{key[:16]}-{os.getpid()}"
        (tmp / "rank_0_0").mkdir(parents=True, exist_ok=True)
        (tmp / "rank_0_0" / "model").write_bytes(artifact(key))
        (tmp / "inductor_cache" / key[:2]).mkdir(parents=True, exist_ok=True)
        (tmp / "inductor_cache" / key[:2] / f"c{key[:40]}.so").write_bytes(artifact(key[::-1])[:16384])
        if (aot / key).exists():  # an entry that did not load: replaced, as vLLM saves over it
            (aot / key / "rank_0_0").mkdir(parents=True, exist_ok=True)
            os.replace(tmp / "rank_0_0" / "model", path)
            for leftover in sorted(tmp.rglob("*"), reverse=True):
                leftover.unlink() if leftover.is_file() else leftover.rmdir()
            tmp.rmdir()
        else:
            os.rename(tmp, aot / key)
    except OSError as e:  # a read-only or full cache: vLLM goes on without saving
        print(f"{tag}WARNING cannot save the compiled function to {path}: {e}", flush=True)
        return
    print(f"{tag}INFO [decorators.py:743] [backbone] saved AOT compiled function to {path}", flush=True)
    print(f"{tag}INFO [backends.py] torch.compile took {time.monotonic() - started:.2f} s in total", flush=True)


# -------------------------------------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    if not argv or argv[0] != "serve":
        fail(
            2,
            "usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ...\n"
            f"vllm: error: argument subparser: invalid choice: '{argv[0] if argv else ''}'",
        )
    args = parse_args(argv[1:])
    model = args.model_tag or args.model or "Qwen/Qwen3-0.6B"
    config_path = Path(model) / "config.json"
    if not config_path.is_file():
        fail(
            1,
            f"ValueError: Invalid repository ID or local directory specified: '{model}'.\n"
            "Please verify the following requirements:\n1. Provide a valid Hugging Face repository ID.\n"
            "2. Specify a local directory that contains a recognized configuration file.\n"
            "   - For Hugging Face models: ensure the presence of a 'config.json'.\n"
            "   - For Mistral models: ensure the presence of a 'params.json'.",
        )
    engine = Engine(args, model, json.loads(config_path.read_text()))
    print(f"INFO vLLM API server version {VERSION} (stand-in)\nINFO non-default args: {vars(args)}", flush=True)
    # vLLM binds only after the engine is up: until then a client's connect is refused.
    time.sleep(float(os.environ.get("STANDIN_LOAD_SECONDS", "2")))
    warm_or_compile(args, json.loads(config_path.read_text()))
    Handler.engine = engine
    server = ThreadingHTTPServer((args.host or "", args.port or 8000), Handler)
    server.daemon_threads = True
    print(f"INFO:     Uvicorn running on http://{args.host or '0.0.0.0'}:{args.port or 8000} (Press CTRL+C to quit)", flush=True)
    die_after = os.environ.get("STANDIN_DIE_AFTER")
    if die_after:

        def die() -> None:
            time.sleep(float(die_after))
            engine.dead = True
            print(
                "ERROR EngineCore encountered a fatal error.\nvllm.v1.engine.exceptions.EngineDeadError: "
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                flush=True,
            )
            time.sleep(float(os.environ.get("STANDIN_DEAD_SECONDS", "1")))  # /health answers 503 meanwhile
            server.shutdown()

        threading.Thread(target=die, daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        return 0
    finally:
        server.server_close()
    return 1 if engine.dead else 0


if __name__ == "__main__":
    import signal

    # docker stop sends SIGTERM: shut down cleanly like uvicorn does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    sys.exit(main(sys.argv[1:]))
