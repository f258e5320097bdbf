#!/usr/bin/env python3
"""Compile-cache carry in a rollout on nspawn test hosts (not a timed test): N 3x H200 hosts rolled from one
stand-in nightly to the next, canary 1, batch 1; the stand-in compiles for --compile-seconds when its version's
cache entry is absent (docs/compile-cache.md).

    sudo .venv/bin/python bench/carry_bench.py [--hosts 4] [--compile-seconds 15]

Boots its own fleet (bridge gf-cbench, 10.213.9.0/24, state /var/lib/gpufleet/cbench), converges the hosts on a
tag of its own (= `good`), moves the tag to `good-next` and runs the rollout (gpufleet.rollout.commands.roll_out, in this
process, so each host's CarryResult is at hand). Reported per host: bytes carried, warm or cold, time to ready
(container start to listening, from docker on the host) and downtime. Stops the fleet at the end, also on errors.
Writes bench/results/carry-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from gpufleet.rollout.commands import roll_out
from gpufleet.rollout.progress import Progress
from gpufleet.rollout.swap import SwapOptions
from gpufleet.sandbox.config import FleetConfig, H200x3
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.image import REPOSITORY
from gpufleet.sandbox.registry import move_tag

REPO = Path(__file__).resolve().parents[1]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
DEPLOY = REPO / "deploys" / "qwen35.py"


def config() -> FleetConfig:
    return FleetConfig(
        name="cbench",
        bridge="gf-cbench",
        net="10.213.9",
        host_prefix="gfcb",
        state_dir=Path("/var/lib/gpufleet/cbench"),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--compile-seconds", type=float, default=15.0)
    args = ap.parse_args()
    fleet = Fleet(config())
    fleet.start()
    try:
        hosts = fleet.add_hosts([H200x3] * args.hosts, first=1)
        image = f"{fleet.cfg.registry}/{REPOSITORY}:bench"
        data = {
            "vllm_ready_timeout": 120,
            "vllm_ready_soak_s": 5,
            "vllm_env": {"STANDIN_COMPILE_SECONDS": str(args.compile_seconds)},
        }
        inventory = fleet.cfg.state_dir / "carry_bench_hosts.py"
        inventory.write_text(
            "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
            f"gpuhosts = [(n, {{**d, **{data!r}, 'vllm_image': {image!r}}}) for n, d in "
            f"pyinfra_hosts({str(fleet.write_inventory())!r}) if n in {[h.name for h in hosts]!r}]\n"
        )
        move_tag(fleet.cfg.registry, "bench", "good")
        subprocess.run([PYINFRA, "-y", str(inventory), str(DEPLOY)], check=True, capture_output=True, timeout=900)
        move_tag(fleet.cfg.registry, "bench", "good-next")
        t0 = time.monotonic()
        result = roll_out(
            str(inventory),
            None,
            SwapOptions(deploy_file=DEPLOY, canary=1, batch=1),
            lambda *_: True,
            lambda names: Progress(names),
        )
        total = time.monotonic() - t0
        rows = []
        for outcome in result.outcomes:
            carried = result.carried.get(outcome.host)
            rows.append(
                {
                    "host": outcome.host,
                    "outcome": outcome.outcome.value,
                    "downtime_s": outcome.downtime_s,
                    **({k: v for k, v in dataclasses.asdict(carried).items() if k != "entries"} if carried else {}),
                    "entries": list(carried.entries) if carried else [],
                }
            )
        doc = {
            "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "hosts": args.hosts,
            "compile_seconds": args.compile_seconds,
            "stand_in_load_seconds": 2,
            "canary": 1,
            "batch": 1,
            "total_s": round(total, 1),
            "rows": rows,
        }
        out = REPO / "bench" / "results" / f"carry-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc, indent=1))
        print(f"written: {out}")
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
