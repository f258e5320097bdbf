"""The names of the checks a version is held to before it is committed (docs/verify.md)."""

from __future__ import annotations

from collections.abc import Iterable

ANSWER_CHECKS = ("completion", "stream")
SPEED = "speed"
# In run order: speed first (docs/verify.md, Speed).
SERVING_CHECKS = (SPEED, "prefix-cache", "cached-cold", "sessions", "tools", "reasoning")


def parse_checks(value: str | Iterable[str]) -> tuple[str, ...]:
    """ "all", "none" or check names, in SERVING_CHECKS order; ValueError names unknown ones."""
    words = [w.strip() for w in (value.split(",") if isinstance(value, str) else value) if str(w).strip()]
    if words == ["all"]:
        return SERVING_CHECKS
    if words in (["none"], []):
        return ()
    unknown = [w for w in words if w not in SERVING_CHECKS]
    if unknown:
        raise ValueError(
            f"unknown check {', '.join(map(str, unknown))} (known: {', '.join(SERVING_CHECKS)}, all, none)"
        )
    return tuple(n for n in SERVING_CHECKS if n in words)


def verify_checks(listed: Iterable[str], probe: bool) -> tuple[str, ...]:
    """gpufleet_verify_checks, plus the probe when gpufleet_verify_probe is on."""
    return parse_checks([*listed, *(["prefix-cache"] if probe else [])])
