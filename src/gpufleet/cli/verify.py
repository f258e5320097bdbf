"""`gpufleet status` and `gpufleet verify`: gather gpufleet.health results for an inventory's hosts and routers."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import click
from rich.console import Console

from gpufleet.cli.envelope import BadInput, load_inventory, stopped
from gpufleet.cli.health_report import report
from gpufleet.cli.health_tables import checks_table, host_table, probe_table, router_table, speed_table
from gpufleet.cli.logs import quiet_ssh_logs, stderr
from gpufleet.cli.progress import FleetProgress
from gpufleet.defaults import SPEED_TOLERANCE_SETTING
from gpufleet.errors import GpufleetError
from gpufleet.health.runner import HostResult, HostTarget, check_fleet
from gpufleet.hoststate import reader
from gpufleet.hoststate.paths import ledger_path
from gpufleet.inventory import HostData, load_roles_and_groups
from gpufleet.remote.transport import SshTransport, Transport, TransportError
from gpufleet.rollout.hosts import shell
from gpufleet.rollout.ledgers import parse_read
from gpufleet.rollout.settle import settle_routers
from gpufleet.router.check import RouterExpected, RouterVerdict, problems, verify_router
from gpufleet.router.settings import RouterSettings, replicas, resolve_router
from gpufleet.router.status import read_host
from gpufleet.vllm.host_specs import load_host_specs
from gpufleet.vllm.settings import merged_settings
from gpufleet.wire.checks import SERVING_CHECKS, parse_checks
from gpufleet.wire.speed import SpeedFigures


def load_targets(inventory: str, only_host: str | None = None) -> list[HostTarget]:
    """What to check on each vLLM host of the inventory. Raises GpufleetError."""
    return [
        replace(
            target,
            speed_tolerance=float(merged_settings(data)[SPEED_TOLERANCE_SETTING]),
            rank=(spec.group.group, spec.group.rank, spec.group.head) if spec.group else None,
        )
        for spec, data in load_host_specs(inventory, only_host)
        for target in [HostTarget.for_spec(spec, data)]
    ]


def _gather(inventory: str, host: str | None, **kwargs: Any) -> list[HostResult]:
    try:
        targets = load_targets(inventory, host)
    except GpufleetError as e:  # bad input, before any host is reached
        raise BadInput(str(e)) from None
    quiet_ssh_logs()
    return check_fleet(targets, committed=read_committed, **kwargs)


def read_committed(target: HostTarget, transport: Transport) -> tuple[str, SpeedFigures | None] | None:
    """The digest the host's ledger committed and its speed figures, as the rollout reads them; None if unreadable."""
    if not isinstance(transport, SshTransport):
        return None
    service, port = target.expected.service, target.expected.port
    try:
        rc, out, err = shell(transport, reader.read_command(ledger_path(service)), root=True)
    except TransportError:
        return None
    committed = parse_read(target.name, service, port, rc, out, err).ledger
    c = committed.committed if committed else None
    return (c.version.ref, c.speed) if c else None


def _console() -> Console:
    # Piped output gets a wide table rather than rich's 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=160)


_inventory_arg = click.argument("inventory", type=click.Path(dir_okay=False))
_host_opt = click.option("--host", "host", default=None, help="Only this inventory host.")
_json_opt = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='One JSON document on stdout: {"command", "ok", "hosts", "routers"} (docs/cli.md).',
)


@click.command()
@_inventory_arg
@_host_opt
@_json_opt
@click.option(
    "--fix",
    is_flag=True,
    help="First put every router's worker set in step: remove each worker that is no replica of the "
    "inventory, put back each replica that belongs (committed, nothing pending, ready).",
)
@click.pass_context
def status(ctx: click.Context, inventory: str, host: str | None, as_json: bool, fix: bool) -> None:
    """Show each host's serving state: image, vLLM version, model, KV cache use, load, prefix-cache hits; and each
    router's workers. Every problem is one line with its fix.

    \b
    Exit status: 0 every host and router ready, 1 problems found, 2 bad input (docs/cli.md).

    \b
    Example:
        gpufleet status inventories/lab.py
        gpufleet status inventories/lab.py --json | jq '.hosts[].state'
        gpufleet status inventories/lab.py --fix
    """
    if fix and host:
        raise BadInput("--fix settles every router of the inventory (fix: leave out --host)")
    routers, found = _roles(inventory, host)
    expected = _router_expectations(inventory, routers, found)  # before any SSH
    if fix:
        try:
            load_targets(inventory)  # before any router changes
        except GpufleetError as e:
            raise BadInput(str(e)) from None
        quiet_ssh_logs()
        try:
            for name, line in settle_routers(inventory).items():
                click.echo(f"{name}: {line}", err=True)
        except GpufleetError as error:
            raise stopped("status", str(error), as_json) from None
    results = _gather(inventory, host) if not (host and routers) else []
    verdicts = []
    for (name, data), (settings, exp) in zip(routers, expected, strict=True):
        look = read_host(name, data, settings)
        verdicts.append(RouterVerdict(look, problems(look, exp)))

    def tables(console: Console) -> None:
        if results:
            console.print(host_table(results, "gpufleet status"))
        if verdicts:
            console.print(router_table([v.status for v in verdicts]))

    ctx.exit(report("status", inventory, results, verdicts, as_json, _console(), tables))


