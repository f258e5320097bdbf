"""pyinfra operations of the vLLM slice. Each takes its inputs as arguments, decides from the host snapshot
(gpufleet.operations.run: what the run read on the host) and yields commands or calls host.noop(reason).
Modules that write files or directories declare them in `managed(layout)`; managed_paths() is what the snapshot
reads (gpufleet.vllm.layout says why).
"""

from __future__ import annotations

from gpufleet.vllm.layout import Layout, Managed
from gpufleet.vllm.operations import docker, model, nvidia, service

# Every module with a managed() declaration. tests/unit/test_vllm_deploy.py prepares the playbook on a bare host and
# fails when an operation writes a path missing here.
MANAGING = (docker, nvidia, model, service)


def managed_paths(layout: Layout) -> Managed:
    return Managed.union(module.managed(layout) for module in MANAGING)
