"""Is each host serving what it should, and does it really reuse the prefix cache?

Library only (typed results, no printing): gpufleet.cli.verify renders them.

    >>> from gpufleet.health import Expected, check, SshTransport
    >>> report = check(SshTransport(client, name="gpu1"), Expected("vllm", 8000, "qwen35", 32768, {}))
    >>> report.state, report.detail
    (<HealthState.READY: 'ready'>, '/health 200, serving qwen35 (vLLM 0.32.0)')
"""

from gpufleet.health.check import DEFAULT_GRACE_S, Expected, HealthReport, HealthState, check, wait_until_ready
from gpufleet.health.loopback import LoopbackTransport
from gpufleet.health.transport import (
    ContainerInfo,
    SshTransport,
    Transport,
    TransportError,
    Unreachable,
    transport_from_pyinfra_host,
)

__all__ = [
    "DEFAULT_GRACE_S",
    "ContainerInfo",
    "Expected",
    "HealthReport",
    "HealthState",
    "LoopbackTransport",
    "SshTransport",
    "Transport",
    "TransportError",
    "Unreachable",
    "check",
    "transport_from_pyinfra_host",
    "wait_until_ready",
]
