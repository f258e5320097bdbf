"""What one rollout or rollback hands each of its steps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpufleet.rollout.hosts import FleetHost, Sessions
from gpufleet.rollout.progress import Progress

if TYPE_CHECKING:  # swap imports this module
    from gpufleet.rollout.swap import SwapOptions


@dataclass(frozen=True)
class RolloutContext:
    inventory: str
    hosts: Mapping[str, FleetHost]  # in the inventory's order
    sessions: Sessions
    target_refs: Mapping[str, str]  # host -> the digest ref it moves to
    what: str  # the target as the user reads it
    options: SwapOptions
    progress: Progress

    @property
    def names(self) -> list[str]:
        return list(self.hosts)
