"""One run of the deploy (deploys/qwen35.py through the pyinfra CLI) on some hosts, with the rollout's settings
passed as `--data key=value`: the same preflight, lock, ledger and verify as a plain converge."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.deploys import packaged_deploy_file
from gpufleet.deploys.summary import without_summary
from gpufleet.errors import GpufleetError, one_line

DEPLOY_FILE = Path("deploys") / "qwen35.py"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PROBLEM = re.compile(r"error|fail|refus|reject|not ready|rolled back|cannot|could not", re.IGNORECASE)
PR_SET_PDEATHSIG = 1
NO_MATCH = "No host matches found for --limit"


def default_deploy_file() -> Path:
    """deploys/qwen35.py of the working directory (a checkout, as the README runs pyinfra), else of the checkout
    this package is installed from, else the copy shipped in the package (an installed wheel, no checkout)."""
    here = DEPLOY_FILE
    if here.is_file():
        return here
    beside = Path(__file__).resolve().parents[3] / DEPLOY_FILE
    if beside.is_file():
        return beside
    packaged = packaged_deploy_file("qwen35")
    if packaged.is_file():
        return packaged
    raise GpufleetError(f"{DEPLOY_FILE} not found, nor the package's own copy at {packaged} (fix: reinstall "
                        "gpufleet, or pass --deploy PATH)")


def pyinfra_command() -> str:
    beside = Path(sys.executable).with_name("pyinfra")  # the venv gpufleet runs from
    return str(beside) if beside.exists() else "pyinfra"


@dataclass(frozen=True)
class DeployRun:
    hosts: tuple[str, ...]
    returncode: int
    output: str  # stdout and stderr together, colours stripped
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def problems(self, host: str, last: int = 2) -> list[str]:
        """The run's last lines about `host` that report a problem ("[host] ..." or "host: ...")."""
        # The summary's lines at the end repeat each failed host without its reason: read what came before them.
        lines = [line.strip() for line in without_summary(self.output).splitlines()
                 if (f"[{host}]" in line or line.strip().startswith(f"{host}:")) and _PROBLEM.search(line)]
        return [one_line(line) for line in lines[-last:]]

    def summary(self, host: str) -> str:
        found = self.problems(host)
        if found:
            return " | ".join(found)
        tail = [line.strip() for line in self.output.splitlines() if line.strip()][-2:]
        return one_line(" | ".join(tail)) or f"pyinfra exited {self.returncode}"


def _die_with_parent() -> None:
    # A killed controller must not leave a deploy running on its own: the child dies with it, its SSH sessions
    # close, and each host's lock frees at once (gpufleet.hostlock); the re-run resumes from the ledgers.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def settings_args(settings: Mapping[str, object]) -> list[str]:
    args: list[str] = []
    for key, value in settings.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        args += ["--data", f"{key}={text}"]
    return args


def run_deploy(inventory: str, hosts: Sequence[str], settings: Mapping[str, object], deploy_file: Path,
               log: Path | None = None, timeout_s: float | None = None) -> DeployRun:
    """pyinfra -y INVENTORY DEPLOY --limit h1,h2 --data k=v ...; its output is kept (and appended to `log`)."""
    # One --limit per host: pyinfra reads each as one name pattern (a comma-separated list matches nothing).
    limits = [arg for host in hosts for arg in ("--limit", host)]
    argv = [pyinfra_command(), "-y", inventory, str(deploy_file), *limits, *settings_args(settings)]
    start, started_at = time.monotonic(), time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              timeout=timeout_s, preexec_fn=_die_with_parent)
        rc, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        # subprocess.run has killed the run by its PID: its SSH sessions closed, so each host's lock went with them.
        raw = e.stdout or ""
        rc, output = 124, (raw.decode(errors="replace") if isinstance(raw, bytes) else raw)
        output += "".join(f"\n{host}: failed: the deploy run passed its time limit of {timeout_s:g} s and was ended, "
                          "releasing the host's lock (fix: see why in the log; --stage-timeout raises the limit)"
                          for host in hosts) + "\n"
    output = _ANSI.sub("", output)
    if rc == 0 and NO_MATCH in output:
        # pyinfra exits 0 having run nothing: never read as "prepared" or "swapped".
        rc, output = 1, output + f"\n{NO_MATCH} (the inventory does not name {', '.join(hosts)} as given)\n"
    if log is not None:
        # The run's wall-clock window (epoch seconds) is part of the record: what happened on a host, and what the
        # registry served it, can be put inside or outside a swap from the log alone.
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n{output}\n[exit {rc}; started {started_at:.3f}; ended {time.time():.3f}]\n")
    return DeployRun(tuple(hosts), rc, output, time.monotonic() - start)
