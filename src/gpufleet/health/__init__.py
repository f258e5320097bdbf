"""Is each host serving what it should, and does it really reuse the prefix cache?

Library only (typed results, no printing): gpufleet.cli.verify renders them, gpufleet.deploys.verify waits on them.

    >>> from gpufleet.health import Expected, check, SshTransport
    >>> report = check(SshTransport(client, name="gpu1"), Expected("vllm", 8000, "qwen35", 32768, {}))
    >>> report.state, report.detail
    (<HealthState.READY: 'ready'>, '/health 200, serving qwen35 (vLLM 0.32.0)')
"""

from gpufleet.health.check import DEFAULT_GRACE_S, Expected, HealthReport, HealthState, check
from gpufleet.health.transport import (
    ContainerInfo,
    SshTransport,
    Transport,
    TransportError,
    Unreachable,
    transport_from_pyinfra_host,
)
from gpufleet.health.wait import poll_ready, soak, wait_until_ready

__all__ = [
    "DEFAULT_GRACE_S",
    "ContainerInfo",
    "Expected",
    "HealthReport",
    "HealthState",
    "SshTransport",
    "Transport",
    "TransportError",
    "Unreachable",
    "check",
    "poll_ready",
    "soak",
    "transport_from_pyinfra_host",
    "wait_until_ready",
]
