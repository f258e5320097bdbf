"""A host's GPU health over its SSH session (status, verify, the rollout): the snapshot's health reads, judged."""

from __future__ import annotations

import shlex

from gpufleet.facts.gpu_health import GpuHealth, kernel_shell, parse_health, query_shell
from gpufleet.facts.gpu_verdict import HostGpus, judge
from gpufleet.hoststate import sections
from gpufleet.remote.ssh import needs_sudo
from gpufleet.remote.transport import SshTransport, TransportError
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.gpu_verdicts import GpuSettings

PROGRAM_TIMEOUT_S = 20  # as in the host snapshot
QUERY, KERNEL = "gpu_health", "kernel_log"
COMMAND = "\n".join(
    [
        "export LC_ALL=C",
        f"t='timeout -k 2 {PROGRAM_TIMEOUT_S}'; command -v timeout >/dev/null 2>&1 || t=",
        "nv=0; command -v nvidia-smi >/dev/null 2>&1 && nv=1",
        f"{sections.marker(QUERY)}; [ $nv = 1 ] && {{ {query_shell()}; }}",
        f"{sections.marker(KERNEL)}; [ $nv = 1 ] && {{ {kernel_shell()}; }}",
        sections.end(),
    ]
)


def read(transport: SshTransport) -> GpuHealth | None:
    """None without nvidia-smi; TransportError (one line) when the command could not run."""
    sudo = "sudo -n " if needs_sudo(transport.client) else ""
    rc, out, err = transport.shell(f"{sudo}sh -c {shlex.quote(COMMAND)}", timeout=3 * PROGRAM_TIMEOUT_S + 10)
    try:
        found = sections.split(out.splitlines())
    except (sections.Truncated, sections.Forged):
        raise TransportError(
            excerpt(f"{transport.name}: the GPU health read stopped (exit {rc}): {(err or out).strip()}", 200)
        ) from None
    if not found.get(QUERY):
        return None
    return parse_health(found[QUERY], found.get(KERNEL, []))


def judged(transport: SshTransport, settings: GpuSettings, app_started_at: float | None = None) -> HostGpus | None:
    """read(), judged; a failed read is a HostGpus whose error says why."""
    try:
        health = read(transport)
    except TransportError as error:
        return HostGpus(error=str(error))
    return None if health is None else judge(health, settings, app_started_at)
