"""pyinfra operations of the vLLM slice: each decides from the host snapshot and yields commands or a noop."""

from __future__ import annotations

from gpufleet.vllm.layout import Layout, Managed
from gpufleet.vllm.operations import docker, model, nvidia, service

# Checked by tests/unit/test_vllm_deploy.py: every path an operation writes is declared here.
MANAGING = (docker, nvidia, model, service)


def managed_paths(layout: Layout) -> Managed:
    return Managed.union(module.managed(layout) for module in MANAGING)
