"""SSH to a host, the one way gpufleet's own code does it: opened by pyinfra's connector from the host's inventory data
(so `status`, `verify`, the rollout and the router calls log in exactly as the deploy does), sudo unless the session is
root's, and a Transport over the session (gpufleet.remote.transport)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gevent
import paramiko
from pyinfra.api import Config, Host, Inventory, State

from gpufleet.remote.transport import SshTransport, TransportError, Unreachable
from gpufleet.wire.evidence import DETAIL_CHARS, excerpt

SSH_TIMEOUT_S = 10.0  # per connection attempt: TCP connect, banner, key exchange and login together


def pyinfra_host(name: str, data: Mapping[str, Any]) -> Host:
    """A pyinfra Host for this host data, in a State of its own: pyinfra checks the connector data (types) here,
    and one host's bad data must not take the others' rows down."""
    inventory = Inventory(([(name, dict(data))], {}))
    State(inventory, Config(CONNECT_TIMEOUT=SSH_TIMEOUT_S))  # initialises the host's connector
    return inventory.get_host(name)


def open_ssh(name: str, data: Mapping[str, Any]) -> SshTransport:
    """A transport over the host's SSH connection, opened by pyinfra's connector from its host data; the caller
    closes its client. Raises Unreachable with one line saying why, within SSH_TIMEOUT_S per attempt (the
    connector's ssh_connect_retries are honoured)."""
    try:
        host = pyinfra_host(name, data)
    except Exception as e:  # host data the connector refuses (an ssh_port that is not a number)
        raise Unreachable(_unreachable_line(name, data, e)) from e
    attempts = 1 + int(host.data.get("ssh_connect_retries") or 0)
    try:
        # pyinfra bounds the TCP connect only: a host that accepts and then stalls (banner, login) is cut here.
        try:
            with gevent.Timeout(SSH_TIMEOUT_S * attempts):
                host.connect(show_errors=False, raise_exceptions=True)
        except gevent.Timeout:
            pass  # not connected: reported just below
        if not host.connected:
            raise Unreachable(f"no SSH session within {SSH_TIMEOUT_S * attempts:g} s")
        return transport_from_pyinfra_host(host)
    except Exception as e:  # the connector raises more than ConnectError (key files, odd host data)
        client = getattr(host.connector, "client", None)
        if client is not None:  # a half-open session (timed out, refused key) holds a socket and a thread
            client.close()
        raise Unreachable(_unreachable_line(name, data, e)) from e


def _unreachable_line(name: str, data: Mapping[str, Any], e: Exception) -> str:
    port = data.get("ssh_port")
    where = f"{data.get('ssh_hostname') or name}" + (f":{port}" if port else "")
    why = str(e) or type(e).__name__
    line = f"cannot SSH to {where}: {why}"
    if "No host key for" in why:  # pyinfra's StrictPolicy: strict checking on, key not in known_hosts
        known = data.get("ssh_known_hosts_file") or "~/.ssh/known_hosts"
        line += f" (fix: add the host's key to {known}, e.g. with ssh-keyscan, or set ssh_strict_host_key_checking)"
    return excerpt(line, DETAIL_CHARS)


def transport_from_pyinfra_host(host: Host) -> SshTransport:
    """Reuse a pyinfra 3.x host's SSH connection (its paramiko client lives at host.connector.client).

    Connects the host first if pyinfra has not yet done so.
    """
    connector = host.connector
    # Only pyinfra's SSH connector has a paramiko client (@local, @docker and others have none).
    client = getattr(connector, "client", None)
    if client is None:
        host.connect(raise_exceptions=True)
        client = getattr(host.connector, "client", None)
    if not isinstance(client, paramiko.SSHClient):
        raise TransportError(f"{host.name}: not an SSH host (connector {type(connector).__name__})")
    return SshTransport(client, name=host.name, sudo=needs_sudo(client))


def needs_sudo(client: paramiko.SSHClient) -> bool:
    """Root-level commands (docker) go through sudo unless the session is root's: sudo may not even exist on a host
    managed as root. The user is the one the session logged in as, whatever named it (ssh_user, ~/.ssh/config, the
    local user)."""
    session = client.get_transport()
    return session is None or session.get_username() != "root"


def use_sudo(host: Host) -> bool:
    """Root-level commands run through sudo unless the session is root's (then sudo may not even exist).

    Once connected, the session's own user decides, whatever named it (ssh_user, ~/.ssh/config, the local user), as
    for `gpufleet status`; before that, only ssh_user can tell."""
    if host.name == "@local":
        return False
    client = getattr(host.connector, "client", None)  # only pyinfra's SSH connector holds a paramiko client
    if isinstance(client, paramiko.SSHClient) and client.get_transport() is not None:
        return needs_sudo(client)
    return (host.data.get("ssh_user") or "root") != "root"
