"""This run's vLLM host snapshot, which the run context keeps untyped."""

from __future__ import annotations

from pyinfra.api import Host

from gpufleet.operations import run
from gpufleet.vllm.facts import HostSnapshot


def snapshot(host: Host | None = None) -> HostSnapshot:
    found = run.snapshot(host)
    if not isinstance(found, HostSnapshot):
        raise TypeError(f"the run's host snapshot is a {type(found).__name__}, not the vLLM host's")
    return found
