"""SSH to a host through pyinfra's connector, so every command logs in exactly as the deploy does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gevent
import paramiko
from pyinfra.api import Config, Host, Inventory, State

from gpufleet.remote.transport import SshTransport, TransportError, Unreachable
from gpufleet.wire.evidence import DETAIL_CHARS, excerpt

SSH_TIMEOUT_S = 10.0  # per attempt, login included


def pyinfra_host(name: str, data: Mapping[str, Any]) -> Host:
    """A pyinfra Host in a State of its own, so one host's bad data cannot fail the others."""
    inventory = Inventory(([(name, dict(data))], {}))
    State(inventory, Config(CONNECT_TIMEOUT=SSH_TIMEOUT_S))
    return inventory.get_host(name)


def open_ssh(name: str, data: Mapping[str, Any]) -> SshTransport:
    """A transport over a new SSH connection, whose client the caller closes. Raises Unreachable."""
    try:
        host = pyinfra_host(name, data)
    except Exception as e:
        raise Unreachable(_unreachable_line(name, data, e)) from e
    attempts = 1 + int(host.data.get("ssh_connect_retries") or 0)
    try:
        # pyinfra bounds the TCP connect only, not a stalled banner or login.
        try:
            with gevent.Timeout(SSH_TIMEOUT_S * attempts):
                host.connect(show_errors=False, raise_exceptions=True)
        except gevent.Timeout:
            pass
        if not host.connected:
            raise Unreachable(f"no SSH session within {SSH_TIMEOUT_S * attempts:g} s")
        return transport_from_pyinfra_host(host)
    except Exception as e:  # the connector raises more than ConnectError
        client = getattr(host.connector, "client", None)
        if client is not None:  # a half-open session holds a socket and a thread
            client.close()
        raise Unreachable(_unreachable_line(name, data, e)) from e


def _unreachable_line(name: str, data: Mapping[str, Any], e: Exception) -> str:
    port = data.get("ssh_port")
    where = f"{data.get('ssh_hostname') or name}" + (f":{port}" if port else "")
    why = str(e) or type(e).__name__
    line = f"cannot SSH to {where}: {why}"
    if "No host key for" in why:  # pyinfra's StrictPolicy
        known = data.get("ssh_known_hosts_file") or "~/.ssh/known_hosts"
        line += f" (fix: add the host's key to {known}, e.g. with ssh-keyscan, or set ssh_strict_host_key_checking)"
    return excerpt(line, DETAIL_CHARS)


def transport_from_pyinfra_host(host: Host) -> SshTransport:
    """A transport over a pyinfra host's SSH connection, connecting it first if need be."""
    connector = host.connector
    client = getattr(connector, "client", None)
    if client is None:
        host.connect(raise_exceptions=True)
        client = getattr(host.connector, "client", None)
    if not isinstance(client, paramiko.SSHClient):
        raise TransportError(f"{host.name}: not an SSH host (connector {type(connector).__name__})")
    return SshTransport(client, name=host.name, sudo=needs_sudo(client))


def needs_sudo(client: paramiko.SSHClient) -> bool:
    """False for a root session, where sudo may not even exist."""
    session = client.get_transport()
    return session is None or session.get_username() != "root"


def use_sudo(host: Host) -> bool:
    """needs_sudo for a pyinfra host; before it connects, only ssh_user can tell."""
    if host.name == "@local":
        return False
    client = getattr(host.connector, "client", None)
    if isinstance(client, paramiko.SSHClient) and client.get_transport() is not None:
        return needs_sudo(client)
    return (host.data.get("ssh_user") or "root") != "root"
