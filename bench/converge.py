"""The first converge of a bench's freshly booted hosts (bench/rollout_bench.py, bench/site_cache_bench.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
DEPLOY = REPO / "deploys" / "qwen35.py"
ATTEMPTS = 3  # just-booted hosts may refuse the first SSH connection


def converge_fresh_hosts(inventory: Path, what: str = "converge") -> None:
    """`pyinfra -y INVENTORY deploys/qwen35.py`, tried ATTEMPTS times 3 s apart; SystemExit("<what> failed:" and the
    output's tail) when none succeeds.

        converge_fresh_hosts(out_dir / "inventory-4.py", "converge of 4 hosts")
    """
    for _ in range(ATTEMPTS):
        proc = subprocess.run(
            [PYINFRA, "-y", str(inventory), str(DEPLOY)], capture_output=True, text=True, timeout=1800
        )
        if proc.returncode == 0:
            return
        time.sleep(3)
    raise SystemExit(f"{what} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
