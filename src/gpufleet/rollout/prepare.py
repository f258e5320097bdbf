"""Prepare: everything slow, on every host to swap at once, while the old version keeps serving. One deploy run
with gpufleet_stage=prepare: preflight (the host lock included), engine, directories, the pull of the target by
digest, the model, and the target image's own parser on the host's serve flags (gpufleet.operations.flagcheck).
No unit is written, nothing restarts, no ledger changes. Any host failing means no host is swapped."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpufleet.rollout.deploy import DeployRun, run_deploy

IMAGE_REF = "gpufleet_image_ref"
STAGE = "gpufleet_stage"


def prepare(inventory: str, hosts: Sequence[str], target_ref: str, deploy_file: Path,
            log: Path | None = None, timeout_s: float | None = None) -> tuple[DeployRun, dict[str, str]]:
    """(the run, host -> why it failed to prepare); an empty dict when every host is prepared. A run past timeout_s
    is ended by its PID (its hosts' locks go with its SSH sessions) and fails every host it ran on."""
    run = run_deploy(inventory, hosts, {IMAGE_REF: target_ref, STAGE: "prepare"}, deploy_file, log=log,
                     timeout_s=timeout_s)
    return run, failures(run)


def failures(run: DeployRun) -> dict[str, str]:
    """Which hosts failed and why, from the run's output; when no line names a host, every host of the run (the
    run as a whole failed: preflight's refusal, pyinfra's own error)."""
    if run.ok:
        return {}
    named = {host: " | ".join(lines) for host in run.hosts if (lines := run.problems(host))}
    return named or {host: run.summary(host) for host in run.hosts}
