"""What `gpufleet status` and `gpufleet verify` report: each row's problems with their fixes, as text or JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from rich.console import Console

from gpufleet.cli.envelope import Problem, document, emit, exit_status, row
from gpufleet.cli.health_tables import prefix_match_unit
from gpufleet.health import HealthState
from gpufleet.health.runner import HostResult
from gpufleet.router.check import RouterVerdict
from gpufleet.wire.geometry import resolved_block_sizes
from gpufleet.wire.gpu_verdicts import Verdict


# --- problems -------------------------------------------------------------------------------------------------------
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
    """Every reason the host's row is not ok, each with its fix."""
    name, service, h = r.target.name, r.target.expected.service, r.health
    found = []
    if not h.ready:
        found.append(
            Problem.from_line(
                str(h.state), f"{h.state}: {h.detail}", name, _state_fix(h.state, name, service, inventory)
            )
        )
    if r.committed_drift:
        found.append(
            Problem(
                "not-committed",
                r.committed_drift,
                f"`gpufleet deploy {inventory} --limit {name}` settles it (a swap left pending is "
                "finished or rolled back, a container not the unit's restarted); `gpufleet history "
                f"{inventory} --host {name}` shows the ledger",
            )
        )
    rollback = f"if a new image broke it, `gpufleet rollback {inventory} --host {name}`"
    again = (
        f"run it again (`gpufleet verify {inventory} --host {name}`); if its requests keep getting no answer, "
        f"read `journalctl -u {service}` on {name}"
    )
    # A check that could not run has its own id, so nothing acts on it as on a failed one.
    found += [
        Problem("answer", f"answer check {a.line()}", f"read `journalctl -u {service}` on {name}; {rollback}")
        if a.ran
        else Problem("check-not-run", f"answer check {a.line()}", again)
        for a in r.answers
        if not a.ok
    ]
    found += [
        Problem(
            "serving-check",
            f"serving check {c.line()}",
            f"{rollback}; if the settings did, see docs/verify.md for what {c.name} needs",
        )
        if c.ran
        else Problem("check-not-run", f"serving check {c.line()}", again)
        for c in r.checks
        if not c.ok
    ]
    found += [
        Problem("gpu", g.line(), f"{g.action}; docs/gpu-health.md says how a verdict clears") for g in r.sick_gpus
    ]
    if r.probe_error:
        found.append(
            Problem(
                "probe-error",
                f"probe failed: {r.probe_error}",
                f"run it again (`gpufleet verify {inventory} --host {name} --probe`); if it fails "
                f"again, read `journalctl -u {service}` on {name}",
            )
        )
    p = r.probe
    if p is not None and not p.ok:
        fixes = p.fixes or (p.legal.lines() if p.legal else ())
        found.append(
            Problem(
                "probe",
                f"probe {p.verdict}: {p.detail}",
                "; ".join(fixes) or "see docs/verify.md (prefix-cache) for what the probe needs",
            )
        )
    return found


def gpu_warnings(r: HostResult) -> list[str]:
    """What the GPUs say that does not fail the host."""
    gpus = r.gpus
    if gpus is None:
        return []
    if gpus.error is not None:
        return [f"GPU health not read: {gpus.error}"]
    sick = r.sick_gpus
    return [
        f"{g.line()} ({'the service does not use it; ' if g not in gpus.concern(r.target.gpus) else ''}{g.action})"
        for g in gpus.gpus
        if g.verdict is not Verdict.OK and g not in sick
    ]


# Ids of gpufleet.router.check's problem lines, by what they say.
_ROUTER_PROBLEM_IDS = (
    ("cannot SSH to the router host", "ssh-unreachable"),
    ("the router does not answer", "router-down"),
    ("the client port does not answer", "front-door"),
    ("is not in the router's worker set", "worker-missing"),
    ("is not healthy in the router", "worker-unhealthy"),
    ("is not a replica of the inventory", "worker-unknown"),
    ("worker API is open to every local user", "worker-api-open"),
)


def router_problems(verdict: RouterVerdict) -> list[Problem]:
    name = verdict.status.name
    return [
        Problem.from_line(
            next((id for words, id in _ROUTER_PROBLEM_IDS if words in line), "router-not-ready"),
            line,
            name,
            f"`gpufleet status` and the router's journal on {name}",
        )
        for line in verdict.problems
    ]


# --- the JSON document and the text lines ---------------------------------------------------------------------------
def _host_row(r: HostResult, found: list[Problem]) -> dict[str, Any]:
    fields = {k: v for k, v in r.health.as_dict().items() if k != "host"} | {
        "gpus": list(r.target.gpus),
        "block_sizes": resolved_block_sizes(r.health.cache_config),
        # null: none set, or unknown
        "prefix_match_unit": prefix_match_unit(r.health.cache_config),
        "cache_config": dict(r.health.cache_config),
        "committed": r.committed_ref,  # the ledger's
    }
    if r.probe is not None:
        fields["probe"] = r.probe.as_dict()
    if r.probe_error:
        fields["probe_error"] = r.probe_error
    if r.answers:
        fields["answers"] = [a.as_dict() for a in r.answers]
    if r.checks:
        fields["checks"] = [c.as_dict() for c in r.checks]
    if r.target.rank is not None:
        fields["group"] = {"name": r.target.rank[0], "rank": r.target.rank[1], "head": r.target.rank[2]}
    if r.speed is not None:
        fields["speed"] = {"now": r.speed.as_dict(), "recorded": r.speed_earlier.as_dict() if r.speed_earlier else None}
    fields["gpu"] = r.gpus.as_dict(r.target.gpus) if r.gpus is not None else None
    return row(r.target.name, found, **fields)


def _router_row(verdict: RouterVerdict) -> dict[str, Any]:
    fields = {k: v for k, v in verdict.status.as_dict().items() if k != "name"}
    fields["front_door"] = fields["front_door"] or None
    return row(verdict.status.name, router_problems(verdict), **fields)


def report(
    command: str,
    inventory: str,
    results: list[HostResult],
    verdicts: list[RouterVerdict],
    as_json: bool,
    console: Console,
    tables: Callable[[Console], None],
) -> int:
    """Print the result; returns the exit status."""
    found = {r.target.name: host_problems(r, inventory) for r in results}
    doc = document(command, [_host_row(r, found[r.target.name]) for r in results], [_router_row(v) for v in verdicts])
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


def _say(console: Console, text: str) -> None:
    # From the hosts: plain text, never markup, a line each however long.
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _explain(console: Console, r: HostResult, found: list[Problem]) -> None:
    """The host's problem lines, the container's last log lines, and the probe's evidence."""
    name = r.target.name

    def say(text: str) -> None:
        _say(console, text)

    for problem in found:
        if problem.id == "probe":
            continue
        say(problem.line(name))
        if problem.id == str(r.health.state):
            for line in r.health.logs:
                say(f"  | {line}")
    for line in gpu_warnings(r):
        say(f"{name}: warning: {line}")
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
