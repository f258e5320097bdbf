"""`gpufleet rollout`, `gpufleet history`, `gpufleet rollback`: thin click commands over gpufleet.rollout."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpufleet.cli.envelope import BadInput, Problem, document, emit, exit_status, load_inventory, row, stopped
from gpufleet.cli.logs import quiet, quiet_ssh_logs, stderr
from gpufleet.errors import GpufleetError
from gpufleet.hoststate.ledger import Ledger
from gpufleet.rollout.commands import Result, history, roll_back, roll_out
from gpufleet.rollout.deploy_run import default_deploy_file
from gpufleet.rollout.hosts import load_fleet
from gpufleet.rollout.ledgers import HostLedger
from gpufleet.rollout.progress import Progress
from gpufleet.rollout.report import short, table
from gpufleet.rollout.swap import STAGE_TIMEOUT_S, SwapOptions
from gpufleet.rollout.target import requested_image
from gpufleet.wire.checks import SERVING_CHECKS
from gpufleet.wire.speed import SpeedFigures


def _console() -> Console:
    return Console() if sys.stdout.isatty() else Console(width=160)


def _options(deploy: str | None, log: Path, **kwargs: Any) -> SwapOptions:
    return SwapOptions(deploy_file=Path(deploy) if deploy else default_deploy_file(), log=log, **kwargs)


def _new_log() -> Path:
    """A new 0600 log file under a name no other user can take first: it collects root's deploy output."""
    fd, path = tempfile.mkstemp(prefix=f"gpufleet-rollout-{time.strftime('%Y%m%dT%H%M%S')}-", suffix=".log")
    os.close(fd)
    return Path(path)


@contextmanager
def _log_file(given: str | None) -> Iterator[Path]:
    """The deploy output's file: the --log path, else a new one that is removed again if no deploy wrote to it."""
    if given is not None:
        yield Path(given)
        return
    log = _new_log()
    try:
        yield log
    finally:
        if log.exists() and not log.stat().st_size:
            log.unlink()


def _confirm(yes: bool) -> Any:
    def ask(what: str, hosts: Sequence[str]) -> bool:
        if yes:
            return True
        return click.confirm(f"Swap {len(hosts)} host(s) ({', '.join(hosts)}) to {what}?", err=True)

    return ask


def _checked(inventory: str, host: str | None = None, image: str | None = None) -> None:
    """Bad input (exit status 2) before any host is reached: the inventory, its settings, --image."""
    load_inventory(inventory, host)
    try:
        requested_image(load_fleet(inventory, host), image)
    except GpufleetError as e:
        raise BadInput(str(e)) from None


def _progress(hosts: Sequence[str]) -> Progress:
    return Progress(hosts, stderr())


def _finish(command: str, result: Result, as_json: bool, log: Path | None) -> None:
    doc = document(
        command, [o.as_dict() for o in result.outcomes], [], target=result.target, message=result.message or None
    )
    err = Console(stderr=True)
    if result.message and (not quiet() or not doc["ok"]):
        err.print(Text(result.message), soft_wrap=True)
    if as_json:
        emit(doc)
    else:
        _console().print(table(result.outcomes, title=f"target {result.target}"))
        for outcome in result.outcomes:
            for problem in outcome.problems():
                click.echo(Problem(**problem).line(outcome.host))
    if log is not None and log.exists() and log.stat().st_size and (not quiet() or not doc["ok"]):
        err.print(Text(f"deploy output: {log}"), soft_wrap=True)
    sys.exit(exit_status(doc))


