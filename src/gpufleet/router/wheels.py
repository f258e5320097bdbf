"""The lock of the wheels gpufleet installs for vllm-router, per router_version, Python and machine.

docs/router.md (The lock) says how to regenerate it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gpufleet import wheel_lock
from gpufleet.router.spec import PACKAGE
from gpufleet.wheel_lock import (  # noqa: F401 - the router's names for the shared lock's parts
    GLIBC_MINOR,
    INDEX_URL,
    MACHINES,
    PYTHONS,
    Wheel,
    normalise,
    pip_env,
    platforms,
    published_sha256,
    requires,
)

LOCK_PATH = Path(__file__).resolve().parents[1] / "data" / "vllm-router-lock.json"
LOCK_SHOWN = "src/gpufleet/data/vllm-router-lock.json"
REGENERATE = "python -m gpufleet.router.relock"
LOCK = wheel_lock.LockFile(PACKAGE, LOCK_PATH, LOCK_SHOWN, REGENERATE, "router_version", "docs/router.md")


class LockedInstall(wheel_lock.LockedInstall):
    """The lock's wheels for one router host."""

    def __init__(
        self,
        version: str,
        python: str,
        machine: str,
        wheels: tuple[Wheel, ...],
        package: str = PACKAGE,
        shown: str = LOCK_SHOWN,
    ) -> None:
        super().__init__(version, python, machine, wheels, package, shown)


def load(path: Path = LOCK_PATH) -> dict[str, Any]:
    return wheel_lock.load(path)


def releases(lock: Mapping[str, Any] | None = None) -> list[str]:
    """The router_versions the lock covers."""
    return wheel_lock.releases(lock if lock is not None else load())


def locked_install(
    host: str, version: str, python: str | None, machine: str | None, lock: Mapping[str, Any] | None = None
) -> LockedInstall:
    """The lock's wheels for a host; SettingError when it has none."""
    found = wheel_lock.locked_install(LOCK, host, version, python, machine, lock)
    return LockedInstall(found.version, found.python, found.machine, found.wheels)


def check(lock: Mapping[str, Any]) -> list[str]:
    """Problems with a lock's shape."""
    return wheel_lock.check(PACKAGE, lock)


def closure(wheels: Mapping[str, Path], python: str, machine: str) -> set[str]:
    return wheel_lock.closure(PACKAGE, wheels, python, machine)


def generate(
    versions: Iterable[str], pythons: Iterable[str], machines: Iterable[str], index_url: str = INDEX_URL
) -> dict[str, Any]:
    return wheel_lock.generate(LOCK, versions, pythons, machines, index_url)


def write(lock: Mapping[str, Any], path: Path = LOCK_PATH) -> None:
    wheel_lock.write(lock, path)
