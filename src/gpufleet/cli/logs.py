"""How much the CLI says besides its result (`gpufleet -q` / `-v`), and what it does with paramiko's and pyinfra's
own log records."""

from __future__ import annotations

import logging

from rich.console import Console

QUIET, NORMAL, VERBOSE = -1, 0, 1
_level = NORMAL
_LIBRARIES = ("paramiko", "pyinfra")


def set_verbosity(level: int) -> None:
    """-q: the result and the errors only (no progress, no summary lines on stderr). -v: paramiko's and pyinfra's
    own debug records on stderr too."""
    global _level
    _level = level
    if level >= VERBOSE:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        for logger in map(logging.getLogger, _LIBRARIES):
            logger.setLevel(logging.DEBUG)
            logger.addHandler(handler)
            logger.propagate = False


def quiet() -> bool:
    return _level <= QUIET


def verbose() -> bool:
    return _level >= VERBOSE


def stderr() -> Console:
    """Where progress and summaries go: stderr, silent under -q."""
    return Console(stderr=True, quiet=quiet())


def quiet_ssh_logs() -> None:
    """paramiko logs connection failures with tracebacks ("Socket exception: ..."), pyinfra's connector its host key
    decisions: the commands already say, per host, that it could not be reached and why, in one line. Under -v they
    stay on."""
    if verbose():
        return
    for logger in map(logging.getLogger, _LIBRARIES):
        if logger.propagate:
            logger.addHandler(logging.NullHandler())
            logger.propagate = False
