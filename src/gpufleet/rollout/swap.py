"""The swap loop: the canary, then batches, each out of the routers, drained, deployed and judged from its ledger
and what answers (docs/rollout.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

from gpufleet.defaults import SPEED_BATCHES_SETTING
from gpufleet.errors import GpufleetError, one_line
from gpufleet.health.check import HealthReport, reached
from gpufleet.health.serving import Served
from gpufleet.health.speed import measure
from gpufleet.health.wait import poll_ready
from gpufleet.remote.transport import SshTransport, TransportError
from gpufleet.rollout import group as replica_groups
from gpufleet.rollout.carry import Carry
from gpufleet.rollout.context import RolloutContext
from gpufleet.rollout.deploy_run import DeployRun, RunSettings, run_deploy
from gpufleet.rollout.downtime import DowntimeWatch
from gpufleet.rollout.drain import Drained, drain
from gpufleet.rollout.hosts import FleetHost
from gpufleet.rollout.ledgers import HostLedger, read_ledgers
from gpufleet.rollout.membership import look, runs_committed
from gpufleet.rollout.report import OK, HostOutcome, Outcome, SpeedResult, short
from gpufleet.rollout.routers import Routers
from gpufleet.router.api import RouterError
from gpufleet.vllm.settings import merged_settings
from gpufleet.vllm.spec import ServeSpec
from gpufleet.wire.checks import ANSWER_CHECKS, SERVING_CHECKS, SPEED, verify_checks
from gpufleet.wire.identity import Expected
from gpufleet.wire.speed import SpeedFigures

T = TypeVar("T")
STAGE_TIMEOUT_S = 4 * 3600.0
# The ledger says committed: such a replica serves again.
SETTLED = (Outcome.UPDATED, Outcome.UNCHANGED, Outcome.ROLLED_BACK)


@dataclass(frozen=True)
class SwapOptions:
    deploy_file: Path
    canary: int = 1
    batch: int = 1
    probe: bool = False
    # Later batches run the version the canary proved and get only speed, where asked.
    canary_checks: tuple[str, ...] = SERVING_CHECKS
    retry_failed: bool = False
    drain_timeout_s: float = 120.0
    log: Path | None = None
    stage_timeout_s: float = STAGE_TIMEOUT_S  # a stalled host must not hold every lock forever
    carry: bool = True
    model_sha: str | None = None  # the model's commit, when it moves

    def batch_checks(self, canary: bool, speed_batch: bool = False) -> tuple[str, ...]:
        if canary:
            return self.canary_checks
        return (SPEED,) if speed_batch and SPEED in self.canary_checks else ()

    def run_settings(
        self,
        target_ref: str,
        *,
        committed: Mapping[str, str | None] | None = None,
        canary: bool = False,
        speed_batch: bool = False,
        speed_baseline: Mapping[str, SpeedFigures] | None = None,
    ) -> RunSettings:
        return RunSettings(
            image_ref=target_ref,
            model_sha=self.model_sha,
            verify_checks=self.batch_checks(canary, speed_batch),
            expect_committed=committed,
            verify_probe=self.probe,
            retry_failed=self.retry_failed,
            speed_baseline=speed_baseline,
        )


def batches(names: Sequence[T], canary: int, batch: int) -> list[list[T]]:
    """The canary hosts, then the rest, in batches of at most `batch`."""
    if batch < 1 or canary < 0:
        raise ValueError("batch must be >= 1 and canary >= 0")
    first, rest = list(names[:canary]), list(names[canary:])
    return [first[i : i + batch] for i in range(0, len(first), batch)] + [
        rest[i : i + batch] for i in range(0, len(rest), batch)
    ]


def replica_batches(order: Sequence[str], hosts: Mapping[str, FleetHost], canary: int, batch: int) -> list[list[str]]:
    """batches() of replicas: a group counts once and is listed with all its ranks."""
    return [
        [name for unit in chunk for name in unit]
        for chunk in batches(replica_groups.units(order, hosts), canary, batch)
    ]


def held_to(spec: ServeSpec, options: SwapOptions, canary: bool, speed_batch: bool = False) -> tuple[str, ...]:
    """The checks a swapped host is held to, in order."""
    serving = verify_checks(options.batch_checks(canary, speed_batch), options.probe)
    return (*ANSWER_CHECKS, *Served.from_spec(spec).applicable(serving))


def speed_batches(host: FleetHost) -> bool:
    value = merged_settings(host.data)[SPEED_BATCHES_SETTING]
    return value is True or str(value).lower() == "true"


def measure_running(host: FleetHost, transport: SshTransport) -> SpeedFigures:
    try:
        expected = reached(Expected.from_spec(host.spec), transport.container(host.spec.service))
        return measure(transport, expected, Served.from_spec(host.spec), api_key=host.api_key)
    except Exception as error:  # the new version's figures are then recorded, not compared
        raise GpufleetError(f"the running version could not be measured: {type(error).__name__}: {error}") from error


def check_results(held: Sequence[str], outcome: Outcome, failed_check: str | None) -> tuple[tuple[str, bool], ...]:
    """Per check, passed or failed; checks after a failed one never ran."""
    if outcome == Outcome.UPDATED:
        return tuple((name, True) for name in held)
    if failed_check is not None and failed_check in held:
        at = held.index(failed_check)
        return (*((name, True) for name in held[:at]), (failed_check, False))
    return ()


def judge(
    host: str,
    target_ref: str,
    before: HostLedger,
    after: HostLedger,
    run: DeployRun,
    downtime_s: float | None,
    drained: Drained | str | None,
    *,
    held: Sequence[str] = (),
    speed_before: SpeedFigures | str | None = None,
    serving: HealthReport | str | None = None,
) -> HostOutcome:
    """From the ledger; updated or rolled back only when `serving` finds the committed digest answering."""
    outcome = _judged(host, target_ref, before, after, run, downtime_s, drained)
    problem = serving_problem(after, serving) if outcome.outcome in (Outcome.UPDATED, Outcome.ROLLED_BACK) else None
    if problem is not None:
        return replace(
            outcome,
            outcome=Outcome.FAILED,
            detail=one_line(
                f"{outcome.outcome.value} in its ledger, but {problem}"
                + (f"; {outcome.detail}" if outcome.detail else "")
            ),
        )
    mark = after.failed_mark(target_ref) if outcome.outcome == Outcome.ROLLED_BACK else None
    speed = None
    if SPEED in held:
        committed = after.ledger.committed if after.ledger and outcome.outcome == Outcome.UPDATED else None
        old = speed_before if isinstance(speed_before, SpeedFigures) else None
        speed = SpeedResult(
            old, committed.speed if committed else None, speed_before if isinstance(speed_before, str) else ""
        )
    return replace(outcome, checks=check_results(held, outcome.outcome, mark.check if mark else None), speed=speed)


def serving_problem(after: HostLedger, serving: HealthReport | str | None) -> str | None:
    """Why what answers is not the committed version, ready."""
    if serving is None:
        return None
    if isinstance(serving, str):
        return f"it could not be looked at ({serving})"
    if not serving.ready:
        return f"it is not ready ({serving.state}: {serving.detail})"
    if not runs_committed(after, serving):
        c = serving.container
        return f"what answers runs {c.image if c and c.image else 'no container'}, not {short(after.committed_ref)}"
    return None


# How long a swapped host is looked at while it says nothing yet.
AFTER_LOOK_S = 30.0


def _serving(host: FleetHost, transport: SshTransport) -> HealthReport:
    return poll_ready(lambda: look(host, transport), AFTER_LOOK_S)


def _judged(
    host: str,
    target_ref: str,
    before: HostLedger,
    after: HostLedger,
    run: DeployRun,
    downtime_s: float | None,
    drained: Drained | str | None,
) -> HostOutcome:
    from_ref = before.committed_ref
    drain_note = drained.detail if isinstance(drained, Drained) else (f"drain: {drained}" if drained else "")
    if after.error:
        return HostOutcome(
            host, from_ref, target_ref, Outcome.FAILED, downtime_s, f"{after.error}; deploy: {run.summary(host)}"
        )
    if after.committed_ref == target_ref and after.pending_ref is None:
        return HostOutcome(host, from_ref, target_ref, Outcome.UPDATED, downtime_s, drain_note)
    mark = after.failed_mark(target_ref)
    if mark is not None and after.pending_ref is None and after.committed_ref == from_ref:
        return HostOutcome(
            host,
            from_ref,
            target_ref,
            Outcome.ROLLED_BACK,
            downtime_s,
            f"rolled back to {short(from_ref)}: {mark.reason}",
        )
    state = f"ledger: committed {short(after.committed_ref)}, pending {short(after.pending_ref)}"
    return HostOutcome(host, from_ref, target_ref, Outcome.FAILED, downtime_s, f"{run.summary(host)} ({state})")


def swap(
    ctx: RolloutContext,
    order: Sequence[str],
    *,
    before: Mapping[str, HostLedger],
    routers: Routers,
    carry: Carry | None = None,
) -> list[HostOutcome]:
    """Swap `order`'s hosts, each to its target ref; an outcome for every one of them."""
    hosts, options = ctx.hosts, ctx.options
    outcomes: dict[str, HostOutcome] = {}
    canaries = replica_groups.canaries(order, hosts, options.canary)
    # A replica group's caches are each rank's own: nothing carried from it. Starts are still observed.
    carrying = carry if canaries and not replica_groups.in_group(hosts, order[0]) else None
    for batch in replica_batches(order, hosts, options.canary, options.batch):
        role = "canary" if set(batch) <= canaries else "batch"
        if carrying is not None:
            if order[0] in batch:
                carrying.before_canary(order[0])
            elif role == "batch":
                carrying.into([h for h in batch if not replica_groups.in_group(hosts, h)])
        # One deploy run per target ref: `rollback` may send hosts to different ones.
        for target_ref in dict.fromkeys(ctx.target_refs[h] for h in batch):
            moving = [h for h in batch if ctx.target_refs[h] == target_ref]
            swap_batch = partial(_swap_batch, ctx, moving, target_ref, before=before, role=role)
            outcomes.update(_out_of_routers(ctx, routers, moving, target_ref, before=before, swap_batch=swap_batch))
        if carrying is not None and order[0] in batch:
            carrying.after_canary(outcomes[order[0]].outcome == Outcome.UPDATED)
        if carry is not None:
            carry.observe([h for h in batch if outcomes[h].outcome == Outcome.UPDATED])
        if any(outcomes[h].outcome not in OK for h in batch):
            for h in order:
                if h not in outcomes:
                    outcomes[h] = HostOutcome(
                        h,
                        before[h].committed_ref,
                        ctx.target_refs[h],
                        Outcome.NOT_STARTED,
                        None,
                        "not touched: the rollout stopped at a failed gate",
                    )
                    ctx.progress.phase(h, "not started")
            break
    return [outcomes[h] for h in order]


