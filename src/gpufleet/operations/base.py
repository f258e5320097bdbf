"""What every gpufleet operation shares: the type of what it yields, failing a host on one line, and the step that
says a host is another deploy's. (Sudo or not: gpufleet.remote.ssh.use_sudo.)"""

from __future__ import annotations

from collections.abc import Generator

from pyinfra import host as current_host
from pyinfra import logger
from pyinfra.api import Host, operation
from pyinfra.api.command import PyinfraCommand

# What an operation (and a helper it yields from) produces: pyinfra commands, nothing sent back, nothing returned.
Commands = Generator[PyinfraCommand, None, None]


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
