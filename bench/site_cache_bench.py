#!/usr/bin/env python3
"""One download per site, measured (not a timed test): `gpufleet rollout` of N stand-in hosts to a new nightly
(`good` + 100 MiB of incompressible bytes of its own), with and without the site cache.

    sudo .venv/bin/python bench/site_cache_bench.py [--hosts 4]

Boot N fresh 3x H200 hosts (fleet scbench: bridge gf-scbench, 10.213.8.0/24, state /var/lib/gpufleet/scbench),
the first of them also the site cache (inventory group `site_cache`); converge them on a tag of the bench's own (=
`good`); then, for each mode, move the tag to the next nightly and time `gpufleet rollout INV --yes --json`:
  - "site cache": every host pulls through the cache (the cache host alone first, then the rest at once);
  - "no cache": site_cache_address "off" on every host (one prepare run of all hosts, each from upstream).
Reported per mode: the blob bytes the fleet's registry (the "upstream") served, from its access log, in total and
per client; the prepare runs' time (from the rollout's log: each deploy run's window); the rollout's total; each
host's pull record (bytes from the site, from upstream, fell back). Writes bench/results/site-cache-<UTC>.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from gpufleet.facts.pull import PullStats
from gpufleet.operations.image import pull_stats_file
from gpufleet.sandbox import image as sandbox_image
from gpufleet.sandbox import services
from gpufleet.sandbox.config import FleetConfig, H200x3
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.image import REPOSITORY
from gpufleet.sandbox.inventory import inventory_document

REPO = Path(__file__).resolve().parents[1]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
DATA = {"vllm_ready_timeout": 120, "vllm_ready_soak_s": 5}
ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
RUN = re.compile(r"^\$ (?P<argv>.*)$", re.MULTILINE)
WINDOW = re.compile(r"^\[exit (?P<rc>-?\d+); started (?P<start>[\d.]+); ended (?P<end>[\d.]+)\]$", re.MULTILINE)
SERVICE = "vllm-qwen35"


def config() -> FleetConfig:
    return FleetConfig(name="scbench", bridge="gf-scbench", net="10.213.8", host_prefix="gfsc",
                       state_dir=Path("/var/lib/gpufleet/scbench"))


def move_tag(registry: str, tag: str, to: str) -> str:
    base = f"http://{registry}/v2/{REPOSITORY}/manifests/"
    with urllib.request.urlopen(urllib.request.Request(base + to, headers={"Accept": ACCEPT}), timeout=30) as r:
        body, content_type, digest = r.read(), r.headers["Content-Type"], r.headers["Docker-Content-Digest"]
    urllib.request.urlopen(urllib.request.Request(base + tag, data=body, method="PUT",
                                                  headers={"Content-Type": content_type}), timeout=30).read()
    return digest


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


def write_inventory(fleet: Fleet, path: Path, tag: str, cache: bool) -> None:
    hosts = fleet.hosts()
    doc = inventory_document(fleet.cfg, hosts, fleet.key, site_cache=(hosts[0].name,))
    data = {**doc["host_data"], **DATA, "vllm_image": f"{fleet.cfg.registry}/{REPOSITORY}:{tag}"}
    if not cache:
        data["site_cache_address"] = "off"
    rows = [(h.name, {"ssh_hostname": h.ip, **data}) for h in hosts]
    path.write_text(f"gpuhosts = {rows!r}\nsite_cache = {rows[:1]!r}\n")


def rollout(fleet: Fleet, inventory: Path, log: Path, tag: str, nightly: str, cache: bool) -> dict:
    hosts = fleet.hosts()
    write_inventory(fleet, inventory, tag, cache)
    digest = move_tag(fleet.cfg.registry, tag, nightly)
    before = services.log_offset(fleet.cfg)
    start = time.monotonic()
    proc = subprocess.run([GPUFLEET, "rollout", str(inventory), "--yes", "--json", "--log", str(log)],
                          capture_output=True, text=True, timeout=3600, cwd=REPO)
    total = time.monotonic() - start
    served = services.blob_bytes(fleet.cfg, since=before)
    ips = {h.ip: h.name for h in hosts}
    records = {h.name: PullStats.from_json(fleet.run_in(h, f"cat {pull_stats_file(SERVICE)}", check=False).stdout)
               for h in hosts}
    try:
        outcomes = sorted({h["outcome"] for h in json.loads(proc.stdout)["hosts"]})
    except (ValueError, KeyError, TypeError):
        outcomes = [f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"]
    return {"mode": "site cache" if cache else "no cache", "hosts": len(hosts), "nightly": nightly,
            "digest": digest, "rollout_s": round(total, 1), "outcomes": outcomes,
            "upstream_bytes": sum(served.values()),
            "upstream_by_host": {ips.get(ip, ip): b for ip, b in sorted(served.items())},
            "prepare_runs": [(hs, round(s, 1)) for hs, s in prepare_windows(log)],
            "records": {n: r and {"site": r.site_bytes, "upstream": r.upstream_bytes, "fell_back": r.fell_back}
                        for n, r in records.items() if r is None or r.ref.endswith(digest)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    args = parser.parse_args()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path("/var/lib/gpufleet/scbench-runs") / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(config())
    fleet.start()
    rows = []
    try:
        sandbox_image.ensure_nightlies(fleet.cfg)
        layer = json.loads(sandbox_image.registry_request(fleet.cfg, f"/v2/{REPOSITORY}/manifests/nightly-1",
                                                   headers={"Accept": ACCEPT})[2])["layers"]
        image_bytes = sum(layer_["size"] for layer_ in layer)
        new_bytes = layer[-1]["size"]  # what a host on `good` lacks: the nightly's own layer
        fleet.add_hosts([H200x3] * args.hosts, first=1)
        tag = f"scbench-{int(time.time())}"
        move_tag(fleet.cfg.registry, tag, "good")
        inventory = out_dir / "inventory.py"
        write_inventory(fleet, inventory, tag, cache=True)
        for _ in range(3):  # just-booted hosts may refuse the first SSH connection
            proc = subprocess.run([PYINFRA, "-y", str(inventory), str(REPO / "deploys" / "qwen35.py")],
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode == 0:
                break
            time.sleep(3)
        if proc.returncode != 0:
            raise SystemExit(f"converge failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        for nightly, cache in (("nightly-1", True), ("nightly-2", False)):
            rows.append(rollout(fleet, inventory, out_dir / f"rollout-{nightly}.log", tag, nightly, cache))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        fleet.stop()
    lines = [
        f"# gpufleet site cache bench {stamp}", "",
        f"`gpufleet rollout INV --yes --json` (canary 1, batch 1) of {args.hosts} stand-in hosts to a new nightly "
        f"(`good` + one layer of 100 MiB of incompressible bytes, {new_bytes} bytes compressed: what a host on `good` "
        f"lacks; the whole image {image_bytes} bytes), "
        "with the site cache on the first host and with site_cache_address \"off\" (bench/site_cache_bench.py; "
        f"settings {DATA}). Upstream bytes: blob bytes the fleet's registry served, from its access log. Prepare "
        "runs: each prepare deploy run's hosts and wall time, from the rollout's log.", "",
        "| mode | hosts | upstream bytes | upstream bytes / new layer | prepare runs | rollout total | outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = "; ".join(f"{','.join(h)}: {s} s" for h, s in r["prepare_runs"])
        lines.append(f"| {r['mode']} | {r['hosts']} | {r['upstream_bytes']} | "
                     f"{r['upstream_bytes'] / new_bytes:.2f} | {runs} | {r['rollout_s']} s | "
                     f"{', '.join(r['outcomes'])} |")
    lines += ["", "Per host (each host's pull record: bytes from the site cache, from upstream, fell back):", ""]
    for r in rows:
        lines.append(f"- {r['mode']}: upstream served {r['upstream_by_host']}; records {r['records']}")
    out = REPO / "bench" / "results" / f"site-cache-{stamp}.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