def _roles(inventory: str, host: str | None) -> tuple[list[HostData], list[HostData]]:
    """(the routers `--host` selects, every vLLM host) of the inventory; raises BadInput."""
    routers, found = load_inventory(inventory, host)
    return [(name, data) for name, data in routers if host in (None, name)], found


@click.command()
@_inventory_arg
@_host_opt
@_json_opt
@click.option("--probe", "run_probe", is_flag=True, help="Also measure prompt re-processing on turn N+1.")
@click.option(
    "--checks",
    "checks",
    default="none",
    show_default=True,
    metavar="LIST",
    help=f"Serving checks to run on each ready host, where its settings apply: a comma list of "
    f"{', '.join(SERVING_CHECKS)}, or all (docs/verify.md).",
)
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Seconds to wait for hosts and routers to become ready.")  # fmt: skip
# No envvar: a client's VLLM_API_KEY would silently override every host's own key.
@click.option("--api-key", default=None,
              help="For servers run with --api-key; overrides every host's vllm_api_key (default: each host's own).")  # fmt: skip
@click.pass_context
def verify(
    ctx: click.Context, inventory: str, host: str | None, as_json: bool, run_probe: bool, checks: str,
    wait_s: float, api_key: str | None,
) -> None:  # fmt: skip
    """Exit non-zero unless every host is ready and answers a chat completion, plain and streamed (and, with
    --probe, reuses its prefix cache), and every router answers and routes to every replica of the inventory,
    healthy, and to nothing else. Every problem is one line with its fix; progress goes to stderr.

    \b
    Exit status: 0 all verified, 1 problems found, 2 bad input (docs/cli.md).

    \b
    Example:
        gpufleet verify inventories/lab.py --probe
        gpufleet verify inventories/lab.py --checks cached-cold,tools
    """
    try:
        names = parse_checks(checks)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--checks") from None
    deadline = time.monotonic() + wait_s  # shared by hosts, then routers
    routers, found = _roles(inventory, host)
    expected = _router_expectations(inventory, routers, found)  # before any SSH
    results: list[HostResult] = []
    verdicts: list[RouterVerdict] = []
    with FleetProgress(stderr()) as progress:
        if not (host and routers):
            progress.note(_what_verify_does(wait_s, run_probe, names))
            results = _gather(
                inventory,
                host,
                run_probe=run_probe,
                wait_s=wait_s,
                api_key=api_key,
                answer=True,
                checks=names,
                progress=progress.phase,
            )
        for (name, data), (settings, exp) in zip(routers, expected, strict=True):
            progress.phase(name, "reading the router" + (" (waiting for it to pass)" if wait_s else ""))
            verdicts.append(verify_router(partial(read_host, name, data, settings), exp, deadline))
            progress.phase(name, "ok" if verdicts[-1].ok else "not ok")

    def tables(console: Console) -> None:
        if results:
            console.print(host_table(results, "gpufleet verify"))
        if any(r.checks for r in results):
            console.print(checks_table(results, names))
        if any(r.speed for r in results):
            console.print(speed_table(results))
        if any(r.probe is not None for r in results):
            console.print(probe_table(results))
        if verdicts:
            console.print(router_table([v.status for v in verdicts]))

    ctx.exit(report("verify", inventory, results, verdicts, as_json, _console(), tables))


def _what_verify_does(wait_s: float, run_probe: bool, checks: Sequence[str]) -> str:
    steps = [
        f"waiting up to {wait_s:.0f} s for each host to be ready" if wait_s else "one look at each host",
        "a chat completion, plain and streamed",
    ]
    if checks:
        steps.append(f"serving checks {', '.join(checks)}")
    if run_probe:
        steps.append("the prompt re-processing probe (up to a few minutes a host)")
    return "verify: " + "; ".join(steps)


def _router_expectations(
    inventory: str, routers: list[HostData], found: list[HostData]
) -> list[tuple[RouterSettings, RouterExpected]]:
    """Each router's settings, and what it should route to at the URLs its deploy gives them."""
    if not routers:
        return []  # vLLM may stay on loopback without a router
    try:
        workers = replicas(found, load_roles_and_groups(inventory)[2])
    except GpufleetError as e:
        raise BadInput(str(e)) from None
    resolved, refused = [], []
    for name, data in routers:
        try:
            resolved.append(resolve_router(name, data))
        except GpufleetError as e:
            refused.append(str(e))
    if refused:
        raise BadInput("\n".join(refused))
    return [(settings, RouterExpected.for_router(settings, workers, inventory)) for settings in resolved]
