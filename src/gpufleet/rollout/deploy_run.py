"""One run of the deploy (deploys/qwen35.py through the pyinfra CLI) on some hosts, with the rollout's settings
(RunSettings) passed as `--data key=value`: the same preflight, lock, ledger and verify as a plain converge. What
each host's run came to is read from the result file the run writes at exit (gpufleet.harness.result), never from
its printed output; a run that wrote none (killed, timed out, crashed while loading) fails each of its hosts on one
line."""

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
    MODEL_REF_SETTING,
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
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # pyinfra's colours, kept out of the log
PR_SET_PDEATHSIG = 1


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
    output: str  # stdout and stderr together, colours stripped: for the log and a reader, never parsed
    seconds: float
    # host -> what the run's result file says of it; empty when the run wrote none
    results: Mapping[str, HostResult] = field(default_factory=dict)
    # host -> the one line to give when the run has no result for it (a time limit passed, not in the inventory)
    ended: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def problems(self, host: str) -> list[str]:
        """Why `host` did not converge, one line each: its result's problems; [] when it converged or had none of
        its own (the run stopped for another host). A host the run has no result for fails on one line when the run
        failed: the exit code, and where its error is."""
        result = self.results.get(host)
        if result is not None:
            return [] if result.ok else list(result.problems)
        if self.ok:
            return []
        return [self.ended.get(host) or f"{host}: the deploy run exited {self.returncode} without a result for this "
                "host (fix: see why in the deploy output, --log)"]

    def summary(self, host: str) -> str:
        """problems() on one line, else what the run says of the host without naming a problem."""
        found = self.problems(host)
        if found:
            return " | ".join(found)
        result = self.results.get(host)
        if result is not None and not result.ok:
            return f"{host}: not done: the deploy run stopped for another host (exit {self.returncode})"
        return f"{host}: the deploy run exited {self.returncode} and names no problem of this host (see --log)"


def dies_with_parent() -> Callable[[], None]:
    """A preexec_fn for a child that must die with this process: a killed controller must not leave a deploy running
    on its own (its SSH sessions close, each host's lock frees at once: gpufleet.hostlock; the re-run resumes from
    the ledgers). prctl is looked up here, in the parent: dlopen in the forked child of a threaded process may hang."""
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: nothing to ask the kernel for
        prctl = None

    def in_child() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # A parent killed between the fork and the line above sent no signal (a busy host may run the child only
        # after it): the child has been reparented then, and ends here, before pyinfra starts.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


@dataclass(frozen=True)
class RunSettings:
    """What the rollout sets for one deploy run, over each host's own settings. A field left at its default is not
    passed, so the host's own value stands (a flag is only ever turned on for a run).

    >>> RunSettings(image_ref="repo@sha256:ab", stage="prepare").data_args()
    ['--data', 'gpufleet_image_ref=repo@sha256:ab', '--data', 'gpufleet_stage=prepare']
    """

    image_ref: str | None = None  # the digest every host of the run installs (repo@sha256:<64 hex>)
    model_ref: str | None = None  # the model's commit every host of the run installs (40 hex), when it moves
    stage: Stage | None = None  # "prepare" stops before the unit: nothing restarts
    # The serving checks a new version is held to (gpufleet.wire.checks): () none of them, beside the answers
    verify_checks: tuple[str, ...] | None = None
    # host -> the digest its ledger had committed as the rollout read it (None: nothing): the deploy refuses a host
    # whose ledger says otherwise by the time it holds the host's lock (another run changed it in between)
    expect_committed: Mapping[str, str | None] | None = None
    verify_probe: bool = False  # hold every host to the prompt re-processing probe too
    retry_failed: bool = False  # install the version again though it failed verification there before
    # host -> the old version's speed figures, measured there before the swap: the speed check holds the new to them
    speed_baseline: Mapping[str, SpeedFigures] | None = None

    def __post_init__(self) -> None:
        if self.stage is not None and self.stage not in STAGES:
            raise ValueError(f"stage {self.stage!r} is not one of {', '.join(STAGES)}")
        unknown = [name for name in self.verify_checks or () if name not in SERVING_CHECKS]
        if unknown:
            raise ValueError(f"unknown check {', '.join(unknown)} (known: {', '.join(SERVING_CHECKS)})")

    def data_args(self) -> list[str]:
        """pyinfra's `--data NAME=TEXT` for each field set, named by gpufleet.defaults, in the text pyinfra parses
        back to the value (true, JSON; a list of checks as the setting takes it)."""
        checks = None if self.verify_checks is None else ",".join(self.verify_checks) or "none"
        committed = (None if self.expect_committed is None
                     else json.dumps(dict(self.expect_committed), separators=(",", ":")))
        baseline = (None if not self.speed_baseline else json.dumps(
            {host: figures.as_dict() for host, figures in self.speed_baseline.items()}, separators=(",", ":")))
        named: tuple[tuple[str, str | None], ...] = (
            (IMAGE_REF_SETTING, self.image_ref),
            (MODEL_REF_SETTING, self.model_ref),
            (STAGE_SETTING, self.stage),
            (VERIFY_CHECKS_SETTING, checks),
            (EXPECT_COMMITTED_SETTING, committed),
            (VERIFY_PROBE_SETTING, "true" if self.verify_probe else None),
            (RETRY_SETTING, "true" if self.retry_failed else None),
            (SPEED_BASELINE_SETTING, baseline),
        )
        return [arg for name, text in named if text is not None for arg in ("--data", f"{name}={text}")]


