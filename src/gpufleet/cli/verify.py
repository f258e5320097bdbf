"""`gpufleet status` and `gpufleet verify`: render gpufleet.health results for an inventory's hosts."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpufleet.cli.logs import quiet_ssh_logs
from gpufleet.errors import GpufleetError
from gpufleet.health import HealthState
from gpufleet.health.check import spec_drift
from gpufleet.health.fleet import HostResult, HostTarget, check_fleet
from gpufleet.health.probe import ProbeReport
from gpufleet.inventory import HostData, load_host_specs, load_roles
from gpufleet.router.check import RouterExpected, RouterVerdict, verify_router
from gpufleet.router.settings import replicas
from gpufleet.router.status import RouterStatus, read_host
from gpufleet.wire.checks import SERVING_CHECKS, parse_checks
from gpufleet.wire.geometry import resolved_block_sizes

_STATE_STYLE = {
    HealthState.READY: "green",
    HealthState.STARTING: "yellow",
    HealthState.MISCONFIGURED: "magenta",
}


def load_targets(inventory: str, only_host: str | None = None) -> list[HostTarget]:
    """Inventory -> what to check on each vLLM host (routers have rows of their own). Raises GpufleetError (one
    line per problem)."""
    return [HostTarget.for_spec(spec, data) for spec, data in load_host_specs(inventory, only_host)]


def _gather(inventory: str, host: str | None, **kwargs: Any) -> list[HostResult]:
    try:
        targets = load_targets(inventory, host)
    except GpufleetError as e:
        raise click.ClickException(str(e)) from None
    if not targets:
        raise click.ClickException(f"{inventory}: no hosts in the inventory")
    quiet_ssh_logs()
    return check_fleet(targets, **kwargs)



def _console() -> Console:
    # Piped output (CI logs, `| less`) gets a wide table rather than rich's 80-column default.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def cache_units(cache_config: dict[str, str]) -> tuple[str, str]:
    """(block size(s), prefix-match unit) as the server resolved them: what a --prefix-match-unit must divide,
    and what hits align to ("=block" when no unit is set: hits then land on whole blocks)."""
    blocks = resolved_block_sizes(cache_config)
    unit = cache_config.get("prefix_match_unit")
    return "/".join(map(str, blocks)) or "-", unit if unit and unit.isdigit() else ("=block" if blocks else "-")


def _table(results: list[HostResult]) -> Table:
    table = Table(title="gpufleet status", header_style="bold")
    columns = ("host", "GPUs", "image", "spec", "vLLM", "state", "model", "KV cache", "run/wait", "prefix hits",
               "block", "unit")
    for col in columns:
        table.add_column(col)
    for r in results:
        h, c = r.health, r.health.container
        style = _STATE_STYLE.get(h.state, "red")
        table.add_row(*_plain(
            r.target.name,
            ",".join(map(str, r.target.gpus)) or "-",
            (c.image_short if c else None) or "-",
            _spec_cell(r),
            h.version or "-",
            Text(str(h.state), style=style),
            h.served_model or "-",
            _pct(h.kv_cache_usage),
            "-" if h.running is None else f"{h.running}/{h.waiting}",
            _pct(h.prefix_cache_hit_rate),
            *cache_units(h.cache_config),
        ))
    return table


def _spec_cell(r: HostResult) -> Text:
    """The running container's spec hash (12 digits), red and marked when it is not the inventory's: drift."""
    c = r.health.container
    if c is None or not c.running:
        return Text("-")
    short = (c.spec_hash or "unlabelled")[:12]
    if spec_drift(r.target.expected, c):
        return Text(f"{short} (drift)", style="red")
    return Text(short)


def _probe_table(results: list[HostResult]) -> Table:
    """One row per probed host: verdict, tokens re-processed per session turn, hit ratio per length, fixes."""
    table = Table(title="prompt re-processing probe", header_style="bold", show_lines=True)
    for col in ("host", "verdict", "re-processed / turn (share)", "hit ratio by prompt length", "legal fixes", "requests"):
        table.add_column(col)
    for r in results:
        p = r.probe
        if p is None:
            continue
        table.add_row(*_plain(
            r.target.name,
            Text(str(p.verdict), style="green" if p.ok else "red"),
            _session_cell(p),
            "\n".join(f"{pt.prompt_tokens}{_kind_mark(pt.kind)}: {pt.hit_ratio:.0%}" for pt in p.points if pt.kind != "session")
            or "-",
            "\n".join(p.fixes or (p.legal.lines() if p.legal and not p.ok else ())) or "-",
            f"{p.requests}/{p.request_bound} in {p.elapsed_s:.0f} s",
        ))
    return table


def _plain(*cells: str | Text) -> list[Text]:
    """Cells as plain text: model ids, versions and labels come from the servers, and rich would read "[/x]" in
    them as markup (and raise, taking the whole table down)."""
    return [cell if isinstance(cell, Text) else Text(cell) for cell in cells]


def _kind_mark(kind: str) -> str:
    return " (multi-chunk)" if kind == "multi-chunk" else ""


def _session_cell(p: ProbeReport) -> str:
    later = p.session[1:]
    if not later:
        return f"{p.reprocessed_per_turn:.0f} (median of points)"
    return "\n".join(f"N+{t.turn}: {t.reprocessed_tokens} of {t.prompt_tokens} ({t.reprocessed_share:.0%})" for t in later)


def _as_json(results: list[HostResult], routers: list[RouterStatus] | None = None,
             verdicts: list[RouterVerdict] | None = None) -> str:
    out = []
    for r in results:
        block, unit = cache_units(r.health.cache_config)
        item = r.health.as_dict() | {
            "host": r.target.name,
            "gpus": list(r.target.gpus),
            "block_size": block,
            "prefix_match_unit": unit,
            "cache_config": dict(r.health.cache_config),
        }
        if r.probe is not None:
            item["probe"] = r.probe.as_dict()
        if r.probe_error:
            item["probe_error"] = r.probe_error
        if r.answers:
            item["answers"] = [a.as_dict() for a in r.answers]
        if r.checks:
            item["checks"] = [c.as_dict() for c in r.checks]
        out.append(item)
    # Router hosts are items of the same list, marked by "role": a list consumer keeps working.
    out += [{"host": r.name, "role": "router"} | r.as_dict() for r in routers or []]
    out += [v.as_dict() for v in verdicts or []]  # verify's rows: the same, with ok and the problems
    return json.dumps(out, indent=2)


_inventory_arg = click.argument("inventory", type=click.Path(dir_okay=False))
_host_opt = click.option("--host", "host", default=None, help="Only this inventory host.")
_json_opt = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.command()
@_inventory_arg
@_host_opt
@_json_opt
def status(inventory: str, host: str | None, as_json: bool) -> None:
    """Show each host's serving state: image, vLLM version, model, KV cache use, load, prefix-cache hits.

    \b
    Example:
        gpufleet status inventories/lab.py
        gpufleet status inventories/lab.py --json | jq '.[].state'
    """
    routers, _ = _roles(inventory, host)
    results = _gather(inventory, host) if not (host and routers) else []
    router_rows = [read_host(name, data) for name, data in routers]
    if as_json:
        click.echo(_as_json(results, router_rows))
    else:
        if results:
            _console().print(_table(results))
        if router_rows:
            _console().print(_router_table(router_rows))


def _roles(inventory: str, host: str | None) -> tuple[list[HostData], list[HostData]]:
    """(the routers `--host` selects, every replica) of the inventory."""
    try:
        routers, found = load_roles(inventory)
    except GpufleetError as e:
        raise click.ClickException(str(e)) from None
    return [(name, data) for name, data in routers if host in (None, name)], found


def _router_table(rows: list[RouterStatus]) -> Table:
    table = Table(title="routers", header_style="bold")
    for col in ("router", "policy", "state", "worker", "healthy", "routed", "in flight", "requests", "prefix routing"):
        table.add_column(col)
    for r in rows:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r.prefix_outcomes.items())) or "-"
        head = (r.name, r.policy or "-", Text(r.state, style="green" if r.state == "ready" else "red"))
        if not r.workers:
            table.add_row(*_plain(*head, r.detail or "-", "-", "-", "-", str(r.requests or 0), outcomes))
        for i, w in enumerate(r.workers):
            first = i == 0
            table.add_row(*_plain(
                *(head if first else ("", "", "")), w.url,
                Text("yes", style="green") if w.healthy else Text("no", style="red"),
                str(w.routed), "-" if w.running is None else str(w.running),
                str(r.requests or 0) if first else "", outcomes if first else "",
            ))
    return table


@click.command()
@_inventory_arg
@_host_opt
@_json_opt
@click.option("--probe", "run_probe", is_flag=True, help="Also measure prompt re-processing on turn N+1.")
@click.option("--checks", "checks", default="none", show_default=True, metavar="LIST",
              help=f"Serving checks to run on each ready host, where its settings apply: a comma list of "
                   f"{', '.join(SERVING_CHECKS)}, or all (docs/verify.md).")
@click.option("--wait", "wait_s", type=float, default=0.0, show_default=True,
              help="Seconds to wait for hosts and routers to become ready.")  # fmt: skip
# No envvar: a VLLM_API_KEY in the caller's environment (set for a client) silently overrode every host's own key.
@click.option("--api-key", default=None,
              help="For servers run with --api-key; overrides every host's vllm_api_key (default: each host's own).")  # fmt: skip
@click.pass_context
def verify(
    ctx: click.Context, inventory: str, host: str | None, as_json: bool, run_probe: bool, checks: str,
    wait_s: float, api_key: str | None,
) -> None:  # fmt: skip
    """Exit non-zero unless every host is ready and answers a chat completion, plain and streamed (and, with
    --probe, reuses its prefix cache), and every router answers and routes to every replica of the inventory,
    healthy, and to nothing else.

    \b
    Example:
        gpufleet verify inventories/lab.py --probe
        gpufleet verify inventories/lab.py --checks cached-cold,tools
    """
    try:
        names = parse_checks(checks)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--checks") from None
    deadline = time.monotonic() + wait_s  # routers get what is left of --wait after the hosts
    routers, found = _roles(inventory, host)
    expected = _router_expectations(inventory, routers, found)  # a bad setting stops verify before any SSH
    results = [] if host and routers else _gather(inventory, host, run_probe=run_probe, wait_s=wait_s, api_key=api_key,
                                                  answer=True, checks=names)
    verdicts = [verify_router(partial(read_host, name, data), exp, deadline) for (name, data), exp in
                zip(routers, expected, strict=True)]
    if as_json:
        click.echo(_as_json(results, verdicts=verdicts))
    else:
        console = _console()
        if results:
            console.print(_table(results))
        if any(r.checks for r in results):
            console.print(_checks_table(results, names))
        if any(r.probe is not None for r in results):
            console.print(_probe_table(results))
        if verdicts:
            console.print(_router_table([v.status for v in verdicts]))
        for r in results:
            _explain(console, r)
        for line in (line for v in verdicts for line in v.problems):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    failed = [r.target.name for r in results if not r.ok] + [v.status.name for v in verdicts if not v.ok]
    if failed:
        total = len(results) + len(verdicts)
        click.echo(f"verify failed on {len(failed)} of {total} host(s): {', '.join(failed)}", err=True)
        ctx.exit(1)


def _checks_table(results: list[HostResult], names: Sequence[str]) -> Table:
    """One row per host, one column per serving check: passed, failed, or "-" where the host's settings give the
    check nothing to check (no tool parser, no reasoning parser) or it was not reached."""
    table = Table(title="serving checks", header_style="bold")
    table.add_column("host")
    for name in names:
        table.add_column(name)
    for r in results:
        got = {c.name: c.ok for c in r.checks}
        cells = [Text("-") if name not in got else Text("passed", style="green") if got[name]
                 else Text("FAILED", style="red") for name in names]
        table.add_row(Text(r.target.name), *cells)
    return table


def _router_expectations(inventory: str, routers: list[HostData], found: list[HostData]) -> list[RouterExpected]:
    """What each router should route to: every replica of the inventory, at the URL the router deploy gives it."""
    if not routers:
        return []  # a fleet without a router may keep vLLM on loopback: no worker addresses to check then
    try:
        workers = replicas(found)
    except GpufleetError as e:
        raise click.ClickException(str(e)) from None
    return [RouterExpected.for_router(data, workers, inventory) for _, data in routers]


def _explain(console: Console, r: HostResult) -> None:
    # Hosts' details, logs and fixes come from the hosts: plain text (never markup), a line each however long.
    def say(text: str) -> None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    name = r.target.name
    if not r.health.ready:
        say(f"{name}: {r.health.state}: {r.health.detail}")
        for line in r.health.logs:
            say(f"  | {line}")
    for a in r.answers:
        if not a.ok:
            say(f"{name}: answer check {a.line()} (fix: read `journalctl -u {r.target.expected.service}` on the host; "
                f"if a new image broke it, `gpufleet rollback INVENTORY --host {name}`)")
    for c in r.checks:
        if not c.ok:
            say(f"{name}: serving check {c.line()} (fix: if a new image broke it, `gpufleet rollback INVENTORY "
                f"--host {name}`; if the settings did, see docs/verify.md for what {c.name} needs)")
    if r.probe_error:
        say(f"{name}: probe failed: {r.probe_error}")
    p = r.probe
    if p is None:
        return
    say(
        f"{name}: probe {p.verdict}: {p.detail}; hit ratio {p.hit_ratio:.0%}, "
        f"{p.reprocessed_per_turn:.0f} tokens re-processed per turn, TTFT ratio {p.ttft_ratio:.2f}"
        + ("" if p.ttft_is_signal else " (TTFT too small to be a signal here)")
        + f"; {p.requests} requests (at most {p.request_bound}) in {p.elapsed_s:.0f} s",
    )
    for warning in p.warnings:
        say(f"  note: {warning}")
    if not p.ok:
        for line in p.evidence:
            say(f"  {line}")
        mnbt = p.max_num_batched_tokens
        if p.fixes:
            say(f"  server --max-num-batched-tokens: {mnbt or 'default (not set)'}")
            for fix in p.fixes:
                say(f"  fix: {fix}")
