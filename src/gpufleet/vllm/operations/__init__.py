"""pyinfra operations of the vLLM slice, deciding from the host snapshot."""

from __future__ import annotations

from gpufleet.vllm.layout import Layout, Managed
from gpufleet.vllm.operations import docker, model, nvidia, service

# tests/unit/test_vllm_deploy.py checks that every path an operation writes is declared here.
MANAGING = (docker, nvidia, model, service)


def managed_paths(layout: Layout) -> Managed:
    return Managed.union(module.managed(layout) for module in MANAGING)
