"""The names of the checks a version is held to before it is committed, and how a setting or a flag lists them.

Every verify sends the answer checks (a completion, plain and streamed: gpufleet.health.answers). The serving checks
(gpufleet.health.serving) go further and cost a few requests more; each runs only where the server's settings give
it something to check (tools with a tool parser, reasoning with a reasoning parser, the cache ones with prefix
caching). "prefix-cache" is the re-processing probe: the most requests (up to 49), so a plain converge runs it only
when asked (gpufleet_verify_probe, or by name), while a rollout's canary runs every check. "speed"
(gpufleet.health.speed) measures how fast the version serves and holds it to the old version's figures; it runs
first, so that a version that stalls under load fails it rather than the concurrent sessions check.
"""

from __future__ import annotations

from collections.abc import Iterable

ANSWER_CHECKS = ("completion", "stream")
SPEED = "speed"
SERVING_CHECKS = (SPEED, "prefix-cache", "cached-cold", "sessions", "tools", "reasoning")


def parse_checks(value: str | Iterable[str]) -> tuple[str, ...]:
    """"all", "none", a comma list or a list of SERVING_CHECKS, in SERVING_CHECKS order; ValueError naming the
    unknown ones."""
    words = [w.strip() for w in (value.split(",") if isinstance(value, str) else value) if str(w).strip()]
    if words == ["all"]:
        return SERVING_CHECKS
    if words in (["none"], []):
        return ()
    unknown = [w for w in words if w not in SERVING_CHECKS]
    if unknown:
        raise ValueError(f"unknown check {', '.join(map(str, unknown))} (known: {', '.join(SERVING_CHECKS)}, all, "
                         "none)")
    return tuple(n for n in SERVING_CHECKS if n in words)


def verify_checks(listed: Iterable[str], probe: bool) -> tuple[str, ...]:
    """gpufleet_verify_checks as resolved by the settings, with the probe when gpufleet_verify_probe asks for it."""
    return parse_checks([*listed, *(["prefix-cache"] if probe else [])])
