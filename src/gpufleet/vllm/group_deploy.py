"""The vLLM deploy's part for a replica group (docs/multi-node.md): the ranks planned, checked, restarted and
verified together."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pyinfra.api import Host, Inventory

from gpufleet.harness.preflight import Reading
from gpufleet.hoststate.ledger import FinishPending, Resume, RollBackPending
from gpufleet.inventory import ROUTERS_GROUP, group_orders
from gpufleet.units import unit_name
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.group_specs import resolve_one
from gpufleet.vllm.lint import GroupLintContext, lint_group
from gpufleet.vllm.operations.group import GroupRun, group_run
from gpufleet.vllm.operations.service import serves_expected
from gpufleet.vllm.settings import VllmSettings, resolve_host
from gpufleet.vllm.spec import ServeSpec
from gpufleet.vllm.weights import ModelTarget
from gpufleet.wire.identity import Expected


def resolve(
    name: str, data: Mapping[str, Any], inventory: Inventory | None, behind_router: bool
) -> tuple[ServeSpec, VllmSettings]:
    """A host's spec and settings, its group's ranks resolved with it (raises SettingErrors)."""
    if inventory is None or inventory.get_host(name, None) is None:
        return resolve_host(name, data, behind_router=behind_router)
    # The host's own data as given (the caller's may differ from the inventory's); its ranks' from the inventory.
    vllm_hosts = [
        (h.name, data if h.name == name else h.data.dict()) for h in inventory if ROUTERS_GROUP not in h.groups
    ]
    return resolve_one(name, vllm_hosts, group_orders(inventory), behind_router)


def probe_target(spec: ServeSpec) -> tuple[str, int] | None:
    """Where a rank's snapshot probes its head (the head probes nothing)."""
    member = spec.group
    return None if member is None or member.is_head else (member.addresses[0], member.port)


def probe_problem(name: str, snap: HostSnapshot, spec: ServeSpec) -> str | None:
    """A rank that cannot reach its head's master port: the ranks could never meet."""
    member = spec.group
    if member is None or member.is_head or snap.group_probe in (None, "open", "refused"):
        return None
    return (
        f"{name}: cannot reach the head {member.head}'s master port {member.addresses[0]}:{member.port} "
        f"(vllm_group_port) from here: {snap.group_probe} (fix: open TCP from {member.address} to "
        f"{member.addresses[0]} on every port between the group's hosts, or correct vllm_group_address)"
    )


def check_groups(readings: Mapping[str, Reading[Any, Any]]) -> dict[str, list[str]]:
    """Refusals across each group's ranks: every rank in the run, one GPU model and one driver."""
    found: dict[str, list[str]] = {}
    groups = {
        r.plan.spec.group.group: r.plan.spec.group
        for r in readings.values()
        if r.plan is not None and r.plan.spec.group is not None
    }
    for member in groups.values():
        present = [h for h in member.hosts if h in readings]
        missing = [h for h in member.hosts if h not in readings]
        if missing:
            line = (
                f"{present[0]}: group {member.group} deploys as one, and {', '.join(missing)} is not in this run "
                f"(fix: run on every host of the group: --limit {','.join(member.hosts)}, or no --limit)"
            )
            found.setdefault(present[0], []).append(line)
            continue
        snaps: dict[str, HostSnapshot] = {h: snap for h in member.hosts if (snap := readings[h].snapshot)}
        if len(snaps) < len(member.hosts):
            continue  # a rank not read is refused on its own line already
        context = GroupLintContext(
            member.group,
            {h: s.gpus[0].name if s.gpus else "" for h, s in snaps.items()},
            {h: s.driver.driver_version if s.driver else "" for h, s in snaps.items()},
        )
        head_plan = readings[member.head].plan
        accepted = set(head_plan.settings.accept) if head_plan is not None else set()
        for finding in lint_group(member.head, context):
            if finding.rule.id not in accepted:
                found.setdefault(member.head, []).append(str(finding))
    return found


def restart_refusals(
    readings: Mapping[str, Reading[Any, Any]],
    restart_of: Callable[[Reading[Any, Any]], str | None],
    refusals: Callable[[str, Reading[Any, Any], str], list[str]],
) -> dict[str, list[str]]:
    """refusals(rank, reading, why) for each rank restarted only with its group."""
    found: dict[str, list[str]] = {}
    groups = {
        r.plan.spec.group.group: r.plan.spec.group
        for r in readings.values()
        if r.plan is not None and r.plan.spec.group is not None
    }
    for member in groups.values():
        read = {h: readings[h] for h in member.hosts if h in readings and readings[h].plan and readings[h].snapshot}
        restarts = {h: why for h, r in read.items() if (why := restart_of(r)) is not None}
        if not restarts:
            continue
        first, why = next(iter(restarts.items()))
        for h, r in read.items():
            if h not in restarts:
                found[h] = refusals(h, r, f"restart with its group ({first} would {why})")
    return {h: lines for h, lines in found.items() if lines}


def group_for(
    host: Host,
    spec: ServeSpec,
    readings: Mapping[str, Reading[Any, Any]],
    pins_of: Callable[[Reading[Any, Any]], tuple[str | None, ModelTarget | None]],
) -> GroupRun | None:
    """The host's group in this run (None outside one), on the first rank's pins."""
    member = spec.group
    if member is None:
        return None

    def pins() -> tuple[str | None, ModelTarget | None]:
        found = [pins_of(readings[h]) for h in member.hosts]
        models = [m for _, m in found if m is not None]
        return (
            next((ref for ref, _ in found if ref is not None), None),
            next((m for m in models if m.pin is not None), models[0] if models else None),
        )

    return group_run(host.state, member, pins)


def as_group(decision: Resume) -> Resume:
    """A cut run's version on a rank is finished with its group, never rolled back alone."""
    if isinstance(decision, RollBackPending):
        return FinishPending(decision.pending, restart=True, reason=f"{decision.reason}; finishing it with the group")
    return decision


def restart_reasons(snap: HostSnapshot, spec: ServeSpec, decision: Resume) -> list[str]:
    """Why this rank restarts whatever its operations change (then every rank does)."""
    reasons = [f"runs what its unit does not say ({'; '.join(snap.running.drift())})"] if snap.running.drift() else []
    if not snap.unit_active(unit_name(spec.service)):
        reasons.append("its service is not running")
    if isinstance(decision, FinishPending) and decision.restart:
        reasons.append(decision.reason)
    return reasons


def head_serves(readings: Mapping[str, Reading[Any, Any]], spec: ServeSpec) -> bool:
    """Does the group's head serve what its spec says, as preflight read it?"""
    assert spec.group is not None
    head = readings[spec.group.head]
    return bool(head.snapshot and head.plan and serves_expected(head.snapshot, Expected.from_spec(head.plan.spec)))