def _out_of_routers(
    ctx: RolloutContext,
    routers: Routers,
    batch: list[str],
    target_ref: str,
    *,
    before: Mapping[str, HostLedger],
    swap_batch: Callable[[], dict[str, HostOutcome]],
) -> dict[str, HostOutcome]:
    """swap_batch() with the batch out of every router; a host rejoins only when judged settled (SETTLED)."""
    # The routers know a replica group's head only.
    routed = [h for h in batch if h in routers.urls]
    if routers.routers:
        for h in routed:
            ctx.progress.phase(h, "leaving the router's workers")
    swapping = False
    try:
        with routers.out(routed, ctx.options.drain_timeout_s):
            swapping = True
            result = swap_batch()
    except (RouterError, OSError) as error:
        if swapping:  # the swap's own error, not the routers'
            raise
        return {
            h: HostOutcome(
                h, before[h].committed_ref, target_ref, Outcome.FAILED, None, one_line(f"not swapped: {error}")
            )
            for h in batch
        }
    if not routers.routers:
        return result
    for h in routed:
        if result[h].outcome not in SETTLED:
            result[h] = replace(
                result[h],
                detail=one_line(f"{result[h].detail}; left out of the routers until it serves its committed version"),
            )
            continue
        problem = routers.rejoin(h)
        if problem is not None:
            result[h] = replace(
                result[h],
                outcome=Outcome.FAILED,
                detail=one_line(f"{result[h].outcome.value}, but {problem}; {result[h].detail}"),
            )
            ctx.progress.phase(h, result[h].phase)
    return result


