"""Whether the vLLM service's `docker run` exited, and its last log lines."""

from __future__ import annotations

import shlex

from pyinfra.api import Host

from gpufleet.health.wait import Exited
from gpufleet.remote.ssh import use_sudo
from gpufleet.remote.transport import Transport, TransportError
from gpufleet.units import unit_name


def exited_detail(show: str) -> str | None:
    """From `systemctl show`: why `docker run` exited, or None while it runs."""
    props = dict(line.split("=", 1) for line in show.splitlines() if "=" in line)
    active, sub, status = props.get("ActiveState", ""), props.get("SubState", ""), props.get("ExecMainStatus", "")
    if sub == "auto-restart" or active == "failed":
        return f"docker run exited with status {status or '?'} (systemd: {active}/{sub})"
    return None


def service_exited(host: Host, service: str) -> Exited:
    """health.wait's `exited` for the service."""

    def probe() -> str | None:
        ok, output = host.run_shell_command(
            f"systemctl show -p ActiveState -p SubState -p ExecMainStatus {shlex.quote(unit_name(service))}"
        )
        return exited_detail("\n".join(output.stdout_lines)) if ok else None

    return probe


def journal(host: Host, service: str, lines: int = 15) -> list[str]:
    ok, output = host.run_shell_command(
        f"journalctl -u {shlex.quote(unit_name(service))} -n {int(lines)} --no-pager -o cat", _sudo=use_sudo(host)
    )
    return output.stdout_lines if ok else []


def failed_logs(host: Host, transport: Transport, service: str) -> list[str]:
    try:
        logs = transport.logs(service, tail=30)
    except TransportError:
        logs = []
    # With --rm no container is left to read; the journal has its output.
    return logs or journal(host, service)
