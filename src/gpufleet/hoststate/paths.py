"""Where gpufleet keeps its own state on a host, whichever service: the ledger (<service>.json), the committed
units kept for a rollback. Nothing else spells these paths (gpufleet.hoststate.ledger says what the ledger holds)."""

from __future__ import annotations

STATE_DIR = "/var/lib/gpufleet"


def ledger_path(service: str) -> str:
    return f"{STATE_DIR}/{service}.json"


UNITS_DIR = f"{STATE_DIR}/units"


def committed_unit(service: str, unit_sha256: str) -> str:
    """Where the committed unit is kept, named by its content: the ledger's committed version (service, unit_sha256)
    names its copy, so a copy is never overwritten by another unit, and the rollback target is found from the
    ledger alone. In gpufleet's state dir, not next to the unit: /etc/systemd/system is for units only."""
    return f"{UNITS_DIR}/{service}-{unit_sha256}.service"


def unit_backup(service: str) -> str:
    """Where a ledger from before content-addressed copies (no unit_sha256, or no copy under committed_unit) keeps
    the unit that was serving."""
    return f"{STATE_DIR}/{service}.service.previous"
