"""Entries of the sandbox's cache dir, published by one rename with a `.done` marker, so a killed build never counts."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def is_done(entry: Path) -> bool:
    return (entry / ".done").exists()


def publish(tmp: Path, entry: Path, started: float) -> float:
    """Mark tmp finished and move it to entry; returns the seconds the build took."""
    seconds = time.monotonic() - started
    (tmp / "build-seconds").write_text(f"{seconds:.1f}\n")
    (tmp / ".done").touch()
    shutil.rmtree(entry, ignore_errors=True)
    tmp.rename(entry)
    return seconds


@contextmanager
def building(lock: Path) -> Iterator[None]:
    """Hold the flock `lock` while building one cache entry."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
