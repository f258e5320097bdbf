"""`gpufleet render` and `gpufleet lint`: offline views of what each host will run (lint: vLLM hosts and routers)."""

from __future__ import annotations

import sys
from typing import Any

import click

from gpufleet.cli.envelope import BadInput, Problem, emit, load_inventory, row
from gpufleet.cli.logs import quiet
from gpufleet.defaults import DEFAULTS
from gpufleet.errors import GpufleetError, SettingError, SettingErrors
from gpufleet.inventory import load_roles_and_groups
from gpufleet.quoting import shell_line
from gpufleet.router.settings import RouterSettings, resolve_router
from gpufleet.router.settings import replicas as replica_addresses
from gpufleet.vllm.group_specs import resolve_hosts
from gpufleet.vllm.host_specs import load_specs
from gpufleet.vllm.lint import ACCEPT_SETTING, SEVERITIES, accepted_rule_ids, lint_router, lint_spec
from gpufleet.vllm.lint_report import LintReport, fleet_report, invalid_settings_report
from gpufleet.vllm.unit import render_unit


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--host", "host_name", metavar="NAME", help="Only this host.")
@click.option("--unit", is_flag=True, help="Print the systemd unit instead of the docker run command.")
def render(inventory: str, host_name: str | None, unit: bool) -> None:
    """Print each host's `docker run` command (or systemd unit) without connecting to it.

    \b
    Exit status: 0, or 2 when the inventory cannot be read or a setting is invalid (one line each).

    \b
    Example:
        gpufleet render inventories/lab.py --host gpu-box-1
    """
    load_inventory(inventory, host_name)
    try:
        specs = load_specs(inventory, host_name)
    except GpufleetError as exc:
        raise BadInput(str(exc)) from None
    for spec in specs:
        click.echo(f"# host: {spec.host}")
        click.echo(render_unit(spec) if unit else shell_line(spec.docker_run_argv()), nl=not unit)


_SEVERITY_COLOUR = {"error": "red", "warning": "yellow", "info": "cyan"}


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON document on stdout: command, ok, findings, accepted, and hosts and routers rows.",
)
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too (for CI).")
def lint(inventory: str, as_json: bool, strict: bool) -> None:
    """Find known traps in each host's settings (vLLM hosts and routers), with the fix.

    A finding that fires alike on several hosts is one line naming them. A host accepts a finding on purpose with
    gpufleet_accept = ["rule-id", ...] in its data (say why in a comment): it is listed as accepted and does not
    count. Severities: error (vLLM or the deploy refuses it, or it breaks at runtime), warning (it runs but loses
    something: answers, prefix-cache hits, isolation), info (advice).

    \b
    Exit status: 0  no errors (warnings and info allowed; --strict: no warnings either)
                 1  errors found (invalid settings included)
                 2  the inventory cannot be read

    \b
    Example:
        gpufleet lint inventories/lab.py --strict
    """
    routers, vllm_hosts = load_inventory(inventory)
    hosts, router_names = [name for name, _ in vllm_hosts], [name for name, _ in routers]
    orders = load_roles_and_groups(inventory)[2]
    resolved, errors = resolve_hosts(vllm_hosts, orders, behind_router=bool(routers))
    specs = [resolved[name] for name in hosts if name in resolved]
    accepted: dict[str, frozenset[str]] = {}
    for name, data in vllm_hosts:
        errors += _read_accept(name, data, accepted)
    # As the router's deploy checks it.
    if routers:
        try:
            replica_addresses(vllm_hosts, orders)
        except SettingErrors as exc:
            errors += exc.errors
    router_settings: dict[str, RouterSettings] = {}
    for name, data in routers:
        try:
            router_settings[name] = resolve_router(name, data)
        except SettingErrors as exc:
            errors += exc.errors
        errors += _read_accept(name, data, accepted)

    if errors:  # the rules need valid settings on every host
        report = invalid_settings_report(errors, hosts, router_names)
        if not as_json:
            raise click.ClickException("\n".join(report.line(finding) for finding in report.findings))
    else:
        findings = [f for spec, settings in specs for f in lint_spec(spec, settings)]
        findings += [
            f
            for name, settings in router_settings.items()
            for f in lint_router(name, policy=settings.policy, replicas=len(vllm_hosts))
        ]
        report = fleet_report(findings, accepted, hosts, router_names)
    if as_json:
        emit(json_document(report, strict))
    else:
        _print_report(report)
    sys.exit(report.exit_code(strict))


def json_document(report: LintReport, strict: bool) -> dict[str, Any]:
    """lint's document in the other commands' envelope: a row per host and router (docs/lint.md)."""
    failing = ("error", "warning") if strict else ("error",)

    def host_row(name: str) -> dict[str, Any]:
        return row(
            name,
            [Problem(f.id, f.message, f.fix) for f in report.findings if name in f.hosts and f.severity in failing],
        )

    return {
        "command": "lint",
        **report.as_json(strict),
        "error": None,
        "hosts": [host_row(h) for h in report.hosts],
        "routers": [host_row(r) for r in report.routers],
    }


def _read_accept(host: str, data: dict[str, Any], accepted: dict[str, frozenset[str]]) -> list[SettingError]:
    try:
        accepted[host] = accepted_rule_ids(host, data.get(ACCEPT_SETTING, DEFAULTS[ACCEPT_SETTING]))
    except SettingError as error:
        return [error]
    return []


def _print_report(report: LintReport) -> None:
    for finding in report.findings:
        line = report.line(finding)
        # Only the severity word is coloured, so the text is a pipe's.
        word = f": {finding.severity} ["
        head, _, tail = line.partition(word)
        coloured = click.style(finding.severity, fg=_SEVERITY_COLOUR[finding.severity], bold=True)
        click.echo(f"{head}: {coloured} [{tail}" if tail else line)
    for finding in report.accepted:
        click.echo(click.style(report.line(finding, accepted=True), dim=True))
    counts = ", ".join(
        f"{report.count(severity)} {severity}" + ("" if severity == "info" else "(s)") for severity in SEVERITIES
    )
    routers = f", {len(report.routers)} router(s)" if report.routers else ""
    if not quiet():
        click.echo(f"{len(report.hosts)} host(s){routers}: {counts}, {len(report.accepted)} accepted", err=True)
