"""The vLLM host snapshot this run read (gpufleet.vllm.facts.HostSnapshot), as the vLLM and site cache operations
decide from it: the run context (gpufleet.operations.run) keeps it without naming the slice's type."""

from __future__ import annotations

from pyinfra.api import Host

from gpufleet.operations import run
from gpufleet.vllm.facts import HostSnapshot


def snapshot(host: Host | None = None) -> HostSnapshot:
    found = run.snapshot(host)
    if not isinstance(found, HostSnapshot):
        raise TypeError(f"the run's host snapshot is a {type(found).__name__}, not the vLLM host's")
    return found
