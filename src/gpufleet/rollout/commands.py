"""The rollout, rollback and history commands end to end, as library calls the CLI renders."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from gpufleet.errors import GpufleetError, one_line
from gpufleet.facts.pull import PullStats
from gpufleet.inventory import load_roles
from gpufleet.rollout import group as replica_groups
from gpufleet.rollout.carry import Carry, CarryResult
from gpufleet.rollout.context import RolloutContext
from gpufleet.rollout.gpu import sick_hosts
from gpufleet.rollout.hosts import FleetHost, Sessions, load_fleet
from gpufleet.rollout.ledgers import HostLedger, read_ledgers
from gpufleet.rollout.membership import members
from gpufleet.rollout.prepare import prepare, pull_stats
from gpufleet.rollout.progress import Progress
from gpufleet.rollout.report import HostOutcome, Outcome, short
from gpufleet.rollout.routers import Routers
from gpufleet.rollout.swap import SwapOptions, replica_batches, swap
from gpufleet.rollout.target import Target, requested_image, resolve, resolve_model

# (what, hosts to swap) -> go on? Asked once, before anything changes.
Confirm = Callable[[str, Sequence[str]], bool]


@dataclass(frozen=True)
class Result:
    target: str  # RolloutContext.what
    outcomes: list[HostOutcome]
    message: str = ""  # what was decided before any host changed, if anything

    @property
    def carried(self) -> dict[str, CarryResult]:
        return {o.host: o.start for o in self.outcomes if o.start is not None}


def _unreadable(ledgers: Mapping[str, HostLedger], target_refs: Mapping[str, str]) -> list[HostOutcome] | None:
    """Outcomes when a ledger cannot be read: nothing is started, as no host could be judged."""
    bad = {h: lg.error for h, lg in ledgers.items() if lg.error}
    if not bad:
        return None
    return [
        HostOutcome(
            h,
            lg.committed_ref,
            target_refs[h],
            Outcome.FAILED_PREPARE if h in bad else Outcome.NOT_STARTED,
            None,
            bad.get(h) or "not started: another host's ledger could not be read",
        )
        for h, lg in ledgers.items()
    ]


def _refused(ledgers: Mapping[str, HostLedger], target_refs: Mapping[str, str], model_sha: str | None) -> str | None:
    """The refusal when the target failed on a host before and --retry-failed is not given."""
    for h, lg in ledgers.items():
        mark = lg.failed_mark(target_refs[h], lg.model_at(model_sha))
        if mark is not None:
            return one_line(
                f"{h}: {target_refs[h]} failed there at {mark.failed_at}: {mark.reason} (fix: roll out "
                "another image, or pass --retry-failed to try this one again on purpose)"
            )
    return None


def _roll(ctx: RolloutContext, confirm: Confirm) -> Result:
    names, target_refs, options, progress = ctx.names, ctx.target_refs, ctx.options, ctx.progress
    progress.note("reading each host's ledger")
    ledgers = read_ledgers(ctx.sessions, names)
    unreadable = _unreadable(ledgers, target_refs)
    if unreadable is not None:
        return Result(ctx.what, unreadable, "a ledger could not be read: nothing was changed")
    if not options.retry_failed and (refusal := _refused(ledgers, target_refs, options.model_sha)):
        raise GpufleetError(refusal)
    on_target = {
        h
        for h in names
        if ledgers[h].committed_ref == target_refs[h]
        and ledgers[h].pending_ref is None
        and (options.model_sha is None or (ledgers[h].committed_model or "").endswith("@" + options.model_sha))
    }
    # A replica group is done when every rank is.
    done = replica_groups.done(on_target, ctx.hosts)
    outcomes = {
        h: HostOutcome(
            h,
            ledgers[h].committed_ref,
            target_refs[h],
            Outcome.UNCHANGED,
            None,
            "already committed on the target: not restarted",
        )
        for h in done
    }
    order = replica_groups.expand([h for h in names if h not in done], ctx.hosts)
    workers = replica_groups.workers(list(ctx.hosts.values()))
    serving = [h.name for h in workers]  # what the routers route to
    for h in done:
        progress.phase(h, "unchanged (already on the target)")
    # Skipped with every rank of its replica group.
    sick = replica_groups.skipped(sick_hosts(ctx.sessions, order, progress.note), ctx.hosts)
    for h, why in sick.items():
        outcomes[h] = HostOutcome(h, ledgers[h].committed_ref, target_refs[h], Outcome.SKIPPED, None, why)
        progress.phase(h, outcomes[h].phase)
    order = [h for h in order if h not in sick]
    # Before anything changes: a router out of reach might still send traffic to a host being swapped.
    router_hosts = load_roles(ctx.inventory)[0]
    if router_hosts:
        progress.note(f"reaching the routers: {', '.join(name for name, _ in router_hosts)}")
    replicas = [(h.name, dict(h.data)) for h in workers]
    if not order:
        message = (
            f"every host already runs {ctx.what}: nothing to do"
            if not sick
            else f"{len(sick)} host(s) skipped for their GPUs; the others already run {ctx.what}"
        )
        try:
            with Routers.connect(router_hosts, replicas) as routers:
                _reconcile(ctx, routers, serving, ledgers)
        except GpufleetError as error:  # nothing to swap: a warning, not a failure
            message += f"; the routers were not reconciled: {error}"
        return Result(ctx.what, [outcomes[h] for h in names], message)
    with Routers.connect(router_hosts, replicas) as routers:
        # A cut run's pending hosts swap first; a host skipped for its GPU counts as out of service.
        belongs = members(ctx.sessions, serving, ledgers) if routers.routers else {}
        order = replica_groups.expand(interrupted_first(order, ledgers), ctx.hosts)
        if problem := routers.capacity_problem(
            replica_batches(order, ctx.hosts, options.canary, options.batch), {**belongs, **dict.fromkeys(sick, False)}
        ):
            raise GpufleetError(problem)
        if not confirm(ctx.what, order):
            raise GpufleetError("not confirmed: nothing was changed")
        _reconcile(ctx, routers, serving, ledgers, belongs=belongs)
        try:
            return _prepare_and_swap(ctx, ledgers=ledgers, outcomes=outcomes, order=order, routers=routers)
        finally:
            _reconcile(ctx, routers, serving, read_ledgers(ctx.sessions, serving))


def interrupted_first(order: Sequence[str], ledgers: Mapping[str, HostLedger]) -> list[str]:
    """The hosts a cut run left pending before the others, each in order."""
    return sorted(order, key=lambda h: ledgers[h].pending_ref is None)


def _reconcile(
    ctx: RolloutContext,
    routers: Routers,
    names: Sequence[str],
    ledgers: Mapping[str, HostLedger],
    *,
    belongs: Mapping[str, bool | None] | None = None,
) -> None:
    if not routers.routers:
        return
    found = belongs if belongs is not None else members(ctx.sessions, names, ledgers)
    for name, line in routers.reconcile(found).items():
        ctx.progress.note(f"{name}: {line}")


def _prepare_and_swap(
    ctx: RolloutContext,
    *,
    ledgers: Mapping[str, HostLedger],
    outcomes: dict[str, HostOutcome],
    order: Sequence[str],
    routers: Routers,
) -> Result:
    options, progress, target_refs = ctx.options, ctx.progress, ctx.target_refs
    prepared: dict[str, str] = {}
    pulls: dict[str, PullStats | None] = {}
    for target_ref in dict.fromkeys(target_refs[h] for h in order):
        moving = [h for h in order if target_refs[h] == target_ref]
        for h in moving:
            progress.phase(h, f"preparing {short(target_ref)} (pull, model, flag check)")
        _, failures = prepare(
            ctx.inventory,
            moving,
            target_ref,
            options.deploy_file,
            log=options.log,
            timeout_s=options.stage_timeout_s,
            model_sha=options.model_sha,
        )
        pulls.update(pull_stats(ctx.sessions, moving, target_ref))  # each host's own record of what its pull moved
        prepared.update(failures)
        if failures:
            break
    if prepared:
        for h in order:
            outcomes[h] = HostOutcome(
                h,
                ledgers[h].committed_ref,
                target_refs[h],
                Outcome.FAILED_PREPARE if h in prepared else Outcome.NOT_STARTED,
                None,
                prepared.get(h) or "not started: another host failed to prepare",
                pull=pulls.get(h),
            )
            progress.phase(h, outcomes[h].phase)
        return Result(ctx.what, [outcomes[h] for h in ctx.names], "prepare failed: no host was swapped")
    for h in order:
        progress.phase(h, "prepared; waiting for its turn")
    carry = Carry(
        ctx.sessions,
        ctx.hosts,
        note=progress.note,
        turned_off=None if options.carry else "the carry is turned off (--no-carry)",
    )
    for outcome in swap(ctx, order, before=ledgers, routers=routers, carry=carry):
        outcomes[outcome.host] = outcome
    for h in order:
        outcomes[h] = replace(outcomes[h], pull=pulls.get(h), start=carry.results.get(h))
    return Result(ctx.what, [outcomes[h] for h in ctx.names])


def roll_out(
    inventory: str,
    image: str | None,
    options: SwapOptions,
    confirm: Confirm,
    progress_for: Callable[[Sequence[str]], Progress],
    *,
    model_revision: str | None = None,
) -> Result:
    """model_revision: move the model too, to the commit it names now."""
    hosts = load_fleet(inventory)
    requested = requested_image(hosts, image)  # bad input fails before any host is contacted
    with Sessions(hosts) as sessions, progress_for([h.name for h in hosts]) as progress:
        progress.note(f"resolving {requested} to one digest")
        target: Target = resolve(hosts, sessions, image)
        where = f" ({target.where})" if target.where else ""
        progress.note(f"target: {target.ref}{where}")
        if model_revision is not None:
            options = replace(options, model_sha=resolve_model(hosts, sessions, model_revision))
            progress.note(f"model: {model_revision} -> {options.model_sha}")
        ctx = RolloutContext(
            inventory=inventory,
            hosts={h.name: h for h in hosts},
            sessions=sessions,
            target_refs=dict.fromkeys([h.name for h in hosts], target.ref),
            what=target.ref,
            options=options,
            progress=progress,
        )
        return _roll(ctx, confirm)


def previous_targets(ledgers: Mapping[str, HostLedger], to: str | None) -> dict[str, str]:
    """Each host's rollback target ref: `to`, else its ledger's newest earlier committed digest."""
    target_refs, missing = {}, []
    for h, lg in ledgers.items():
        ref = to or lg.previous_ref()
        if ref is None:
            missing.append(h)
        else:
            target_refs[h] = ref
    if missing:
        raise GpufleetError(
            one_line(
                f"{', '.join(missing)}: no earlier committed version in the ledger (fix: pass "
                "--to repo@sha256:<digest>; `gpufleet history` lists what ran)"
            )
        )
    return target_refs


def roll_back(
    inventory: str,
    options: SwapOptions,
    confirm: Confirm,
    progress_for: Callable[[Sequence[str]], Progress],
    *,
    host: str | None = None,
    to: str | None = None,
) -> Result:
    hosts = load_fleet(inventory, host)
    if to is not None:
        requested_image(hosts, to)  # same repository, a valid reference
        if "@sha256:" not in to:
            raise GpufleetError(
                one_line(f"--to {to}: not a digest (fix: pass repo@sha256:<digest>, as `gpufleet history` shows it)")
            )
    with Sessions(hosts) as sessions, progress_for([h.name for h in hosts]) as progress:
        ledgers = read_ledgers(sessions, [h.name for h in hosts])
        bad = [lg.error for lg in ledgers.values() if lg.error]
        if bad:
            raise GpufleetError("; ".join(e for e in bad if e))
        ctx = RolloutContext(
            inventory=inventory,
            hosts={h.name: h for h in hosts},
            sessions=sessions,
            target_refs=previous_targets(ledgers, to),
            what=to or "each host's previous committed digest",
            options=replace(options, canary=0, batch=1),
            progress=progress,
        )
        return _roll(ctx, confirm)


def history(inventory: str, host: str | None) -> list[tuple[FleetHost, HostLedger]]:
    hosts = load_fleet(inventory, host)
    with Sessions(hosts) as sessions:
        ledgers = read_ledgers(sessions, [h.name for h in hosts])
    return [(h, ledgers[h.name]) for h in hosts]
