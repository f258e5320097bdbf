#!/usr/bin/env python3
"""The model's weights once per site, measured (not a timed test): what the stand-in Hugging Face hub serves when
N fresh sandbox hosts converge with the site cache's model mirror (olah on the first host), when a host is added
later, and, for comparison, when the same hosts download without the mirror.

    sudo .venv/bin/python bench/model_cache_bench.py [--hosts 3] [--shard-mib 64]

Boot N+1 fresh 3x H200 hosts (fleet mcbench: bridge gf-mcbench, 10.213.20.0/24, state /var/lib/gpufleet/mcbench);
the hub's model is the stand-in tiny model plus one shard of --shard-mib MiB of seeded incompressible bytes. Then:
  1. a first converge of hosts 1..N (host 1 the site cache), all at once;
  2. a converge of host N+1 alone, added later;
  3. the model directories of hosts 1..N emptied, and a converge of them with site_cache_address "off": each from
     the hub, as before the mirror.
Reported per step: the body bytes of `resolve` the hub served (its access log), in total and per client, over the
model's bytes; each host's checked commit (its model directory's mark); the step's wall time.
Writes bench/results/model-cache-<UTC>.md.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from converge import DEPLOY, PYINFRA

from gpufleet.sandbox import hub as standin_hub
from gpufleet.sandbox import services
from gpufleet.sandbox.config import FleetConfig, H200x3
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.image import MODEL_REPO, write_tiny_model
from gpufleet.sandbox.inventory import inventory_document
from gpufleet.vllm.settings import merged_settings
from gpufleet.vllm.weights import MARKER

REPO = Path(__file__).resolve().parents[1]
DATA = {"vllm_ready_timeout": 120, "vllm_ready_soak_s": 2}
MODEL_DIR = f"{merged_settings({})['vllm_models_dir']}/{merged_settings({})['vllm_model']}"


def config() -> FleetConfig:
    return FleetConfig(
        name="mcbench",
        bridge="gf-mcbench",
        net="10.213.20",
        host_prefix="gfmc",
        state_dir=Path("/var/lib/gpufleet/mcbench"),
    )


def write_inventory(fleet: Fleet, path: Path, **extra: object) -> None:
    """Every host (the cache lets the inventory's hosts in); each step limits the run to its own."""
    hosts = fleet.hosts()
    doc = inventory_document(fleet.cfg, hosts, fleet.key, site_cache=(hosts[0].name,))
    rows = [(h.name, {"ssh_hostname": h.ip, **doc["host_data"], **DATA, **extra}) for h in hosts]
    path.write_text(f"gpuhosts = {rows!r}\nsite_cache = {rows[:1]!r}\n")


def step(fleet: Fleet, inventory: Path, what: str, names: list[str], size: int) -> dict[str, object]:
    log = services.hub_log(fleet.cfg)
    before = log.stat().st_size if log.exists() else 0
    start = time.monotonic()
    for attempt in range(3):  # just-booted hosts may refuse the first SSH connection
        limit = [a for n in names for a in ("--limit", n)]
        proc = subprocess.run(
            [PYINFRA, "-y", *limit, str(inventory), str(DEPLOY)], capture_output=True, text=True, timeout=1800
        )
        if proc.returncode == 0:
            break
        if attempt == 2:
            raise SystemExit(f"{what} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        time.sleep(3)
    wall = time.monotonic() - start
    served = standin_hub.served_bytes(log, before)
    ips = {h.ip: h.name for h in fleet.hosts()}
    marks = {n: fleet.run_in(n, f"cat {MODEL_DIR}/{MARKER}", check=False).stdout.strip() for n in names}
    return {
        "step": what,
        "hosts": names,
        "hub_bytes": sum(served.values()),
        "model_bytes": size,
        "by_client": {ips.get(ip, ip): b for ip, b in sorted(served.items())},
        "marks": marks,
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--shard-mib", type=int, default=64)
    args = parser.parse_args()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path("/var/lib/gpufleet/mcbench-runs") / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(config())
    fleet.start()
    rows = []
    try:
        model = out_dir / "model"
        write_tiny_model(model)
        shard = random.Random(39).randbytes(args.shard_mib << 20)  # seeded: the same bytes every run
        files: dict[str, bytes | Path] = {p.name: p for p in model.iterdir()}
        files["model-00002-of-00002.safetensors"] = shard
        commit = standin_hub.publish(services.hub_root(fleet.cfg), MODEL_REPO, files)
        size = sum(f.size for f in standin_hub.listing(services.hub_root(fleet.cfg), MODEL_REPO, commit))
        hosts = fleet.add_hosts([H200x3] * (args.hosts + 1), first=1)
        first, later = [h.name for h in hosts[:-1]], [hosts[-1].name]
        inventory = out_dir / "inventory.py"
        write_inventory(fleet, inventory)
        rows.append(
            step(fleet, inventory, f"first converge of {len(first)} hosts, site cache on {first[0]}", first, size)
        )
        print(json.dumps(rows[-1]), flush=True)
        rows.append(step(fleet, inventory, "a host added later", later, size))
        print(json.dumps(rows[-1]), flush=True)
        for name in first:
            fleet.run_in(name, f"rm -rf {MODEL_DIR}")
        write_inventory(fleet, inventory, site_cache_address="off")
        rows.append(
            step(
                fleet,
                inventory,
                f'the same {len(first)} hosts without the mirror (site_cache_address "off"), model directories emptied',
                first,
                size,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    finally:
        fleet.stop()
    lines = [
        f"# gpufleet model cache bench {stamp}",
        "",
        f"`pyinfra -y INV deploys/qwen35.py` on fresh stand-in hosts (bench/model_cache_bench.py; settings "
        f"{DATA}). The stand-in hub's model: the tiny model plus one shard of {args.shard_mib} MiB of seeded "
        f"incompressible bytes, {size} bytes in all. Hub bytes: the body bytes of `resolve` the hub served, "
        "from its access log.",
        "",
        "| step | hub bytes | / the model's bytes | by client | wall |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['hub_bytes']} | {int(r['hub_bytes']) / size:.2f} | {r['by_client']} | "
            f"{r['wall_s']} s |"
        )
    lines += ["", "Each host's model directory was checked at (its `.gpufleet-model` mark):", ""]
    for r in rows:
        lines.append(f"- {r['step']}: {r['marks']}")
    out = REPO / "bench" / "results" / f"model-cache-{stamp}.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
