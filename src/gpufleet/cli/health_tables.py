"""The rich tables of `gpufleet status` and `gpufleet verify`. Every cell from a server is plain text, never markup."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from gpufleet.health import HealthState
from gpufleet.health.check import spec_drift
from gpufleet.health.probe_report import ProbeReport
from gpufleet.health.runner import HostResult
from gpufleet.router.status import RouterStatus
from gpufleet.wire.geometry import resolved_block_sizes
from gpufleet.wire.gpu_verdicts import Verdict
from gpufleet.wire.speed import FIGURES, value_text

_STATE_STYLE = {
    HealthState.READY: "green",
    HealthState.STARTING: "yellow",
    HealthState.MISCONFIGURED: "magenta",
}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def cache_units(cache_config: dict[str, str]) -> tuple[str, str]:
    """(block sizes, prefix-match unit) as the server resolved them; "=block" when no unit is set."""
    blocks = resolved_block_sizes(cache_config)
    unit = prefix_match_unit(cache_config)
    return "/".join(map(str, blocks)) or "-", str(unit) if unit else ("=block" if blocks else "-")


def prefix_match_unit(cache_config: dict[str, str]) -> int | None:
    unit = cache_config.get("prefix_match_unit")
    return int(unit) if unit and unit.isdigit() else None


def host_table(results: list[HostResult], title: str) -> Table:
    table = Table(title=title, header_style="bold")
    columns = (
        "host",
        "GPUs",
        "GPU health",
        "image",
        "spec",
        "vLLM",
        "state",
        "model",
        "KV cache",
        "run/wait",
        "prefix hits",
        "block",
        "unit",
    )
    for col in columns:
        table.add_column(col, no_wrap=col == "host")
    for r in grouped(results):
        h, c = r.health, r.health.container
        style = _STATE_STYLE.get(h.state, "red")
        table.add_row(
            *_plain(
                host_cell(r),
                ",".join(map(str, r.target.gpus)) or "-",
                gpu_cell(r),
                image_cell(r),
                spec_cell(r),
                h.vllm_version or "-",
                Text(str(h.state), style=style),
                model_cell(h.served_model, c.model if c else None),
                _pct(h.kv_cache_usage),
                "-" if h.running is None else f"{h.running}/{h.waiting}",
                _pct(h.prefix_cache_hit_rate),
                *cache_units(h.cache_config),
            )
        )
    return table


def grouped(results: list[HostResult]) -> list[HostResult]:
    """A replica group as its head's row with its ranks' lines right under it; other hosts as they come."""
    ranks: dict[str, list[HostResult]] = {}
    for r in results:
        if r.target.headless and r.target.rank is not None:
            ranks.setdefault(r.target.rank[2], []).append(r)
    out = []
    for r in results:
        if not r.target.headless:
            out += [r, *ranks.pop(r.target.name, [])]
    return out + [r for rest in ranks.values() for r in rest]  # ranks without their head


def host_cell(r: HostResult) -> str:
    """ "box-a (group big)" for a head, "└ box-b: rank 1" for a line of its group."""
    if r.target.rank is None:
        return r.target.name
    group, rank, _ = r.target.rank
    return f"└ {r.target.name}: rank {rank}" if rank else f"{r.target.name} (group {group})"


def model_cell(served: str | None, model: str | None) -> str:
    """The served name, and its files' commit when the container's label names it."""
    commit = model.rpartition("@")[2][:12] if model else None
    return f"{served or '-'} @{commit}" if commit else served or "-"


_GPU_STYLE = {Verdict.OK: "green", Verdict.DEGRADED: "yellow", Verdict.RESTART_APP: "yellow"}


def gpu_cell(r: HostResult) -> Text:
    """The worst GPU verdict and its GPUs, e.g. "degraded: 0"; "-" when not read."""
    gpus = r.gpus
    if gpus is None:
        return Text("-")
    if gpus.error is not None:
        return Text("unknown", style="yellow")
    worst = gpus.verdict()
    if worst is Verdict.OK:
        return Text("ok", style="green")
    on = [g for g in gpus.gpus if g.verdict is worst]
    names = ",".join(str(g.index) if g.index is not None else g.bus_id for g in on)
    unused = "" if any(g in gpus.concern(r.target.gpus) for g in on) else " (unused)"
    return Text(f"{worst.label}: {names}{unused}", style=_GPU_STYLE.get(worst, "red"))


def image_cell(r: HostResult) -> Text:
    """The running image's short digest, red and marked when the ledger committed another."""
    c = r.health.container
    short = (c.image_short if c else None) or "-"
    return Text(f"{short} (not committed)", style="red") if r.committed_drift else Text(short)