def _swap_batch(
    ctx: RolloutContext, batch: list[str], target_ref: str, *, before: Mapping[str, HostLedger], role: str
) -> dict[str, HostOutcome]:
    hosts, sessions, options, progress = ctx.hosts, ctx.sessions, ctx.options, ctx.progress

    def drain_one(host: FleetHost, transport: SshTransport) -> Drained:
        return drain(
            transport,
            host.spec.port,
            options.drain_timeout_s,
            on_wait=lambda n: progress.phase(host.name, f"draining: {n} request(s) running"),
            address=host.spec.reach_address,
        )

    workers = [h for h in batch if replica_groups.is_worker(hosts, h)]  # a group's head; its ranks serve nothing
    for h in workers:
        progress.phase(h, f"{role}: draining")
    drained = sessions.each(workers, drain_one)
    canary = role == "canary"
    speed_batch = not canary and any(speed_batches(hosts[h]) for h in batch)
    # Measured drained, on the host and workload the new version gets.
    speed_before: dict[str, SpeedFigures | str] = {}
    if SPEED in options.batch_checks(canary, speed_batch):
        for h in workers:
            progress.phase(h, f"{role}: measuring the running version's speed")
        speed_before = sessions.each(workers, measure_running)
    watches: dict[str, DowntimeWatch] = {}
    for h in batch:
        with suppress(TransportError):
            if h in workers:
                watches[h] = DowntimeWatch(
                    sessions.get(h), hosts[h].spec.port, address=hosts[h].spec.reach_address
                ).start()
        progress.phase(h, f"{role}: restarting on {short(target_ref)}, verifying")
    committed = {h: before[h].committed_ref for h in batch if before[h].error is None}
    baseline = {h: figures for h, figures in speed_before.items() if isinstance(figures, SpeedFigures)}
    settings = options.run_settings(
        target_ref, committed=committed, canary=canary, speed_batch=speed_batch, speed_baseline=baseline or None
    )
    run = run_deploy(
        ctx.inventory, batch, settings, options.deploy_file, log=options.log, timeout_s=options.stage_timeout_s
    )
    downtime = {h: watch.stop() for h, watch in watches.items()}
    after = read_ledgers(sessions, batch)
    # Where the ledger settled, what answers decides the outcome and the rejoin.
    serving = sessions.each([h for h in batch if after[h].error is None and after[h].pending_ref is None], _serving)
    result = {}
    for h in batch:
        outcome = judge(
            h,
            target_ref,
            before[h],
            after[h],
            run,
            downtime.get(h),
            drained.get(h),
            held=held_to(hosts[h].spec, options, canary, speed_batch) if h in workers else (),
            speed_before=speed_before.get(h),
            serving=serving.get(h),
        )
        result[h] = outcome
        progress.phase(h, outcome.phase)
    return result
