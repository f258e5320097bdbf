"""How much the CLI says besides its result (`gpufleet -q` / `-v`), and what it does with paramiko's and pyinfra's
own log records."""

from __future__ import annotations

import logging

from rich.console import Console

QUIET, NORMAL, VERBOSE = -1, 0, 1
_level = NORMAL
_LIBRARIES = ("paramiko", "pyinfra")
_verbose_handler: logging.Handler | None = None
_before: dict[str, tuple[int, bool]] = {}  # each library logger's level and propagate from before -v


def set_verbosity(level: int) -> None:
    """-q: the result and the errors only (no progress, no summary lines on stderr). -v: paramiko's and pyinfra's
    own debug records on stderr too (undone by the next call with a lower level)."""
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
    """paramiko logs connection failures with tracebacks ("Socket exception: ..."), pyinfra's connector its host key
    decisions: the commands already say, per host, that it could not be reached and why, in one line. Under -v they
    stay on."""
    if verbose():
        return
    for logger in map(logging.getLogger, _LIBRARIES):
        if logger.propagate:
            logger.addHandler(logging.NullHandler())
            logger.propagate = False