def spec_cell(r: HostResult) -> Text:
    """The running container's short spec hash, red and marked on drift."""
    c = r.health.container
    if c is None or not c.running:
        return Text("-")
    short = (c.spec_hash or "unlabelled")[:12]
    if spec_drift(r.target.expected, c):
        return Text(f"{short} (drift)", style="red")
    return Text(short)


def _plain(*cells: str | Text) -> list[Text]:
    """Cells as plain text: rich would read a server's "[/x]" as markup and raise."""
    return [cell if isinstance(cell, Text) else Text(cell) for cell in cells]


def probe_table(results: list[HostResult]) -> Table:
    """One row per probed host."""
    table = Table(title="prompt re-processing probe", header_style="bold", show_lines=True)
    for col in (
        "host",
        "verdict",
        "re-processed / turn (share)",
        "hit ratio by prompt length",
        "legal fixes",
        "requests",
    ):
        table.add_column(col)
    for r in results:
        p = r.probe
        if p is None:
            continue
        table.add_row(
            *_plain(
                r.target.name,
                Text(str(p.verdict), style="green" if p.ok else "red"),
                _session_cell(p),
                "\n".join(
                    f"{pt.prompt_tokens}{_kind_mark(pt.kind)}: {pt.hit_ratio:.0%}"
                    for pt in p.points
                    if pt.kind != "session"
                )
                or "-",
                "\n".join(p.fixes or (p.legal.lines() if p.legal and not p.ok else ())) or "-",
                f"{p.requests}/{p.request_bound} in {p.elapsed_s:.0f} s",
            )
        )
    return table


def _kind_mark(kind: str) -> str:
    return " (multi-chunk)" if kind == "multi-chunk" else ""


def _session_cell(p: ProbeReport) -> str:
    later = p.session[1:]
    if not later:
        return f"{p.reprocessed_per_turn:.0f} (median of points)"
    return "\n".join(
        f"N+{t.turn}: {t.reprocessed_tokens} of {t.prompt_tokens} ({t.reprocessed_share:.0%})" for t in later
    )


def checks_table(results: list[HostResult], names: Sequence[str]) -> Table:
    """One row per host, one column per serving check; "-" where there is nothing to check or it was not reached."""
    table = Table(title="serving checks", header_style="bold")
    table.add_column("host")
    for name in names:
        table.add_column(name)
    for r in results:
        got = {c.name: c for c in r.checks}
        cells = [
            Text("-")
            if name not in got
            else Text("passed", style="green")
            if got[name].ok
            else Text("FAILED", style="red")
            if got[name].ran
            else Text("not run", style="yellow")
            for name in names
        ]
        table.add_row(Text(r.target.name), *cells)
    return table


def speed_table(results: list[HostResult]) -> Table:
    """One row per measured host: each speed figure now, and the one its ledger recorded at commit."""
    table = Table(title="speed (now, recorded at commit)", header_style="bold")
    table.add_column("host")
    for label, unit, _ in FIGURES.values():
        table.add_column(f"{label} ({unit})")
    table.add_column("workload")
    for r in results:
        if r.speed is None:
            continue
        was = r.speed_earlier
        cells = [
            value_text(name, r.speed.median(name)) + (f" ({value_text(name, was.median(name))})" if was else "")
            for name in FIGURES
        ]
        workload = f"{r.speed.prompt_tokens}-token prompt, {r.speed.decode_tokens} tokens x {r.speed.concurrency}"
        table.add_row(*_plain(r.target.name, *cells, workload))
    return table


def router_table(rows: list[RouterStatus]) -> Table:
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
            table.add_row(
                *_plain(
                    *(head if first else ("", "", "")),
                    w.url,
                    Text("yes", style="green") if w.healthy else Text("no", style="red"),
                    str(w.routed),
                    "-" if w.running is None else str(w.running),
                    str(r.requests or 0) if first else "",
                    outcomes if first else "",
                )
            )
    return table
