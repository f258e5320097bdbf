"""Prepare: everything slow, on every host to swap, while the old version keeps serving. A deploy run with
gpufleet_stage=prepare: preflight (the host lock included), engine, directories, the pull of the target by digest,
the model, and the target image's own parser on the host's serve flags (gpufleet.vllm.operations.flagcheck). No unit is
written, nothing restarts, no ledger changes. Any host failing means no host is swapped.

With a site cache in the inventory (docs/site-cache.md) the pull goes in two runs: one host first, alone (the
cache host when it is among them, else the canary), then every other host at once. The cache fetches a layer from
upstream for each request it cannot serve yet, concurrent ones included: pulled by all hosts at once, every layer
would come down once per host. After the first host it is in the cache, and the others pull it over the LAN."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from gpufleet.errors import GpufleetError
from gpufleet.facts.pull import PullStats
from gpufleet.inventory import load_pyinfra_hosts
from gpufleet.remote.transport import SshTransport
from gpufleet.rollout.deploy_run import DeployRun, RunSettings, run_deploy
from gpufleet.rollout.replicas import FleetHost, Sessions, shell
from gpufleet.sitecache.operations import SITE_CACHE_GROUP
from gpufleet.vllm.operations.image import pull_stats_file


def pull_order(inventory: str, hosts: Sequence[str]) -> list[list[str]]:
    """The runs prepare makes, in order: one run of every host without a site cache; with one, the first host
    alone (the cache host when it is among `hosts`, else hosts[0]: the canary), then the rest."""
    if len(hosts) < 2:
        return [list(hosts)]
    try:
        loaded = load_pyinfra_hosts(inventory)
    except GpufleetError:
        return [list(hosts)]  # the deploy run reports what is wrong with the inventory
    by_name = {h.name: h for h in loaded}
    caches = [h.name for h in loaded if SITE_CACHE_GROUP in h.groups]
    if not caches or all(by_name[h].data.get("site_cache_address") == "off" for h in hosts if h in by_name):
        return [list(hosts)]
    first = caches[0] if caches[0] in hosts else hosts[0]
    return [[first], [h for h in hosts if h != first]]


def prepare(inventory: str, hosts: Sequence[str], target_ref: str, deploy_file: Path, *,
            log: Path | None = None, timeout_s: float | None = None,
            model_ref: str | None = None) -> tuple[DeployRun, dict[str, str]]:
    """(the run, host -> why it failed to prepare); an empty dict when every host is prepared. model_ref: the
    model's commit the rollout moves to (downloaded and checked here, while the old version serves). A run past timeout_s
    is ended by its PID (its hosts' locks go with its SSH sessions) and fails every host it ran on. When the first of
    two runs fails, the second is not made: its hosts are not in the dict (not started)."""
    done: DeployRun | None = None
    for pulling in pull_order(inventory, hosts):
        one = run_deploy(inventory, pulling, RunSettings(image_ref=target_ref, model_ref=model_ref, stage="prepare"),
                         deploy_file, log=log, timeout_s=timeout_s)
        done = one if done is None else DeployRun(
            done.hosts + one.hosts, max(done.returncode, one.returncode, key=abs), done.output + one.output,
            done.seconds + one.seconds, {**done.results, **one.results}, {**done.ended, **one.ended})
        if not one.ok:
            return done, failures(one)
    assert done is not None
    return done, {}


def failures(run: DeployRun) -> dict[str, str]:
    """Which hosts failed and why, from the run's result (DeployRun.problems): the hosts it names a problem of (a
    host stopped only because another failed is not among them); when it names none, every host of the run (the run
    as a whole failed: pyinfra's own error, a run that wrote no result)."""
    if run.ok:
        return {}
    named = {host: " | ".join(lines) for host in run.hosts if (lines := run.problems(host))}
    return named or {host: run.summary(host) for host in run.hosts}


def _read_stats(host: FleetHost, transport: SshTransport) -> PullStats | None:
    path = pull_stats_file(host.spec.service)
    rc, out, _ = shell(transport, f"cat {shlex.quote(path)} 2>/dev/null || true", root=True)
    return PullStats.from_json(out) if rc == 0 and out.strip() else None


def pull_stats(sessions: Sessions, names: Sequence[str], target_ref: str) -> dict[str, PullStats | None]:
    """host -> what its pull of `target_ref` moved (bytes from the site cache and from upstream, a fall back), as
    the pull recorded it on the host; None where there is no record of that digest (the image was present already,
    so nothing was pulled, or the host could not be read)."""
    digest = target_ref.rpartition("@")[2]
    found = sessions.each(names, _read_stats)
    return {name: value if isinstance(value, PullStats) and value.ref.endswith("@" + digest) else None
            for name, value in found.items()}
