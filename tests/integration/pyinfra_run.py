"""Run pyinfra against just-booted test hosts."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# What pyinfra prints when a host refused or reset the SSH connection: nothing ran on any host then (pyinfra
# connects, and the deploy's preflight reads, before any operation executes), so the run may be repeated.
NOT_CONNECTED = re.compile(r"Could not connect|Connection reset by peer|Command socket/SSH error")


def run_deploy(pyinfra: Callable[..., subprocess.CompletedProcess[str]], inventory: Path, deploy: str, *args: str,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    """`pyinfra -y INVENTORY DEPLOY ARGS` (the `pyinfra` fixture), retried while a just-booted host refuses SSH;
    with check, a failed run raises with the end of its output."""
    for _ in range(3):
        proc = pyinfra(inventory, deploy, *args, check=False)
        if not NOT_CONNECTED.search(proc.stdout):
            break
        time.sleep(3)
    if check and proc.returncode != 0:
        raise AssertionError(f"{deploy} failed:\n{proc.stdout[-5000:]}")
    return proc
