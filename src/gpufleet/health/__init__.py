"""Is each host serving what it should, and does it really reuse the prefix cache?

The network client over gpufleet.remote's transport. Library only (typed results, no printing): gpufleet.cli.verify
renders them, gpufleet.vllm.verify waits on them.

    >>> from gpufleet.health import check
    >>> from gpufleet.remote.transport import SshTransport
    >>> from gpufleet.wire.identity import Expected
    >>> report = check(SshTransport(client, name="gpu1"), Expected("vllm", 8000, "qwen35", 32768, {}))
    >>> report.state, report.detail
    (<HealthState.READY: 'ready'>, '/health 200, serving qwen35 (vLLM 0.32.0)')
"""

from gpufleet.health.check import DEFAULT_GRACE_S, HealthReport, HealthState, check
from gpufleet.health.wait import poll_ready, soak, wait_until_ready

__all__ = ["DEFAULT_GRACE_S", "HealthReport", "HealthState", "check", "poll_ready", "soak", "wait_until_ready"]
