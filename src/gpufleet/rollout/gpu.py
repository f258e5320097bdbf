"""The hosts a rollout skips for their GPUs, and the degraded ones it swaps with a warning."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpufleet.facts.gpu_verdict import HostGpus
from gpufleet.health import gpu
from gpufleet.remote.transport import SshTransport
from gpufleet.rollout.hosts import FleetHost, Sessions
from gpufleet.wire.gpu_verdicts import GpuSettings, Verdict


def look(host: FleetHost, transport: SshTransport, app_started_at: float | None = None) -> HostGpus | None:
    return gpu.judged(transport, GpuSettings.of(host.data), app_started_at)


def sick_hosts(sessions: Sessions, names: Sequence[str], note: Callable[[str], None]) -> dict[str, str]:
    """host -> why it is not swapped; an unread host is swapped."""
    skipped = {}
    for name, found in sessions.each(names, look).items():
        if not isinstance(found, HostGpus):
            continue
        used = sessions.hosts[name].spec.gpus
        if sick := found.blocking(used):
            skipped[name] = "; ".join(f"{g.line()} (fix: {g.action}, then run the rollout again)" for g in sick)
        elif found.error is None and found.verdict(used) is not Verdict.OK:
            note(f"{name}: GPUs {found.summary(used)}: swapped and served")
    return skipped
