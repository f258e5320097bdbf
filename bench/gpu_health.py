#!/usr/bin/env python3
"""Record the GPU health reading gpufleet runs, on the machine this runs on (a real GPU host), as a fixture.

    sudo python3 bench/gpu_health.py OUT_DIR        # from a checkout, with gpufleet importable (its venv, or PYTHONPATH=src)

Runs exactly gpufleet.health.gpu.COMMAND (the health query with its field learning, and the kernel log's NVRM lines:
the same shell the host snapshot holds), as root, and writes OUT_DIR/gpu-health.txt (its whole output),
OUT_DIR/gpu_health.txt and OUT_DIR/kernel_log.txt (each section), OUT_DIR/help-query-gpu.txt and
OUT_DIR/command.sh; then prints what gpufleet reads from it: each GPU's fields, the fields this driver lacks, and
each GPU's verdict by the default table (docs/gpu-health.md).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpufleet.facts.gpu_health import parse_health
from gpufleet.facts.gpu_verdict import judge
from gpufleet.health.gpu import COMMAND, KERNEL, QUERY
from gpufleet.hoststate import sections
from gpufleet.wire.gpu_verdicts import GpuSettings


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    argv = ["sh", "-c", COMMAND] if os.geteuid() == 0 else ["sudo", "-n", "sh", "-c", COMMAND]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    (out / "command.sh").write_text(COMMAND + "\n")
    (out / "gpu-health.txt").write_text(run.stdout + (f"\nrc={run.returncode}\n" if run.returncode else ""))
    if shutil.which("nvidia-smi"):
        helped = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True, timeout=60)
        (out / "help-query-gpu.txt").write_text(helped.stdout)
    found = sections.split(run.stdout.splitlines())
    for name in (QUERY, KERNEL):
        (out / f"{name}.txt").write_text("\n".join(found.get(name, [])) + "\n")
    health = parse_health(found.get(QUERY, []), found.get(KERNEL, []))
    print(f"query error: {health.error}\nkernel log error: {health.kernel_log_error}\nlacks: {', '.join(health.lacks)}")
    for reading in health.gpus:
        print({k: v for k, v in dataclasses.asdict(reading).items() if v not in (None, (), False)})
    for event in health.events:
        print(event)
    for gpu in judge(health, GpuSettings()).gpus:
        print(f"{gpu.name}: {gpu.verdict.label}" + (f": {gpu.evidence}" if gpu.evidence else ""))
    print(f"written to {out}")
    return 0 if health.gpus and health.error is None else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
