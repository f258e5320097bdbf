"""Where gpufleet keeps its state on a host: the ledgers and the committed units. Nothing else spells these paths."""

from __future__ import annotations

STATE_DIR = "/var/lib/gpufleet"


def ledger_path(service: str) -> str:
    return f"{STATE_DIR}/{service}.json"


UNITS_DIR = f"{STATE_DIR}/units"


def committed_unit(service: str, unit_sha256: str) -> str:
    """The committed unit's copy, named by its content so the ledger alone finds the rollback target."""
    return f"{UNITS_DIR}/{service}-{unit_sha256}.service"


def unit_backup(service: str) -> str:
    """The serving unit's copy for a ledger from before committed_unit's copies."""
    return f"{STATE_DIR}/{service}.service.previous"
