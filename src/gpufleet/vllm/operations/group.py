"""What a replica group's ranks share in one deploy run (docs/multi-node.md): one version, the head's verdict, and
one restart, since a rank cannot rejoin a running engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import gevent.event
from pyinfra import host
from pyinfra.api import FunctionCommand, Host, State, operation
from pyinfra.api.operation import OperationMeta

from gpufleet.operations.base import Commands, fail
from gpufleet.operations.run import run_context
from gpufleet.vllm.group import Member
from gpufleet.vllm.operations.image import target_ref
from gpufleet.vllm.operations.model import target_model
from gpufleet.vllm.weights import ModelTarget


@dataclass(eq=False)
class GroupRun:
    """One group's part of a run, filled in as pyinfra plans each rank."""

    member: Member
    pin: str | None  # known before the pulls, from the head's ledger first
    model: ModelTarget | None = None
    changes: dict[str, list[OperationMeta]] = field(default_factory=dict)  # host -> what may restart it
    reasons: dict[str, list[str]] = field(default_factory=dict)  # host -> why its snapshot restarts it
    verified: gevent.event.Event = field(default_factory=gevent.event.Event)

    def join(self, name: str, changes: list[OperationMeta], reasons: list[str]) -> None:
        self.changes[name], self.reasons[name] = changes, reasons

    def others_restart(self, name: str) -> list[str]:
        out = []
        for other in self.member.hosts:
            if other == name:
                continue
            ops = self.changes.get(other, [])
            if any(op.did_change() if op.is_complete() else op.will_change for op in ops):
                out.append(f"{other} changes")
            out += [f"{other}: {why}" for why in self.reasons.get(other, [])]
        return out


class GroupRuns(dict[str, GroupRun]):
    """The run's groups by name, a slot of the run context."""


def group_run(state: State, member: Member, pins: Callable[[], tuple[str | None, ModelTarget | None]]) -> GroupRun:
    """The group's run record, made when its first rank asks."""
    runs = run_context(state).slot(GroupRuns, GroupRuns)
    if member.group not in runs:
        runs[member.group] = GroupRun(member, *pins())
    return runs[member.group]


def _same_version(state: State, host: Host, group: GroupRun) -> bool:
    ranks = [state.inventory.get_host(h) for h in group.member.hosts]
    for what, found, fix in (
        (
            "digests",
            {r.name: target_ref(group.pin, r) for r in ranks},
            "the tag moved between their pulls (fix: converge again, or pin the digest with gpufleet_image_ref)",
        ),
        (
            "model commits",
            {r.name: target_model(group.model, r) for r in ranks},
            "the branch moved between their downloads (fix: converge again, or set vllm_model_revision to a commit)",
        ),
    ):
        if len(set(found.values())) > 1:
            listed = ", ".join(f"{h} {ref}" for h, ref in found.items())
            return fail(
                host, f"{host.name}: the ranks of group {group.member.group} got different {what} ({listed}): {fix}"
            )
    return True


@operation(is_idempotent=False)
def same_version(group: GroupRun) -> Commands:
    """Fail unless every rank installs the same digest and model commit."""
    if group.pin is not None and (group.model is None or group.model.pin is not None):
        model = f" and {group.model.pin}" if group.model else ""
        host.noop(f"every rank of group {group.member.group} installs {group.pin}{model}")
        return
    yield FunctionCommand(_same_version, (group,), {})
