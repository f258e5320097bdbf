#!/usr/bin/env python3
"""One download per site and only the canary compiling, measured (not a timed test): `gpufleet rollout` of N
stand-in hosts to a new nightly (`good` + 100 MiB of incompressible bytes of its own), with the site cache and the
compile-cache carry, and with neither.

    sudo .venv/bin/python bench/site_cache_bench.py [--hosts 4] [--compile-seconds 15]

Boot N fresh 3x H200 hosts (fleet scbench: bridge gf-scbench, 10.213.8.0/24, state /var/lib/gpufleet/scbench),
the first of them also the site cache (inventory group `site_cache`); converge them on a tag of the bench's own (=
`good`); then, for each mode, move the tag to the next nightly and time `gpufleet rollout INV --yes --json`:
  - "site cache + carry": every host pulls through the cache (the cache host alone first, then the rest at once),
    and the hosts after the canary take its compile cache;
  - "no cache, no carry": site_cache_address "off" on every host (one prepare run of all hosts, each from
    upstream) and `--no-carry` (every host compiles).
The stand-in compiles for --compile-seconds on a start without its version's cache entry (STANDIN_COMPILE_SECONDS).
Reported per mode: the blob bytes the fleet's registry (the "upstream") served, from its access log, in total and
per client; the prepare runs' time (from the rollout's log: each deploy run's window); the rollout's total; each
host's row of the rollout's JSON (bytes from the site and from upstream, warm or cold, time to ready, downtime).
Writes bench/results/site-cache-<UTC>.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from converge import converge_fresh_hosts

from gpufleet.facts.pull import PullStats
from gpufleet.sandbox import registry as sandbox_registry
from gpufleet.sandbox import services
from gpufleet.sandbox.config import FleetConfig, H200x3
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.image import REPOSITORY
from gpufleet.sandbox.inventory import inventory_document
from gpufleet.sandbox.registry import move_tag
from gpufleet.vllm.operations.image import pull_stats_file

REPO = Path(__file__).resolve().parents[1]
GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
DATA = {"vllm_ready_timeout": 120, "vllm_ready_soak_s": 5}
RUN = re.compile(r"^\$ (?P<argv>.*)$", re.MULTILINE)
WINDOW = re.compile(r"^\[exit (?P<rc>-?\d+); started (?P<start>[\d.]+); ended (?P<end>[\d.]+)\]$", re.MULTILINE)
SERVICE = "vllm-qwen35"


def config() -> FleetConfig:
    return FleetConfig(
        name="scbench",
        bridge="gf-scbench",
        net="10.213.8",
        host_prefix="gfsc",
        state_dir=Path("/var/lib/gpufleet/scbench"),
    )


def prepare_windows(log: Path) -> list[tuple[list[str], float]]:
    """(hosts, seconds) of each prepare run the rollout logged."""
    text = log.read_text()
    out = []
    for head, window in zip(RUN.finditer(text), WINDOW.finditer(text), strict=True):
        argv = head["argv"].split()
        if "gpufleet_stage=prepare" in argv:
            hosts = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--limit"]
            out.append((hosts, float(window["end"]) - float(window["start"])))
    return out


def write_inventory(fleet: Fleet, path: Path, tag: str, cache: bool, compile_seconds: float) -> None:
    hosts = fleet.hosts()
    doc = inventory_document(fleet.cfg, hosts, fleet.key, site_cache=(hosts[0].name,))
    data = {
        **doc["host_data"],
        **DATA,
        "vllm_image": f"{fleet.cfg.registry}/{REPOSITORY}:{tag}",
        "vllm_env": {"STANDIN_COMPILE_SECONDS": str(compile_seconds)},
    }
    if not cache:
        data["site_cache_address"] = "off"
    rows = [(h.name, {"ssh_hostname": h.ip, **data}) for h in hosts]
    path.write_text(f"gpuhosts = {rows!r}\nsite_cache = {rows[:1]!r}\n")


def rollout(
    fleet: Fleet, inventory: Path, log: Path, tag: str, nightly: str, cache: bool, compile_seconds: float
) -> dict:
    hosts = fleet.hosts()
    write_inventory(fleet, inventory, tag, cache, compile_seconds)
    digest = move_tag(fleet.cfg.registry, tag, nightly)
    before = services.log_offset(fleet.cfg)
    start = time.monotonic()
    proc = subprocess.run(
        [GPUFLEET, "rollout", str(inventory), "--yes", "--json", "--log", str(log), *([] if cache else ["--no-carry"])],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=REPO,
    )
    total = time.monotonic() - start
    served = services.blob_bytes(fleet.cfg, since=before)
    ips = {h.ip: h.name for h in hosts}
    records = {
        h.name: PullStats.from_json(fleet.run_in(h, f"cat {pull_stats_file(SERVICE)}", check=False).stdout)
        for h in hosts
    }
    try:
        rows = json.loads(proc.stdout)["hosts"]
        outcomes = sorted({h["outcome"] for h in rows})
    except (ValueError, KeyError, TypeError):
        rows, outcomes = [], [f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"]
    keep = ("host", "outcome", "site_bytes", "upstream_bytes", "warm", "time_to_ready_s", "downtime_s")
    # What one host had to download (its pull record's bytes; without a cache its record has no upstream size, so
    # what the registry served that host): the measure "one image" is counted in.
    need = {
        h.name: (r.site_bytes or 0) + r.upstream_bytes
        if (r := records[h.name]) and r.upstream_bytes is not None
        else served.get(h.ip, 0)
        for h in hosts
    }
    return {
        "mode": "site cache + carry" if cache else "no cache, no carry",
        "hosts": len(hosts),
        "nightly": nightly,
        "one_host_bytes": max(need.values(), default=0),
        "rows": [{k: r.get(k) for k in keep} for r in rows],
        "digest": digest,
        "rollout_s": round(total, 1),
        "outcomes": outcomes,
        "upstream_bytes": sum(served.values()),
        "upstream_by_host": {ips.get(ip, ip): b for ip, b in sorted(served.items())},
        "prepare_runs": [(hs, round(s, 1)) for hs, s in prepare_windows(log)],
        "records": {
            n: r and {"site": r.site_bytes, "upstream": r.upstream_bytes, "fell_back": r.fell_back}
            for n, r in records.items()
            if r is None or r.ref.endswith(digest)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--compile-seconds", type=float, default=15.0)
    args = parser.parse_args()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path("/var/lib/gpufleet/scbench-runs") / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(config())
    fleet.start()
    rows = []
    try:
        sandbox_registry.ensure_nightlies(fleet.cfg)
        layer = json.loads(
            sandbox_registry.registry_request(
                fleet.cfg, f"/v2/{REPOSITORY}/manifests/nightly-1", headers={"Accept": sandbox_registry.MANIFEST_TYPE}
            )[2]
        )["layers"]
        image_bytes = sum(layer_["size"] for layer_ in layer)
        new_bytes = layer[-1]["size"]  # the nightly's own layer: what a host on the other nightly lacks
        fleet.add_hosts([H200x3] * args.hosts, first=1)
        tag = f"scbench-{int(time.time())}"
        move_tag(fleet.cfg.registry, tag, "good")
        inventory = out_dir / "inventory.py"
        write_inventory(fleet, inventory, tag, True, args.compile_seconds)
        converge_fresh_hosts(inventory)
        for nightly, cache in (("nightly-1", True), ("nightly-2", False)):
            rows.append(
                rollout(fleet, inventory, out_dir / f"rollout-{nightly}.log", tag, nightly, cache, args.compile_seconds)
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        fleet.stop()
    lines = [
        f"# gpufleet site cache bench {stamp}",
        "",
        f"`gpufleet rollout INV --yes --json` (canary 1, batch 1) of {args.hosts} stand-in hosts to a new nightly "
        f"(`good` + one layer of 100 MiB of incompressible bytes, {new_bytes} bytes compressed; the whole image "
        f"{image_bytes} bytes), "
        "first from `good` to nightly-1 with the site cache on the first host and the compile-cache carry, then to "
        'nightly-2 with site_cache_address "off" and '
        f"--no-carry (bench/site_cache_bench.py; settings {DATA}; the stand-in compiles for {args.compile_seconds:g} s "
        "on a start without its version's cache entry). Upstream bytes: blob bytes the fleet's registry served, from "
        "its access log; one host's download: what one host had to fetch (its pull record, or what the registry served "
        "it). Prepare runs: each prepare deploy run's hosts and wall time, from the rollout's log.",
        "",
        "| mode | hosts | upstream bytes | one host's download | upstream / one host's download | prepare runs | "
        "rollout total | outcomes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = "; ".join(f"{','.join(h)}: {s} s" for h, s in r["prepare_runs"])
        lines.append(
            f"| {r['mode']} | {r['hosts']} | {r['upstream_bytes']} | {r['one_host_bytes']} | "
            f"{r['upstream_bytes'] / max(1, r['one_host_bytes']):.2f} | {runs} | {r['rollout_s']} s | "
            f"{', '.join(r['outcomes'])} |"
        )
    lines += [
        "",
        "Per host, from the rollout's JSON (bytes from the site cache and from upstream: the host's pull "
        "record; start: warm when the engine loaded compiled artifacts; time to ready: container start to "
        "listening):",
        "",
        "| mode | host | outcome | site bytes | upstream bytes | start | time to ready | downtime |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for h in r["rows"]:
            start = {True: "warm", False: "cold", None: "-"}[h["warm"]]
            lines.append(
                f"| {r['mode']} | {h['host']} | {h['outcome']} | {h['site_bytes']} | {h['upstream_bytes']} "
                f"| {start} | {h['time_to_ready_s']} s | {h['downtime_s']} s |"
            )
    lines += ["", "Upstream bytes per client (the registry's access log) and each host's pull record:", ""]
    for r in rows:
        lines.append(f"- {r['mode']}: upstream served {r['upstream_by_host']}; records {r['records']}")
    out = REPO / "bench" / "results" / f"site-cache-{stamp}.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
