#!/usr/bin/env python3
"""Rollout timing on nspawn test hosts (not a timed test): `gpufleet rollout` of N hosts from one stand-in digest
to another, batch 1, canary 1.

    sudo .venv/bin/python bench/rollout_bench.py [--sizes 4 8]

For each host count N: boot N fresh 3x H200 hosts, converge them on a tag of the bench's own (= `good`), move the
tag to `good-next` in the fleet's registry (a manifest copy), then time `gpufleet rollout INV --yes --json`.
Reported: the total time, each host's downtime (its /health not 200, polled by the rollout through SSH: median,
max), and the bytes the registry served each host inside its swap (the deploy run that restarted it; its downtime
lies inside that window), from the registry's access log: it must be 0 (the pull is done in prepare). The bytes
served during prepare are shown beside it.

Boots its own fleet (bridge gf-rbench, 10.213.6.0/24, state /var/lib/gpufleet/rbench) and stops it at the end,
also on errors. Writes bench/results/rollout-<UTC time>.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from converge import converge_fresh_hosts

from gpufleet.sandbox.config import FleetConfig, H200x3
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.image import REPOSITORY
from gpufleet.sandbox.registry import move_tag

REPO = Path(__file__).resolve().parents[1]
GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
DATA = {"vllm_ready_timeout": 120, "vllm_ready_soak_s": 10}
# 10.213.6.11 - - [01/Dec/2026:05:34:00 +0000] "GET /v2/vllm/vllm-openai/blobs/sha256:... HTTP/1.1" 200 1234 ...
ACCESS = re.compile(
    r'^(?P<ip>\S+) \S+ \S+ \[(?P<when>[^\]]+)\] "(?P<method>\S+) (?P<path>\S+) [^"]*" (?P<status>\d+) '
    r"(?P<bytes>\d+|-)"
)
RUN = re.compile(r"^\$ (?P<argv>.*)$", re.MULTILINE)
WINDOW = re.compile(r"^\[exit (?P<rc>-?\d+); started (?P<start>[\d.]+); ended (?P<end>[\d.]+)\]$", re.MULTILINE)


def config() -> FleetConfig:
    return FleetConfig(
        name="rbench",
        bridge="gf-rbench",
        net="10.213.6",
        host_prefix="gfrb",
        state_dir=Path("/var/lib/gpufleet/rbench"),
    )


def deploy_runs(log: Path) -> list[tuple[list[str], bool, float, float]]:
    """(hosts, is_prepare, start, end) of each deploy run the rollout logged."""
    text = log.read_text()
    runs = []
    for head, window in zip(RUN.finditer(text), WINDOW.finditer(text), strict=True):
        argv = head["argv"].split()
        hosts = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--limit"]
        runs.append((hosts, "gpufleet_stage=prepare" in argv, float(window["start"]), float(window["end"])))
    return runs


def registry_bytes(access_log: Path, ip: str, start: float, end: float) -> int:
    """Bytes of blobs the registry served `ip` within [start, end] (the log has 1 s resolution: widened by 1 s)."""
    total = 0
    for line in access_log.read_text(errors="replace").splitlines():
        m = ACCESS.match(line)
        if not m or m["ip"] != ip or m["method"] != "GET" or "/blobs/" not in m["path"] or m["bytes"] == "-":
            continue
        when = datetime.strptime(m["when"], "%d/%b/%Y:%H:%M:%S %z").timestamp()
        if start - 1 <= when <= end + 1:
            total += int(m["bytes"])
    return total


def bench(fleet: Fleet, n: int, out_dir: Path) -> dict:
    fleet.remove_hosts()
    hosts = fleet.add_hosts([H200x3] * n, first=1)
    ips = {h.name: h.ip for h in hosts}
    tag = f"bench-{int(time.time())}"
    registry = fleet.cfg.registry
    move_tag(registry, tag, "good")
    inventory = out_dir / f"inventory-{n}.py"
    inventory.write_text(
        "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
        f"gpuhosts = [(n, {{**d, **{DATA!r}, 'vllm_image': {registry + '/' + REPOSITORY + ':' + tag!r}}}) "
        f"for n, d in pyinfra_hosts({str(fleet.write_inventory())!r})]\n"
    )
    converge_fresh_hosts(inventory, f"converge of {n} hosts")
    move_tag(registry, tag, "good-next")
    log = out_dir / f"rollout-{n}.log"
    start = time.monotonic()
    proc = subprocess.run(
        [GPUFLEET, "rollout", str(inventory), "--yes", "--json", "--log", str(log)],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=REPO,
    )
    total = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"rollout of {n} hosts failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout)
    downtimes = [h["downtime_s"] for h in doc["hosts"]]
    access = fleet.cfg.state_dir / "logs" / "registry.log"
    in_swap, in_prepare = {}, {}
    for run_hosts, is_prepare, s, e in deploy_runs(log):
        for h in run_hosts:
            (in_prepare if is_prepare else in_swap)[h] = registry_bytes(access, ips[h], s, e)
    return {
        "hosts": n,
        "total_s": total,
        "outcomes": sorted({h["outcome"] for h in doc["hosts"]}),
        "downtime_median_s": statistics.median(downtimes),
        "downtime_max_s": max(downtimes),
        "bytes_in_swaps": sum(in_swap.values()),
        "bytes_in_swaps_max_host": max(in_swap.values()),
        "bytes_in_prepare": sum(in_prepare.values()),
        "swapped": len(in_swap),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path("/var/lib/gpufleet/rbench-runs") / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(config())
    fleet.start()
    rows = []
    try:
        for n in args.sizes:
            rows.append(bench(fleet, n, out_dir))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        fleet.stop()
    lines = [
        f"# gpufleet rollout bench {stamp}",
        "",
        "`gpufleet rollout INV --yes --json` (canary 1, batch 1) of N stand-in hosts from `good` to `good-next` "
        f"(bench/rollout_bench.py; settings {DATA}). Downtime: the host's /health not 200, polled through SSH by "
        "the rollout. Bytes in swaps: blob bytes the registry served the host inside the deploy run that restarted "
        "it (its downtime lies within), from the registry's access log.",
        "",
        "| hosts | total | downtime median | downtime max | bytes pulled in swaps | bytes pulled in prepare | outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['hosts']} | {r['total_s']:.1f} s | {r['downtime_median_s']:.1f} s | "
            f"{r['downtime_max_s']:.1f} s | {r['bytes_in_swaps']} | {r['bytes_in_prepare']} | "
            f"{', '.join(r['outcomes'])} |"
        )
    out = REPO / "bench" / "results" / f"rollout-{stamp}.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
