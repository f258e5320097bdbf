"""Prepare: the pull, the model and the flag check on every host to swap, while the old version serves."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from gpufleet.errors import GpufleetError
from gpufleet.facts.pull import PullStats
from gpufleet.inventory import load_pyinfra_hosts
from gpufleet.remote.transport import SshTransport
from gpufleet.rollout.deploy_run import DeployRun, RunSettings, run_deploy
from gpufleet.rollout.hosts import FleetHost, Sessions, shell
from gpufleet.sitecache.operations import SITE_CACHE_GROUP
from gpufleet.vllm.operations.image import pull_stats_file


def pull_order(inventory: str, hosts: Sequence[str]) -> list[list[str]]:
    """The hosts of each prepare run: with a site cache, its host (else the canary) alone first."""
    if len(hosts) < 2:
        return [list(hosts)]
    try:
        loaded = load_pyinfra_hosts(inventory)
    except GpufleetError:
        return [list(hosts)]  # the deploy run reports it
    by_name = {h.name: h for h in loaded}
    caches = [h.name for h in loaded if SITE_CACHE_GROUP in h.groups]
    if not caches or all(by_name[h].data.get("site_cache_address") == "off" for h in hosts if h in by_name):
        return [list(hosts)]
    first = caches[0] if caches[0] in hosts else hosts[0]
    return [[first], [h for h in hosts if h != first]]


def prepare(
    inventory: str,
    hosts: Sequence[str],
    target_ref: str,
    deploy_file: Path,
    *,
    log: Path | None = None,
    timeout_s: float | None = None,
    model_sha: str | None = None,
) -> tuple[DeployRun, dict[str, str]]:
    """(the run, host -> why it failed to prepare)."""
    done: DeployRun | None = None
    for pulling in pull_order(inventory, hosts):
        one = run_deploy(
            inventory,
            pulling,
            RunSettings(image_ref=target_ref, model_sha=model_sha, stage="prepare"),
            deploy_file,
            log=log,
            timeout_s=timeout_s,
        )
        done = (
            one
            if done is None
            else DeployRun(
                done.hosts + one.hosts,
                max(done.returncode, one.returncode, key=abs),
                done.output + one.output,
                done.seconds + one.seconds,
                {**done.results, **one.results},
                {**done.ended, **one.ended},
            )
        )
        if not one.ok:
            return done, failures(one)
    assert done is not None
    return done, {}


def failures(run: DeployRun) -> dict[str, str]:
    """The hosts the run names a problem of, else every host of the failed run."""
    if run.ok:
        return {}
    named = {host: " | ".join(lines) for host in run.hosts if (lines := run.problems(host))}
    return named or {host: run.summary(host) for host in run.hosts}


def _read_stats(host: FleetHost, transport: SshTransport) -> PullStats | None:
    path = pull_stats_file(host.spec.service)
    rc, out, _ = shell(transport, f"cat {shlex.quote(path)} 2>/dev/null || true", root=True)
    return PullStats.from_json(out) if rc == 0 and out.strip() else None


def pull_stats(sessions: Sessions, names: Sequence[str], target_ref: str) -> dict[str, PullStats | None]:
    """What each host's pull of `target_ref` moved, as recorded there."""
    digest = target_ref.rpartition("@")[2]
    found = sessions.each(names, _read_stats)
    return {
        name: value if isinstance(value, PullStats) and value.ref.endswith("@" + digest) else None
        for name, value in found.items()
    }
