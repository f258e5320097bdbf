#!/usr/bin/python3
"""Stand-in for `vllm serve` (the vllm/vllm-openai image's entrypoint), stdlib only, also runnable on loopback:

    STANDIN_LOAD_SECONDS=0.5 python3 vllm_serve.py serve /models/m --served-model-name m --port 8123

Its parts are the vllm_* modules beside it. What it plays of vLLM, and its knobs: docs/test-hosts.md.
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

if TYPE_CHECKING or __package__:
    from .vllm_argv import VERSION, fail, parse_args
    from .vllm_compile_cache import warm_or_compile
    from .vllm_engine import Engine
    from .vllm_group import Head, ready_timeout_s, run_rank
    from .vllm_http import Handler
else:  # the image runs it as a script beside its modules
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
    print(
        f"INFO:     Uvicorn running on http://{args.host or '0.0.0.0'}:{args.port or 8000} (Press CTRL+C to quit)",
        flush=True,
    )
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
