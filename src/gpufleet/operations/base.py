"""What every gpufleet operation shares."""

from __future__ import annotations

from collections.abc import Generator

from pyinfra import host as current_host
from pyinfra import logger
from pyinfra.api import Host, State, operation
from pyinfra.api.command import PyinfraCommand

from gpufleet.operations.run import report

Commands = Generator[PyinfraCommand, None, None]


def fail(host: Host, message: str) -> bool:
    """Fail the host from a callback with one line, kept for the run's result."""
    host.log_styled(message, fg="red", log_func=logger.error)
    state = getattr(host, "state", None)
    if isinstance(state, State):
        report(state, host.name, message)
    return False


@operation()
def not_for_this_host(why: str) -> Commands:
    """The only step on a host another deploy configures."""
    current_host.noop(why)
    return
    yield  # pyinfra operations are generators
