"""What the vLLM deploy's preflight reads on each host: the host snapshot, in the host lock's own shell."""

from __future__ import annotations

from typing import Any

from gpufleet.harness.preflight import HostRead, check_ssh_and_sudo
from gpufleet.vllm.facts import SNAPSHOT_REFUSED, GpufleetHost, HostSnapshot
from gpufleet.vllm.host_command import COMMAND_TIMEOUT_S
from gpufleet.vllm.settings import merged_settings


def unreadable_fix(plan: Any, error: Exception) -> str:  # plan: gpufleet.vllm.deploy.Plan
    """The fix for a host whose snapshot could not be read."""
    if SNAPSHOT_REFUSED not in str(error):
        return check_ssh_and_sudo(plan, error)
    port = plan.paths.port
    return (
        f"something on the host answers in gpufleet's own words: `ss -ltnp 'sport = :{port}'` shows what listens "
        f"on port {port}; stop it"
    )


# The snapshot bounds each of its programs; this bound covers SSH, sudo and a host that stops answering.
HOST_READ: HostRead[Any, HostSnapshot] = HostRead(
    GpufleetHost,
    lambda plan: {"paths": plan.paths},
    merged_settings,
    fix=unreadable_fix,
    timeout_s=3 * COMMAND_TIMEOUT_S,
    answering="SSH, sudo, nvidia-smi, docker and systemctl",
)
