"""Where gpufleet keeps its state on a host; nothing else spells these paths."""

from __future__ import annotations

STATE_DIR = "/var/lib/gpufleet"


def ledger_path(service: str) -> str:
    return f"{STATE_DIR}/{service}.json"


UNITS_DIR = f"{STATE_DIR}/units"


def committed_unit(service: str, unit_sha256: str) -> str:
    """Named by content, so the ledger alone finds it."""
    return f"{UNITS_DIR}/{service}-{unit_sha256}.service"


def unit_backup(service: str) -> str:
    """For a ledger older than committed_unit."""
    return f"{STATE_DIR}/{service}.service.previous"
