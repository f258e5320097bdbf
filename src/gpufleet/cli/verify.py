"""`gpufleet status` and `gpufleet verify`: render gpufleet.health results for an inventory's hosts."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpufleet.cli.envelope import BadInput, Problem, document, emit, exit_status, load_inventory, row
from gpufleet.cli.logs import quiet_ssh_logs, stderr
from gpufleet.cli.progress import FleetProgress
from gpufleet.errors import GpufleetError
from gpufleet.health import HealthState
from gpufleet.health.check import spec_drift
from gpufleet.health.fleet import HostResult, HostTarget, check_fleet
from gpufleet.health.probe_report import ProbeReport
from gpufleet.inventory import HostData, load_host_specs
from gpufleet.router.check import RouterExpected, RouterVerdict, problems, verify_router
from gpufleet.router.settings import build_router_spec, replicas
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
    except GpufleetError as e:  # an invalid setting: bad input, before any host is reached
        raise BadInput(str(e)) from None
    quiet_ssh_logs()
    return check_fleet(targets, **kwargs)


def _console() -> Console:
    # Piped output (CI logs, `| less`) gets a wide table rather than rich's 80-column default.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def cache_units(cache_config: dict[str, str]) -> tuple[str, str]:
    """(block size(s), prefix-match unit) as the server resolved them, for the table: what a --prefix-match-unit
    must divide, and what hits align to ("=block" when no unit is set: hits then land on whole blocks)."""
    blocks = resolved_block_sizes(cache_config)
    unit = _unit(cache_config)
    return "/".join(map(str, blocks)) or "-", str(unit) if unit else ("=block" if blocks else "-")


def _unit(cache_config: dict[str, str]) -> int | None:
    unit = cache_config.get("prefix_match_unit")
    return int(unit) if unit and unit.isdigit() else None


def _table(results: list[HostResult], title: str) -> Table:
    table = Table(title=title, header_style="bold")
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


# --- problems: what each row of status and verify finds wrong, with the fix ------------------------------------------
def _state_fix(state: HealthState, name: str, service: str, inventory: str) -> str:
    journal = f"read `journalctl -u {service}` on {name}"
    return {
        HealthState.SSH_UNREACHABLE: f"check that {name} is up and that its ssh_* data in {inventory} reach it",
        HealthState.CONTAINER_NOT_RUNNING: f"{journal}; `gpufleet deploy {inventory} --limit {name}` starts it",
        HealthState.STARTING: f"wait for it (`gpufleet verify {inventory} --host {name} --wait 900`); if it stays "
                              f"starting, {journal}",
        HealthState.DEAD: f"{journal}; if a new image broke it, `gpufleet rollback {inventory} --host {name}`",
        HealthState.MISCONFIGURED: f"`gpufleet deploy {inventory} --limit {name}` converges it to the inventory; if "
                                   "it still differs, the detail names what",
    }.get(state, journal)


def host_problems(r: HostResult, inventory: str) -> list[Problem]:
    """Every reason the host's row is not ok, each with its fix (the text lines and --json's problems)."""
    name, service, h = r.target.name, r.target.expected.service, r.health
    found = []
    if not h.ready:
        found.append(Problem.from_line(str(h.state), f"{h.state}: {h.detail}", name,
                                       _state_fix(h.state, name, service, inventory)))
    rollback = f"if a new image broke it, `gpufleet rollback {inventory} --host {name}`"
    found += [Problem("answer", f"answer check {a.line()}", f"read `journalctl -u {service}` on {name}; {rollback}")
              for a in r.answers if not a.ok]
    found += [Problem("serving-check", f"serving check {c.line()}",
                      f"{rollback}; if the settings did, see docs/verify.md for what {c.name} needs")
              for c in r.checks if not c.ok]
    if r.probe_error:
        found.append(Problem("probe-error", f"probe failed: {r.probe_error}",
                             f"run it again (`gpufleet verify {inventory} --host {name} --probe`); if it fails "
                             f"again, read `journalctl -u {service}` on {name}"))
    p = r.probe
    if p is not None and not p.ok:
        fixes = p.fixes or (p.legal.lines() if p.legal else ())
        found.append(Problem("probe", f"probe {p.verdict}: {p.detail}",
                             "; ".join(fixes) or "see docs/verify.md (prefix-cache) for what the probe needs"))
    return found


# A router's problem lines come from gpufleet.router.check, each naming its fix; their ids, by what they say.
_ROUTER_PROBLEM_IDS = (
    ("cannot SSH to the router host", "ssh-unreachable"),
    ("the router does not answer", "router-down"),
    ("the client port does not answer", "front-door"),
    ("is not in the router's worker set", "worker-missing"),
    ("is not healthy in the router", "worker-unhealthy"),
    ("is not a replica of the inventory", "worker-unknown"),
)


def router_problems(verdict: RouterVerdict) -> list[Problem]:
    name = verdict.status.name
    return [Problem.from_line(next((id for words, id in _ROUTER_PROBLEM_IDS if words in line), "router-not-ready"),
                              line, name, f"`gpufleet status` and the router's journal on {name}")
            for line in verdict.problems]


# --- the one JSON document (docs/cli.md) -------------------------------------------------------------------------
def _host_row(r: HostResult, found: list[Problem]) -> dict[str, Any]:
    fields = {k: v for k, v in r.health.as_dict().items() if k != "host"} | {
        "gpus": list(r.target.gpus),
        "block_sizes": resolved_block_sizes(r.health.cache_config),
        "prefix_match_unit": _unit(r.health.cache_config),  # null: none set (hits land on whole blocks) or unknown
        "cache_config": dict(r.health.cache_config),
    }
    if r.probe is not None:
        fields["probe"] = r.probe.as_dict()
    if r.probe_error:
        fields["probe_error"] = r.probe_error
    if r.answers:
        fields["answers"] = [a.as_dict() for a in r.answers]
    if r.checks:
        fields["checks"] = [c.as_dict() for c in r.checks]
    return row(r.target.name, found, **fields)


def _router_row(verdict: RouterVerdict) -> dict[str, Any]:
    fields = {k: v for k, v in verdict.status.as_dict().items() if k != "name"}
    fields["front_door"] = fields["front_door"] or None  # "": not looked at
    return row(verdict.status.name, router_problems(verdict), **fields)


def _report(command: str, inventory: str, results: list[HostResult], verdicts: list[RouterVerdict],
            as_json: bool, console: Console, tables: Callable[[Console], None]) -> int:
    """Print the result (tables and problem lines, or the JSON document); the exit status."""
    found = {r.target.name: host_problems(r, inventory) for r in results}
    doc = document(command, [_host_row(r, found[r.target.name]) for r in results],
                   [_router_row(v) for v in verdicts])
    if as_json:
        emit(doc)
    else:
        tables(console)
        for r in results:
            _explain(console, r, found[r.target.name])
        for v in verdicts:
            for problem in router_problems(v):
                _say(console, problem.line(v.status.name))
    failed = [r["host"] for r in (*doc["hosts"], *doc["routers"]) if not r["ok"]]
    if failed:
        total = len(doc["hosts"]) + len(doc["routers"])
        verb = "failed on" if command == "verify" else "found problems on"
        click.echo(f"{command} {verb} {len(failed)} of {total} host(s): {', '.join(failed)}", err=True)
    return exit_status(doc)


_inventory_arg = click.argument("inventory", type=click.Path(dir_okay=False))
_host_opt = click.option("--host", "host", default=None, help="Only this inventory host.")
_json_opt = click.option("--json", "as_json", is_flag=True,
                         help='One JSON document on stdout: {"command", "ok", "hosts", "routers"} (docs/cli.md).')


@click.command()
@_inventory_arg
@_host_opt
@_json_opt
@click.pass_context
def status(ctx: click.Context, inventory: str, host: str | None, as_json: bool) -> None:
    """Show each host's serving state: image, vLLM version, model, KV cache use, load, prefix-cache hits; and each
    router's workers. Every problem is one line with its fix.

    \b
    Exit status: 0 every host and router ready, 1 problems found, 2 bad input (docs/cli.md).

    \b
    Example:
        gpufleet status inventories/lab.py
        gpufleet status inventories/lab.py --json | jq '.hosts[].state'
    """
    routers, found = _roles(inventory, host)
    expected = _router_expectations(inventory, routers, found)  # a bad setting stops status before any SSH
    results = _gather(inventory, host) if not (host and routers) else []
    verdicts = [RouterVerdict(look, problems(look, exp))
                for look, exp in zip((read_host(name, data) for name, data in routers), expected, strict=True)]

    def tables(console: Console) -> None:
        if results:
            console.print(_table(results, "gpufleet status"))
        if verdicts:
            console.print(_router_table([v.status for v in verdicts]))

    ctx.exit(_report("status", inventory, results, verdicts, as_json, _console(), tables))


def _roles(inventory: str, host: str | None) -> tuple[list[HostData], list[HostData]]:
    """(the routers `--host` selects, every replica) of the inventory; bad input when it cannot be read, is empty or
    has no such host."""
    routers, found = load_inventory(inventory, host)
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
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=0.0, show_default=True,
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
    deadline = time.monotonic() + wait_s  # routers get what is left of --wait after the hosts
    routers, found = _roles(inventory, host)
    expected = _router_expectations(inventory, routers, found)  # a bad setting stops verify before any SSH
    results: list[HostResult] = []
    verdicts: list[RouterVerdict] = []
    with FleetProgress(stderr()) as progress:
        if not (host and routers):
            progress.note(_what_verify_does(wait_s, run_probe, names))
            results = _gather(inventory, host, run_probe=run_probe, wait_s=wait_s, api_key=api_key, answer=True,
                              checks=names, progress=progress.phase)
        for (name, data), exp in zip(routers, expected, strict=True):
            progress.phase(name, "reading the router" + (" (waiting for it to pass)" if wait_s else ""))
            verdicts.append(verify_router(partial(read_host, name, data), exp, deadline))
            progress.phase(name, "ok" if verdicts[-1].ok else "not ok")

    def tables(console: Console) -> None:
        if results:
            console.print(_table(results, "gpufleet verify"))
        if any(r.checks for r in results):
            console.print(_checks_table(results, names))
        if any(r.probe is not None for r in results):
            console.print(_probe_table(results))
        if verdicts:
            console.print(_router_table([v.status for v in verdicts]))

    ctx.exit(_report("verify", inventory, results, verdicts, as_json, _console(), tables))


def _what_verify_does(wait_s: float, run_probe: bool, checks: Sequence[str]) -> str:
    steps = [f"waiting up to {wait_s:.0f} s for each host to be ready" if wait_s else "one look at each host",
             "a chat completion, plain and streamed"]
    if checks:
        steps.append(f"serving checks {', '.join(checks)}")
    if run_probe:
        steps.append("the prompt re-processing probe (up to a few minutes a host)")
    return "verify: " + "; ".join(steps)


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
        raise BadInput(str(e)) from None
    refused = []
    for name, data in routers:  # the router's settings, as its deploy and lint check them
        try:
            build_router_spec(name, data, [replica.url for replica in workers])
        except GpufleetError as e:
            refused.append(str(e))
    if refused:
        raise BadInput("\n".join(refused))
    return [RouterExpected.for_router(data, workers, inventory) for _, data in routers]


def _say(console: Console, text: str) -> None:
    # Hosts' details, logs and fixes come from the hosts: plain text (never markup), a line each however long.
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _explain(console: Console, r: HostResult, found: list[Problem]) -> None:
    """The host's problem lines (each with its fix), the container's last log lines, and the probe's evidence."""
    name = r.target.name

    def say(text: str) -> None:
        _say(console, text)

    for problem in found:
        if problem.id == "probe":
            continue  # said below, with its evidence
        say(problem.line(name))
        if problem.id == str(r.health.state):
            for line in r.health.logs:
                say(f"  | {line}")
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
        (problem,) = [f for f in found if f.id == "probe"]
        for fix in p.fixes or (problem.fix,):
            say(f"  fix: {fix}")
