#!/usr/bin/env python3
"""Deploy timing on the test hosts (not a timed test): cold converge and no-op re-converge of 1, 2 and 4 hosts,
beside the floor `pyinfra INVENTORY exec -- true` measured in the same run on the same hosts.

    sudo .venv/bin/python bench/deploy_bench.py [--sizes 1 2 4] [--repeat 3]

Boots its own fleet (bridge gf-bench, 10.213.2.0/24, state /var/lib/gpufleet/bench) with gpufleet.sandbox, so it
never touches the test or sandbox fleets; stops it at the end. Writes bench/results/deploy-<UTC time>.md.
Target: a no-op re-converge within 2x the floor.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from gpufleet.sandbox.config import FleetConfig, H200x3
from gpufleet.sandbox.fleet import Fleet

REPO = Path(__file__).resolve().parents[1]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
DEPLOY = str(REPO / "deploys" / "qwen35.py")
# As in tests/integration/test_deploy_qwen35.py: a short readiness deadline; the sandbox's own host data otherwise.
BENCH_DATA = {"vllm_ready_timeout": 120}


def bench_config() -> FleetConfig:
    return FleetConfig(name="bench", bridge="gf-bench", net="10.213.2", host_prefix="gfb",
                       state_dir=Path("/var/lib/gpufleet/bench"))


def write_inventory(fleet: Fleet, names: list[str], path: Path) -> Path:
    inventory_json = fleet.write_inventory()
    path.write_text(
        "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
        f"gpuhosts = [(n, {{**{BENCH_DATA!r}, **d}}) for n, d in pyinfra_hosts({str(inventory_json)!r}) "
        f"if n in {names!r}]\n")
    return path


def timed(inventory: Path, *args: str) -> tuple[float, str]:
    t0 = time.monotonic()
    proc = subprocess.run([PYINFRA, "-y", str(inventory), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"pyinfra {' '.join(args)} failed:\n{proc.stdout[-3000:]}")
    return elapsed, proc.stdout


def changes(output: str) -> int:
    row = next(line for line in output.splitlines() if line.strip().startswith("Grand total"))
    success = re.split(r"\s{2,}", row.strip())[2]
    return 0 if success == "-" else int(success)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=3, help="runs of the floor and of the no-op (median)")
    args = parser.parse_args()

    fleet = Fleet(bench_config())
    fleet.start()
    rows = []
    try:
        for n in args.sizes:
            hosts = fleet.add_hosts([H200x3] * n, first=1)
            names = [h.name for h in hosts]
            inv = write_inventory(fleet, names, fleet.cfg.state_dir / f"inventory-{n}.py")
            timed(inv, "exec", "--", "true")  # warm the SSH path once (host keys, sshd)
            floor_before = [timed(inv, "exec", "--", "true")[0] for _ in range(args.repeat)]
            cold, out = timed(inv, DEPLOY)
            cold_changes = changes(out)
            noops = []
            for _ in range(args.repeat):
                elapsed, out = timed(inv, DEPLOY)
                if changes(out):
                    raise SystemExit(f"no-op re-converge of {n} host(s) changed {changes(out)} operation(s)")
                noops.append(elapsed)
            floor_after = [timed(inv, "exec", "--", "true")[0] for _ in range(args.repeat)]
            floor = statistics.median(floor_before + floor_after)
            noop = statistics.median(noops)
            rows.append((n, floor, cold, cold_changes, noop, noop / floor))
            print(f"{n} host(s): floor {floor:.2f}s  cold {cold:.2f}s ({cold_changes} changes)  "
                  f"no-op {noop:.2f}s = {noop / floor:.2f}x floor", flush=True)
            fleet.remove_hosts(names)
    finally:
        fleet.stop()

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# deploy bench {stamp}", "",
        f"`pyinfra INVENTORY deploys/qwen35.py` on nspawn test hosts (3x H200 stand-ins, stand-in image), "
        f"medians of {args.repeat} runs; floor = `pyinfra INVENTORY exec -- true` on the same hosts, same run.", "",
        "| hosts | floor (s) | cold converge (s) | cold changes | no-op re-converge (s) | no-op / floor |",
        "|---:|---:|---:|---:|---:|---:|",
        *(f"| {n} | {f:.2f} | {c:.2f} | {cc} | {o:.2f} | {r:.2f}x |" for n, f, c, cc, o, r in rows), "",
        "A no-op re-converge reads each host with one SSH command (gpufleet.facts.host), in parallel across hosts, "
        "and executes nothing (0 changes, checked on every run).", "",
    ]
    path = out_dir / f"deploy-{stamp}.md"
    path.write_text("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
