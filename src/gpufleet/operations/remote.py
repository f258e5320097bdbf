"""How gpufleet's code talks to a host while pyinfra executes: sudo or not, and failing a host on one line."""

from __future__ import annotations

from collections.abc import Generator

import paramiko
from pyinfra import host as current_host
from pyinfra import logger
from pyinfra.api import Host, operation
from pyinfra.api.command import PyinfraCommand

from gpufleet.health.transport import needs_sudo

# What an operation (and a helper it yields from) produces: pyinfra commands, nothing sent back, nothing returned.
Commands = Generator[PyinfraCommand, None, None]


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


def fail(host: Host, message: str) -> bool:
    """Report a failure of a Python callback on one line (pyinfra marks the host failed on False)."""
    host.log_styled(message, fg="red", log_func=logger.error)
    return False


@operation()
def not_for_this_host(why: str) -> Commands:
    """A deploy's single step on a host of the inventory that another deploy configures: says why, changes nothing."""
    current_host.noop(why)
    return
    yield  # a generator: pyinfra operations yield their commands
