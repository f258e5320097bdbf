"""`gpufleet deploy`: pyinfra on the shipped deploy files, the vLLM hosts first, then the routers (docs/cli.md)."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from gpufleet.cli.envelope import BadInput, unreadable
from gpufleet.cli.logs import quiet, verbose
from gpufleet.errors import GpufleetError
from gpufleet.harness import packaged_deploy_file
from gpufleet.inventory import ROUTERS_GROUP, load_pyinfra_hosts
from gpufleet.rollout.deploy_run import pyinfra_command

ONLY = ("vllm", "router")


def limits(args: Sequence[str]) -> list[str]:
    """The --limit patterns among pyinfra's options, one per comma-separated name."""
    found: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--limit" and i + 1 < len(args):
            found += args[i + 1].split(",")
        elif arg.startswith("--limit="):
            found += arg.removeprefix("--limit=").split(",")
    return [pattern for pattern in found if pattern]


def router_hosts(inventory: str) -> list[tuple[str, tuple[str, ...]]]:
    """(name, groups) of the inventory's routers; none when INVENTORY is no file or does not load (pyinfra says why)."""
    if not Path(inventory).is_file():
        return []
    try:
        hosts = load_pyinfra_hosts(inventory)
    except GpufleetError:
        return []
    return [(h.name, tuple(h.groups)) for h in hosts if ROUTERS_GROUP in h.groups]


def routers_in_limit(routers: Sequence[tuple[str, tuple[str, ...]]], patterns: Sequence[str]) -> bool:
    """Whether pyinfra's --limit reaches a router, by host or group name."""
    if not patterns:
        return bool(routers)
    return any(fnmatch.fnmatch(name, p) or p in groups for name, groups in routers for p in patterns)


def check_inventory(inventory: str) -> None:
    """Raise BadInput for an inventory file that is missing, does not load or lists no host; pyinfra judges the rest."""
    if not Path(inventory).is_file():
        if inventory.endswith(".py") or "/" in inventory:
            raise BadInput(f"{inventory}: inventory file not found (fix: pass a path like inventories/lab.py)")
        return
    try:
        hosts = load_pyinfra_hosts(inventory)
    except GpufleetError as e:
        raise unreadable(inventory, e) from None
    if not hosts:
        raise BadInput(f"{inventory}: no hosts in the inventory (fix: list hosts in it, as in inventories/lab.py)")


def run_pyinfra(inventory: str, deploy_file: Path, args: Sequence[str]) -> int:
    argv = [pyinfra_command(), inventory, str(deploy_file), *args]
    if not quiet():
        click.echo(f"gpufleet deploy: $ {' '.join(argv)}", err=True)
    # The terminal stays pyinfra's, so it can ask before changing anything.
    try:
        return subprocess.run(argv).returncode
    except KeyboardInterrupt:  # pyinfra got the Ctrl-C too
        return 130


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True})
@click.argument("inventory")
@click.option(
    "--only",
    type=click.Choice(ONLY),
    default=None,
    help="Only the vLLM hosts (deploys/qwen35.py) or only the routers inventory group (deploys/router.py).",
)
@click.argument("pyinfra_args", nargs=-1, type=click.UNPROCESSED, metavar="[PYINFRA OPTIONS]...")
def deploy(inventory: str, only: str | None, pyinfra_args: tuple[str, ...]) -> None:
    """Converge the fleet: run pyinfra with the deploy shipped in gpufleet (no checkout needed).

    First the vLLM hosts (as `pyinfra INVENTORY deploys/qwen35.py` from a checkout); then, when INVENTORY has a
    `routers` inventory group reached by --limit, the routers (deploys/router.py), in front of the replicas that verify
    ready. The router run is skipped when the first one fails. pyinfra's own options (--dry, --limit HOST, -y,
    --data key=value, ...) pass through to both runs; the exit status is pyinfra's (2 before it runs for an
    inventory file that is missing, does not load or lists no host). docs/cli.md.

    \b
    Examples:
        gpufleet deploy inventories/lab.py              # show the changes, ask, converge
        gpufleet deploy inventories/lab.py --dry        # show the changes and stop
        gpufleet deploy inventories/lab.py -y --limit gpu-box-2
    """
    args = list(pyinfra_args)
    takes_value = _options_taking_a_value()
    stray = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] not in takes_value)]
    if stray:
        raise click.UsageError(
            f"{stray[0]}: gpufleet deploy takes one INVENTORY and pyinfra's options; the deploy "
            "file is its own (fix: drop it, or give the option it is the value of)"
        )
    check_inventory(inventory)
    if verbose() and not any(arg.startswith("-v") and set(arg[1:]) == {"v"} for arg in args):
        args.insert(0, "-v")
    runs: list[str] = []
    if only in (None, "vllm"):
        runs.append("qwen35")
    if only == "router" or (only is None and routers_in_limit(router_hosts(inventory), limits(args))):
        runs.append("router")
    rc = 0
    for i, name in enumerate(runs):
        rc = run_pyinfra(inventory, packaged_deploy_file(name), args)
        if rc != 0:
            if i + 1 < len(runs):
                click.echo(
                    f"gpufleet deploy: the {ROUTERS_GROUP} inventory group was not deployed: the vLLM hosts' run "
                    f"exited {rc} (fix: see above, then run it again)",
                    err=True,
                )
            break
    sys.exit(rc)


def _options_taking_a_value() -> frozenset[str]:
    """pyinfra's options that take a value, read from its CLI so a new one is known too."""
    from pyinfra_cli.main import cli as pyinfra_cli

    return frozenset(
        name
        for p in pyinfra_cli.params
        if isinstance(p, click.Option) and not p.is_flag and not p.count
        for name in p.opts
    )
