"""A test fleet for a fixture's lifetime."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gpufleet.sandbox.config import FleetConfig
from gpufleet.sandbox.fleet import Fleet, check_prerequisites
from gpufleet.sandbox.procs import SandboxError


@contextmanager
def running_fleet(cfg: FleetConfig) -> Iterator[Fleet]:
    """The fleet with its services up (no hosts yet), stopped, leaving nothing, on exit; the test is skipped when
    this machine cannot run test hosts (tests/conftest.py fails such a skip under CI)."""
    try:
        check_prerequisites()
    except SandboxError as err:
        pytest.skip(f"test hosts unavailable: {err}")
    fleet = Fleet(cfg)
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()
