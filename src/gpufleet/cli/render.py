"""`gpufleet render` and `gpufleet lint`: offline views of what each host will run."""

from __future__ import annotations

import click

from gpufleet.errors import GpufleetError
from gpufleet.inventory import load_host_specs, load_specs
from gpufleet.lint import lint_spec
from gpufleet.quoting import shell_line
from gpufleet.settings import merged_settings
from gpufleet.unit import render_unit


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--host", "host_name", metavar="NAME", help="Only this host.")
@click.option("--unit", is_flag=True, help="Print the systemd unit instead of the docker run command.")
def render(inventory: str, host_name: str | None, unit: bool) -> None:
    """Print each host's `docker run` command (or systemd unit) without connecting to it.

    \b
    Example:
        gpufleet render inventories/lab.py --host gpu-box-1
    """
    try:
        specs = load_specs(inventory, host_name)
    except GpufleetError as exc:
        raise click.ClickException(str(exc)) from None
    for spec in specs:
        click.echo(f"# host: {spec.host}")
        click.echo(render_unit(spec) if unit else shell_line(spec.docker_run_argv()), nl=not unit)


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
def lint(inventory: str) -> None:
    """Warn about known vLLM traps in each host's settings, with the fix.

    Exit status: 0 with warnings only, 1 when a setting is invalid.
    """
    try:
        specs = load_host_specs(inventory)
    except GpufleetError as exc:
        raise click.ClickException(str(exc)) from None
    findings = [finding for spec, data in specs for finding in lint_spec(spec, merged_settings(data))]
    for finding in findings:
        click.echo(str(finding))
    click.echo(f"{len(specs)} host(s), {len(findings)} warning(s)", err=True)
