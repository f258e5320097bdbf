"""One run of the deploy through the pyinfra CLI on some hosts; each host's result is read from the run's result
file, never from its output."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.defaults import (
    EXPECT_COMMITTED_SETTING,
    IMAGE_REF_SETTING,
    MODEL_SHA_SETTING,
    RETRY_SETTING,
    SPEED_BASELINE_SETTING,
    STAGE_SETTING,
    STAGES,
    VERIFY_CHECKS_SETTING,
    VERIFY_PROBE_SETTING,
    Stage,
)
from gpufleet.errors import GpufleetError
from gpufleet.harness import packaged_deploy_file
from gpufleet.harness.result import RESULT_ENV, HostResult, read_result
from gpufleet.wire.checks import SERVING_CHECKS
from gpufleet.wire.speed import SpeedFigures

DEPLOY_FILE = Path("deploys") / "qwen35.py"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PR_SET_PDEATHSIG = 1


def default_deploy_file() -> Path:
    """deploys/qwen35.py here, else in the checkout installed from, else the packaged copy."""
    here = DEPLOY_FILE
    if here.is_file():
        return here
    beside = Path(__file__).resolve().parents[3] / DEPLOY_FILE
    if beside.is_file():
        return beside
    packaged = packaged_deploy_file("qwen35")
    if packaged.is_file():
        return packaged
    raise GpufleetError(
        f"{DEPLOY_FILE} not found, nor the package's own copy at {packaged} (fix: reinstall "
        "gpufleet, or pass --deploy PATH)"
    )


def pyinfra_command() -> str:
    beside = Path(sys.executable).with_name("pyinfra")  # the venv gpufleet runs from
    return str(beside) if beside.exists() else "pyinfra"


@dataclass(frozen=True)
class DeployRun:
    hosts: tuple[str, ...]
    returncode: int
    output: str  # never parsed
    seconds: float
    results: Mapping[str, HostResult] = field(default_factory=dict)
    ended: Mapping[str, str] = field(default_factory=dict)  # host -> the line when the run has no result for it

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def problems(self, host: str) -> list[str]:
        """Why `host` did not converge; [] when it did or only another host failed."""
        result = self.results.get(host)
        if result is not None:
            return [] if result.ok else list(result.problems)
        if self.ok:
            return []
        return [
            self.ended.get(host)
            or f"{host}: the deploy run exited {self.returncode} without a result for this "
            "host (fix: see why in the deploy output, --log)"
        ]

    def summary(self, host: str) -> str:
        found = self.problems(host)
        if found:
            return " | ".join(found)
        result = self.results.get(host)
        if result is not None and not result.ok:
            return f"{host}: not done: the deploy run stopped for another host (exit {self.returncode})"
        return f"{host}: the deploy run exited {self.returncode} and names no problem of this host (see --log)"


def dies_with_parent() -> Callable[[], None]:
    """A preexec_fn killing the child with this process. prctl is looked up here: dlopen in the forked child of a
    threaded process may hang."""
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        prctl = None

    def in_child() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # A parent killed before prctl sent no signal.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


@dataclass(frozen=True)
class RunSettings:
    """What the rollout sets for one deploy run; a field left at its default keeps the host's own value.

    >>> RunSettings(image_ref="repo@sha256:ab", stage="prepare").data_args()
    ['--data', 'gpufleet_image_ref=repo@sha256:ab', '--data', 'gpufleet_stage=prepare']
    """

    image_ref: str | None = None
    model_sha: str | None = None  # the model's commit
    stage: Stage | None = None
    verify_checks: tuple[str, ...] | None = None  # (): none beside the answers
    # The deploy refuses a host whose ledger moved since the rollout read this.
    expect_committed: Mapping[str, str | None] | None = None
    verify_probe: bool = False
    retry_failed: bool = False
    speed_baseline: Mapping[str, SpeedFigures] | None = None  # measured before the swap

    def __post_init__(self) -> None:
        if self.stage is not None and self.stage not in STAGES:
            raise ValueError(f"stage {self.stage!r} is not one of {', '.join(STAGES)}")
        unknown = [name for name in self.verify_checks or () if name not in SERVING_CHECKS]
        if unknown:
            raise ValueError(f"unknown check {', '.join(unknown)} (known: {', '.join(SERVING_CHECKS)})")

    def data_args(self) -> list[str]:
        """pyinfra's `--data NAME=TEXT` for each field set."""
        checks = None if self.verify_checks is None else ",".join(self.verify_checks) or "none"
        committed = (
            None if self.expect_committed is None else json.dumps(dict(self.expect_committed), separators=(",", ":"))
        )
        baseline = (
            None
            if not self.speed_baseline
            else json.dumps(
                {host: figures.as_dict() for host, figures in self.speed_baseline.items()}, separators=(",", ":")
            )
        )
        named: tuple[tuple[str, str | None], ...] = (
            (IMAGE_REF_SETTING, self.image_ref),
            (MODEL_SHA_SETTING, self.model_sha),
            (STAGE_SETTING, self.stage),
            (VERIFY_CHECKS_SETTING, checks),
            (EXPECT_COMMITTED_SETTING, committed),
            (VERIFY_PROBE_SETTING, "true" if self.verify_probe else None),
            (RETRY_SETTING, "true" if self.retry_failed else None),
            (SPEED_BASELINE_SETTING, baseline),
        )
        return [arg for name, text in named if text is not None for arg in ("--data", f"{name}={text}")]


