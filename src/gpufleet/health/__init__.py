"""Is each host serving what it should? Typed results, no printing (docs/health.md)."""

from gpufleet.health.check import DEFAULT_GRACE_S, HealthReport, HealthState, check
from gpufleet.health.wait import poll_ready, soak, wait_until_ready

__all__ = ["DEFAULT_GRACE_S", "HealthReport", "HealthState", "check", "poll_ready", "soak", "wait_until_ready"]