def run_deploy(inventory: str, hosts: Sequence[str], settings: RunSettings, deploy_file: Path, *,
               log: Path | None = None, timeout_s: float | None = None) -> DeployRun:
    """pyinfra -y INVENTORY DEPLOY --limit h1,h2 --data k=v ...; its output is kept (and appended to `log`), its
    result file read."""
    # One --limit per host: pyinfra reads each as one name pattern (a comma-separated list matches nothing).
    limits = [arg for host in hosts for arg in ("--limit", host)]
    argv = [pyinfra_command(), "-y", inventory, str(deploy_file), *limits, *settings.data_args()]
    start, started_at = time.monotonic(), time.time()
    ended: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="gpufleet-run-") as scratch:
        where = Path(scratch) / "result.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", RESULT_ENV: str(where)}
        try:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  timeout=timeout_s, preexec_fn=dies_with_parent())
            rc, output = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:
            # subprocess.run has killed the run by its PID: its SSH sessions closed, each host's lock with them.
            raw = e.stdout or ""
            rc, output = 124, (raw.decode(errors="replace") if isinstance(raw, bytes) else raw)
            ended = {host: f"{host}: failed: the deploy run passed its time limit of {timeout_s:g} s and was ended, "
                     "releasing the host's lock (fix: see why in the log; --stage-timeout raises the limit)"
                     for host in hosts}
        results = None if ended else read_result(where)
    output = _ANSI.sub("", output)
    if results is not None:
        # A host of the run that its result does not list is one the inventory does not name: never done.
        missing = {host: f"{host}: the run's result does not list it: the inventory names no such host (fix: check "
                   "the name against the inventory)" for host in hosts if host not in results}
        ended.update(missing)
        rc = 1 if missing and rc == 0 else rc
    elif rc == 0:
        # pyinfra exits 0 having run nothing when no host matched: never read as "prepared" or "swapped".
        ended = {host: f"{host}: the deploy run exited 0 without writing its result: it ran nothing (no host of the "
                 "inventory matched, or the deploy file does not call gpufleet.harness.register_deploy_file)"
                 for host in hosts}
        rc = 1
    if ended:  # the log says what the rollout read of these hosts
        output += "".join(f"\n{line}" for line in ended.values()) + "\n"
    if log is not None:
        # The run's wall-clock window (epoch seconds) is part of the record: what happened on a host, and what the
        # registry served it, can be put inside or outside a swap from the log alone.
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n{output}\n[exit {rc}; started {started_at:.3f}; ended {time.time():.3f}]\n")
    return DeployRun(tuple(hosts), rc, output, time.monotonic() - start, results or {}, ended)