def run_deploy(
    inventory: str,
    hosts: Sequence[str],
    settings: RunSettings,
    deploy_file: Path,
    *,
    log: Path | None = None,
    timeout_s: float | None = None,
) -> DeployRun:
    """pyinfra -y INVENTORY DEPLOY --limit h ... --data k=v ...; its output appended to `log`."""
    # pyinfra reads a comma-separated --limit as one pattern.
    limits = [arg for host in hosts for arg in ("--limit", host)]
    argv = [pyinfra_command(), "-y", inventory, str(deploy_file), *limits, *settings.data_args()]
    start, started_at = time.monotonic(), time.time()
    ended: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="gpufleet-run-") as scratch:
        where = Path(scratch) / "result.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", RESULT_ENV: str(where)}
        try:
            proc = subprocess.run(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                timeout=timeout_s,
                preexec_fn=dies_with_parent(),
            )
            rc, output = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:
            raw = e.stdout or ""
            rc, output = 124, (raw.decode(errors="replace") if isinstance(raw, bytes) else raw)
            ended = {
                host: f"{host}: failed: the deploy run passed its time limit of {timeout_s:g} s and was ended, "
                "releasing the host's lock (fix: see why in the log; --stage-timeout raises the limit)"
                for host in hosts
            }
        results = None if ended else read_result(where)
    output = _ANSI.sub("", output)
    if results is not None:
        missing = {
            host: f"{host}: the run's result does not list it: the inventory names no such host (fix: check "
            "the name against the inventory)"
            for host in hosts
            if host not in results
        }
        ended.update(missing)
        rc = 1 if missing and rc == 0 else rc
    elif rc == 0:
        # pyinfra exits 0 having run nothing when no host matched.
        ended = {
            host: f"{host}: the deploy run exited 0 without writing its result: it ran nothing (no host of the "
            "inventory matched, or the deploy file does not call gpufleet.harness.register_deploy_file)"
            for host in hosts
        }
        rc = 1
    if ended:
        output += "".join(f"\n{line}" for line in ended.values()) + "\n"
    if log is not None:
        # The epoch window places host events inside or outside a swap from the log alone.
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n{output}\n[exit {rc}; started {started_at:.3f}; ended {time.time():.3f}]\n")
    return DeployRun(tuple(hosts), rc, output, time.monotonic() - start, results or {}, ended)
