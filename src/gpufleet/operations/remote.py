"""How gpufleet's code talks to a host while pyinfra executes: sudo or not, and failing a host on one line."""

from __future__ import annotations

from collections.abc import Generator

from pyinfra import logger
from pyinfra.api import Host
from pyinfra.api.command import PyinfraCommand

# What an operation (and a helper it yields from) produces: pyinfra commands, nothing sent back, nothing returned.
Commands = Generator[PyinfraCommand, None, None]


def use_sudo(host: Host) -> bool:
    """Root-level commands run through sudo unless pyinfra logs in as root (then sudo may not even exist)."""
    return (host.data.get("ssh_user") or "root") != "root" and host.name != "@local"


def fail(host: Host, message: str) -> bool:
    """Report a failure of a Python callback on one line (pyinfra marks the host failed on False)."""
    host.log_styled(message, fg="red", log_func=logger.error)
    return False