def _to_digest(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and "@sha256:" not in value:
        raise click.BadParameter(
            f"{value}: not a digest (fix: pass repo@sha256:<digest>, as `gpufleet history` shows it)"
        )
    return value


def _common(fn: Any) -> Any:
    for option in reversed(
        [
            click.option("--probe", is_flag=True, help="Gate each host on the prompt re-processing probe too."),
            click.option(
                "--drain-timeout",
                type=click.FloatRange(min=0),
                default=120.0,
                show_default=True,
                help="Seconds to wait for a host's running requests to finish before its restart.",
            ),
            click.option(
                "--retry-failed", is_flag=True, help="Install a digest a host's ledger marks failed, on purpose."
            ),
            click.option(
                "--stage-timeout",
                type=click.FloatRange(min=1),
                default=STAGE_TIMEOUT_S,
                show_default=True,
                help="Seconds one deploy run (a prepare, a batch's swap) may take; past it the run is ended "
                "and its hosts' locks freed.",
            ),
            click.option("--yes", "-y", is_flag=True, help="Do not ask before swapping."),
            click.option(
                "--json", "as_json", is_flag=True, help="One JSON document on stdout (progress stays on stderr)."
            ),
            click.option(
                "--deploy",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="The deploy file (default: deploys/qwen35.py of the checkout, else the one shipped in "
                "the package).",
            ),
            click.option(
                "--log",
                type=click.Path(dir_okay=False),
                default=None,
                help="Where each deploy run's output goes (default: a new file in the temp directory).",
            ),
        ]
    ):
        fn = option(fn)
    return fn


_inventory_arg = click.argument("inventory", type=click.Path(dir_okay=False))


@click.command()
@_inventory_arg
@click.option("--image", default=None, help="A tag or digest of vllm_image's repository (default: vllm_image).")
@click.option(
    "--model-revision",
    default=None,
    help="Move the model too: a branch, tag or commit of vllm_model_repo, resolved to one commit at the "
    "start; downloaded in prepare while the old version serves.",
)
@click.option(
    "--canary", type=click.IntRange(min=0), default=1, show_default=True, help="Hosts swapped (and gated) first."
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Hosts swapped at once: the most out of service at any moment, the canary included.",
)
@click.option(
    "--no-check",
    "skipped",
    multiple=True,
    type=click.Choice(SERVING_CHECKS),
    help="Leave this serving check out of the canary's gate (repeatable; docs/verify.md says what each one sends).",
)
@click.option(
    "--no-carry",
    is_flag=True,
    help="Start every host cold: do not carry the canary's compile cache to the others (docs/compile-cache.md).",
)
@_common
def rollout(
    inventory: str,
    image: str | None,
    model_revision: str | None,
    canary: int,
    batch: int,
    skipped: tuple[str, ...],
    no_carry: bool,
    probe: bool,
    drain_timeout: float,
    retry_failed: bool,
    stage_timeout: float,
    yes: bool,
    as_json: bool,
    deploy: str | None,
    log: str | None,
) -> None:
    """Move every host to one image digest, in place, one batch at a time: resolve, prepare all, swap, gate. The
    canary is held to every serving check (cached equals cold, sessions apart, the parsers, the probe).

    \b
    Exit status: 0 every host updated or unchanged, 1 problems found (a host rolled back, failed, not started;
    a refusal), 2 bad input (docs/cli.md). Progress goes to stderr, the result to stdout.
    """
    _checked(inventory, image=image)
    quiet_ssh_logs()
    with _log_file(log) as log_path:
        try:
            options = _options(
                deploy,
                log_path,
                canary=canary,
                batch=batch,
                probe=probe,
                retry_failed=retry_failed,
                drain_timeout_s=drain_timeout,
                stage_timeout_s=stage_timeout,
                canary_checks=tuple(c for c in SERVING_CHECKS if c not in skipped),
                carry=not no_carry,
            )
            result = roll_out(inventory, image, options, _confirm(yes), _progress, model_revision=model_revision)
        except GpufleetError as e:
            raise stopped("rollout", str(e), as_json) from None
    _finish("rollout", result, as_json, options.log)


@click.command()
@_inventory_arg
@click.option("--host", default=None, help="Only this host (default: every host, one at a time).")
@click.option(
    "--to",
    default=None,
    callback=_to_digest,
    help="repo@sha256:<digest> to go to (default: the previous committed digest).",
)
@_common
def rollback(
    inventory: str,
    host: str | None,
    to: str | None,
    probe: bool,
    drain_timeout: float,
    retry_failed: bool,
    stage_timeout: float,
    yes: bool,
    as_json: bool,
    deploy: str | None,
    log: str | None,
) -> None:
    """Return hosts to their previous committed digest (or --to), gated like a rollout.

    \b
    Exit status: 0 every host back or unchanged, 1 problems found, 2 bad input (docs/cli.md).
    """
    _checked(inventory, host, to)
    quiet_ssh_logs()
    with _log_file(log) as log_path:
        try:
            options = _options(
                deploy,
                log_path,
                probe=probe,
                retry_failed=retry_failed,
                drain_timeout_s=drain_timeout,
                stage_timeout_s=stage_timeout,
            )
            result = roll_back(inventory, options, _confirm(yes), _progress, host=host, to=to)
        except GpufleetError as e:
            raise stopped("rollback", str(e), as_json) from None
    _finish("rollback", result, as_json, options.log)


def ledger_rows(lg: Ledger) -> list[tuple[str, str, str, str, str, SpeedFigures | None]]:
    """(state, digest, image, when, detail, speed figures) rows, newest first."""
    rows: list[tuple[str, str, str, str, str, SpeedFigures | None]] = []
    if lg.pending is not None:
        p = lg.pending
        rows.append(("pending", p.version.ref, p.version.image, p.started_at, f"by {p.operator} (a cut run)", None))
    if lg.committed is not None:
        c = lg.committed
        ready = f"ready {c.ready_at}" if c.ready_at else ""
        rows.append(("committed", c.version.ref, c.version.image, c.committed_at, _gpu(ready, c.gpu), c.speed))
    for f in reversed(lg.failed):
        rows.append(("failed", f.ref, f.image or "", f.failed_at, _gpu(f.reason, f.gpu), None))
    for c in reversed(lg.history):
        rows.append(("earlier", c.version.ref, c.version.image, c.committed_at, _gpu("", c.gpu), c.speed))
    return rows


def _gpu(detail: str, gpu: str | None) -> str:
    """The detail with the GPU verdict recorded at that swap, when the ledger has one."""
    return "; ".join(part for part in (detail, f"GPU {gpu}" if gpu else "") if part)


def _history_table(host: str, lg: HostLedger) -> Table:
    t = Table(title=f"{host}  {lg.path}", title_justify="left")
    for column in ("state", "digest", "image", "at", "detail", "speed"):
        t.add_column(column, overflow="fold")
    if lg.error:
        t.add_row(Text("unreadable", style="red"), Text("-"), Text("-"), Text("-"), Text(lg.error), Text("-"))
    elif lg.ledger is None:
        t.add_row(Text("none"), Text("-"), Text("-"), Text("-"), Text("no ledger: never converged"), Text("-"))
    else:
        style = {"pending": "yellow", "committed": "green", "failed": "red", "earlier": "dim"}
        for state, ref, image, at, detail, speed in ledger_rows(lg.ledger):
            t.add_row(
                Text(state, style=style[state]),
                Text(short(ref)),
                Text(image),
                Text(at),
                Text(detail),
                Text(speed.brief() if speed else "-"),
            )
    return t


def _ledger_problems(inventory: str, host: str, lg: HostLedger) -> list[Problem]:
    if not lg.error:
        return []
    return [
        Problem.from_line(
            "ledger-unreadable",
            lg.error,
            host,
            f"check that {host} is up and that its ssh_* data in {inventory} reach it, and that "
            f"{lg.path} is readable by root there",
        )
    ]


def _history_row(inventory: str, host: str, lg: HostLedger) -> dict[str, Any]:
    rows = [
        {
            "state": state,
            "ref": ref,
            "image": image or None,
            "at": at,
            "detail": detail or None,
            "speed": speed.as_dict() if speed else None,
        }
        for state, ref, image, at, detail, speed in (ledger_rows(lg.ledger) if lg.ledger else [])
    ]
    return row(host, _ledger_problems(inventory, host, lg), path=lg.path, rows=rows)


@click.command(name="history")
@_inventory_arg
@click.option("--host", default=None, help="Only this host.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='One JSON document on stdout: {"command", "ok", "hosts", "routers"}, each host\'s ledger rows.',
)
@click.pass_context
def history_command(ctx: click.Context, inventory: str, host: str | None, as_json: bool) -> None:
    """Each host's ledger: what runs (committed), what ran before, what failed and why, a cut run's pending change.

    \b
    Exit status: 0 every ledger read, 1 a ledger could not be read, 2 bad input (docs/cli.md).
    """
    load_inventory(inventory, host)
    quiet_ssh_logs()
    try:
        ledgers = history(inventory, host)
    except GpufleetError as e:  # an invalid setting, before any host is reached
        raise BadInput(str(e)) from None
    doc = document("history", [_history_row(inventory, h.name, lg) for h, lg in ledgers], [])
    if as_json:
        emit(doc)
    else:
        console = _console()
        for h, lg in ledgers:
            console.print(_history_table(h.name, lg))
        for h, lg in ledgers:
            for problem in _ledger_problems(inventory, h.name, lg):
                click.echo(problem.line(h.name))
    ctx.exit(exit_status(doc))
