"""What the vLLM deploy's preflight reads on each of its hosts (gpufleet.harness.preflight.HostRead): the host
snapshot (GpufleetHost) at the paths the host's plan names, in the host lock's own shell; the lock's wait from the
vLLM settings merge; and the fix for a host whose snapshot could not be read."""

from __future__ import annotations

from typing import Any

from gpufleet.harness.preflight import HostRead, check_ssh_and_sudo
from gpufleet.vllm.facts import SNAPSHOT_REFUSED, GpufleetHost, HostSnapshot
from gpufleet.vllm.host_command import COMMAND_TIMEOUT_S
from gpufleet.vllm.settings import merged_settings


def unreadable_fix(plan: Any, error: Exception) -> str:  # plan: gpufleet.vllm.deploy.Plan
    """The fix for a host whose snapshot could not be read: what answers on the service's port when the snapshot's
    own sections were forged (something there answers in gpufleet's words), else SSH and sudo."""
    if SNAPSHOT_REFUSED not in str(error):
        return check_ssh_and_sudo(plan, error)
    port = plan.paths.port
    return (f"something on the host answers in gpufleet's own words: `ss -ltnp 'sport = :{port}'` shows what listens "
            f"on port {port}; stop it")


# A host's snapshot bounds each program in it (a wedged nvidia-smi costs COMMAND_TIMEOUT_S, then the other GPU
# queries are skipped); the read's own bound covers the rest: SSH, sudo, a host that stops answering mid-read.
HOST_READ: HostRead[Any, HostSnapshot] = HostRead(
    GpufleetHost, lambda plan: {"paths": plan.paths}, merged_settings, fix=unreadable_fix,
    timeout_s=3 * COMMAND_TIMEOUT_S, answering="SSH, sudo, nvidia-smi, docker and systemctl")
