#!/usr/bin/python3
"""Stand-in for `vllm serve` (the vllm/vllm-openai image's entrypoint), stdlib only.

It is what the sandbox's vLLM image runs, and it is testable on loopback directly:

    STANDIN_LOAD_SECONDS=0.5 python3 vllm_serve.py serve /models/m --served-model-name m --port 8123

Its parts are the modules next to it, which the image installs side by side: vllm_argv (argv as vLLM parses it,
the version it plays), vllm_engine (the prefix cache and /metrics), vllm_chat (the chat prompt, its tokens, the
answers), vllm_http (the endpoints) and vllm_compile_cache.

Behaves like vLLM where gpufleet depends on it:
- argv is parsed with the flags, choices and aliases of the real `vllm serve --help=all` (vllm_flags.json next to
  this file): an unknown or malformed flag exits 2 naming it, as argparse does in vLLM;
- the model (positional or --model) must be a directory with config.json, else exit 1 with vLLM's message;
- nothing listens while the engine "loads" (STANDIN_LOAD_SECONDS, default 2): connections are refused;
- then /health, /ping, /version, /metrics (vLLM's metric names), /v1/models and /v1/chat/completions (also SSE),
  with prefix caching simulated on block-aligned prefixes of the chat-formatted prompt (Qwen's ChatML; its tokens are
  a crude sub-word split: a chat marker is one token, a word is cut in pieces of up to 4 letters or digits, any
  other character is one token); prefill sleeps STANDIN_PREFILL_SECONDS_PER_TOKEN (default 5e-6) per uncached
  prompt character, as when a token was a character, and each token after the first takes
  STANDIN_DECODE_SECONDS_PER_TOKEN (default 0.005); an answer ends after 16 tokens unless `ignore_eos` (or
  `min_tokens`) asks for more, as vLLM's do;
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
- --nnodes N: one engine across hosts (vllm_group): the head listens on --master-port and serves once every rank
  joined, a --headless rank joins it and serves nothing; neither notices the other die while idle, a request with
  a rank gone kills the head's engine;
- STANDIN_DIE_AFTER=S: the engine dies S seconds after serving starts (/health 503, then the server exits 1);
- STANDIN_UNKNOWN_FLAGS=--a,--b: flags this "older vLLM" does not know (exit 2 if used);
- STANDIN_MISBEHAVE: a server the health checks must survive, once serving starts: "models-not-json" (/health
  200, /v1/models 200 with an HTML page) or "not-http" (every connection gets a line of another protocol); or one
  that passes every surface check and fails its clients: "completions-fail" (every completion answers 500, as an
  engine that crashes in its first batch), "stream-broken" (a streamed completion sends a chunk that does not
  parse, then closes), "cache-corrupt" (a request whose prefix comes from the cache is answered from a wrong
  state: other tokens, as confident) or "tools-broken" (the tool parser leaves every tool call in the text:
  `<tool_call>` JSON in the content, no `tool_calls`); or one that answers right, slower: "slow" (prefill 20x
  slower and 0.4 s more per request) or "stalls-under-load" (one request at a time is served; a request that
  arrives while another runs is never scheduled and stays running, while /health answers 200).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING or __package__:  # imported from the package: the checkout's tests, mypy
    from .vllm_argv import VERSION, fail, parse_args
    from .vllm_compile_cache import warm_or_compile
    from .vllm_engine import Engine
    from .vllm_group import Head, ready_timeout_s, run_rank
    from .vllm_http import Handler
else:  # the image's /opt/gpufleet-standin: side by side, and a script's own directory is on sys.path
    from vllm_argv import VERSION, fail, parse_args
    from vllm_compile_cache import warm_or_compile
    from vllm_engine import Engine
    from vllm_group import Head, ready_timeout_s, run_rank
    from vllm_http import Handler


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
    nnodes = args.nnodes or 1
    if nnodes > 1 and args.headless:
        return run_rank(args.master_addr or "127.0.0.1", args.master_port or 29501, args.node_rank or 0)
    engine = Engine(args, model, json.loads(config_path.read_text()))
    print(f"INFO vLLM API server version {VERSION} (stand-in)\nINFO non-default args: {vars(args)}", flush=True)
    if nnodes > 1:
        engine.group = Head(args.master_port or 29501, nnodes)
    # vLLM binds only after the engine is up: until then a client's connect is refused.
    time.sleep(float(os.environ.get("STANDIN_LOAD_SECONDS", "2")))
    warm_or_compile(args, json.loads(config_path.read_text()))
    if engine.group is not None:
        engine.group.wait(ready_timeout_s())
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
