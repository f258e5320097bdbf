"""How much the CLI says besides its result (`-q`, `-v`), paramiko's and pyinfra's log records included."""

from __future__ import annotations

import logging

from rich.console import Console

QUIET, NORMAL, VERBOSE = -1, 0, 1
_level = NORMAL
_LIBRARIES = ("paramiko", "pyinfra")
_verbose_handler: logging.Handler | None = None
_before: dict[str, tuple[int, bool]] = {}  # each library logger's state before -v


def set_verbosity(level: int) -> None:
    """-q: the result and the errors only. -v: paramiko's and pyinfra's debug records on stderr too."""
    global _level, _verbose_handler
    _level = level
    loggers = [logging.getLogger(name) for name in _LIBRARIES]
    if level >= VERBOSE and _verbose_handler is None:
        _verbose_handler = logging.StreamHandler()
        _verbose_handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        for logger in loggers:
            _before[logger.name] = (logger.level, logger.propagate)
            logger.setLevel(logging.DEBUG)
            logger.addHandler(_verbose_handler)
            logger.propagate = False
    elif level < VERBOSE and _verbose_handler is not None:
        for logger in loggers:
            logger.removeHandler(_verbose_handler)
            level_before, logger.propagate = _before.pop(logger.name)
            logger.setLevel(level_before)
        _verbose_handler = None


def quiet() -> bool:
    return _level <= QUIET


def verbose() -> bool:
    return _level >= VERBOSE


def stderr() -> Console:
    """Where progress and summaries go: stderr, silent under -q."""
    return Console(stderr=True, quiet=quiet())


def quiet_ssh_logs() -> None:
    """Silence paramiko's tracebacks and pyinfra's host key lines, unless -v: the commands say why in one line."""
    if verbose():
        return
    for logger in map(logging.getLogger, _LIBRARIES):
        if logger.propagate:
            logger.addHandler(logging.NullHandler())
            logger.propagate = False
