"""What the CLI does with the libraries' own log records."""

from __future__ import annotations

import logging


def quiet_ssh_logs() -> None:
    """paramiko logs connection failures with tracebacks ("Socket exception: ..."), pyinfra's connector its host key
    decisions: the commands already say, per host, that it could not be reached and why, in one line."""
    for logger in map(logging.getLogger, ("paramiko", "pyinfra")):
        if logger.propagate:
            logger.addHandler(logging.NullHandler())
            logger.propagate = False
