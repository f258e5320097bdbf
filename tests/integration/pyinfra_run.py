"""Run pyinfra against just-booted test hosts."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# What pyinfra prints when a host refused or reset the SSH connection.
NOT_CONNECTED = re.compile(r"Could not connect|Connection reset by peer|Command socket/SSH error")
# pyinfra prints this once it has connected and read every host (the deploy's preflight included) and starts
# executing operations: only an SSH failure before it leaves every host as it was, so only then is a repeat the same
# run. After it, a repeat would meet what the first run left (a version it marked failed is refused the second time).
EXECUTION_STARTS = "--> Beginning operation run..."


def failed_to_connect(output: str) -> bool:
    """Whether a pyinfra run's output shows an SSH failure before any operation executed."""
    return bool(NOT_CONNECTED.search(output.partition(EXECUTION_STARTS)[0]))


def run_deploy(
    pyinfra: Callable[..., subprocess.CompletedProcess[str]],
    inventory: Path,
    deploy: str,
    *args: str,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """`pyinfra -y INVENTORY DEPLOY ARGS` (the `pyinfra` fixture), repeated while a just-booted host refuses SSH
    before anything executed; with check, a failed run raises with the end of its output."""
    for _ in range(3):
        proc = pyinfra(inventory, deploy, *args, check=False)
        if not failed_to_connect(proc.stdout):
            break
        time.sleep(3)
    if check and proc.returncode != 0:
        raise AssertionError(f"{deploy} failed:\n{proc.stdout[-5000:]}")
    return proc
