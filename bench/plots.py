"""Draw the bench plots in docs/img/ from the result files in bench/results/.

    python bench/plots.py            # needs matplotlib: pip install -e '.[bench]'

Every figure is drawn from recorded results only; which result file each one reads is chosen by a rule written
below (`inputs()`), never by hand, so a new bench run changes the picture the next time this runs. The SVGs are
byte-for-byte reproducible (fixed hash salt, no date), and docs/img/plots.json records the sha256 of every result
file read, of this script and of each image: tests/unit/test_bench_plots.py fails when a committed image is stale
(a result file changed, a newer one would be chosen, or this script changed) without needing matplotlib.

This module imports only the standard library at the top; matplotlib is imported when drawing.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
IMG = REPO / "docs" / "img"
MANIFEST = IMG / "plots.json"

NOOP_SVG = "noop-vs-hosts.svg"
ROUTER_SVG = "router-hit-ratio.svg"
ROLLOUT_SVG = "rollout-downtime.svg"


# --- reading the results (standard library only: the unit test runs this part) -----------------------------------


def md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every pipe table in a markdown text: (header cells, body rows), the separator row dropped."""
    tables: list[tuple[list[str], list[list[str]]]] = []
    block: list[list[str]] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2:
            tables.append((block[0], list(block[2:])))
        block = []
    return tables


def number(cell: str) -> float | None:
    """0.72 / 1.16x / 79.8 s -> the number; 'not run' and the like -> None."""
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*(?:x|s)?", cell)
    return float(match.group(1)) if match else None


def noop_table(path: Path) -> dict[str, list[float | None]] | None:
    """The deploy bench's no-op table as columns (header -> values, one per host count), or None without one."""
    for header, rows in md_tables(path.read_text()):
        if header[:1] == ["hosts"] and "gpufleet no-op (s)" in header and "ansible no-op (s)" in header:
            return {name: [number(row[i]) for row in rows] for i, name in enumerate(header)}
    return None


def choose_deploy_run() -> Path:
    """The newest of the deploy bench runs that measured the most host counts (floor, gpufleet and Ansible)."""
    runs = []
    for path in sorted(RESULTS.glob("deploy-*.md")):
        table = noop_table(path)
        if table and "floor (s)" in table:
            runs.append((len(table["hosts"]), path.name, path))
    if not runs:
        raise SystemExit("no deploy bench result with a floor, gpufleet and Ansible no-op table in bench/results/")
    return max(runs)[2]


def back_to_back(doc: dict[str, Any]) -> bool:
    return not doc.get("stagger_s") and not doc.get("think_s")


def choose_router_run() -> Path:
    """The newest router bench run whose agents sent their turns back to back and which compared policies."""
    runs = []
    for path in sorted(RESULTS.glob("router-2*.json")):
        doc = json.loads(path.read_text())
        if isinstance(doc.get("candidates"), dict) and len(doc["candidates"]) > 2 and back_to_back(doc):
            runs.append(path)
    if not runs:
        raise SystemExit("no router bench result comparing policies (back-to-back agents) in bench/results/")
    return runs[-1]


def rollout_table(path: Path) -> dict[str, list[str]] | None:
    for header, rows in md_tables(path.read_text()):
        if header[:1] == ["hosts"] and "downtime median" in header and "downtime max" in header:
            return {name: [row[i] for row in rows] for i, name in enumerate(header)}
    return None


def choose_rollout_run() -> Path:
    """The newest rollout bench run."""
    runs = [path for path in sorted(RESULTS.glob("rollout-*.md")) if rollout_table(path)]
    if not runs:
        raise SystemExit("no rollout bench result with a downtime table in bench/results/")
    return runs[-1]


def inputs() -> dict[str, Path]:
    """Image name -> the result file it is drawn from."""
    return {NOOP_SVG: choose_deploy_run(), ROUTER_SVG: choose_router_run(), ROLLOUT_SVG: choose_rollout_run()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# --- drawing (matplotlib) ---------------------------------------------------------------------------------------

FLOOR, GPUFLEET, ANSIBLE = "#7f7f7f", "#1f77b4", "#d62728"
LABEL_BOX = {"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none"}


def setup() -> Any:
    import matplotlib

    matplotlib.use("svg")
    matplotlib.rcParams.update(
        {
            "svg.hashsalt": "gpufleet-bench",  # the same ids on every run
            "svg.fonttype": "none",  # text stays text: small files, no glyph paths
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )
    import matplotlib.pyplot as plt

    return plt


def save(plt: Any, fig: Any, name: str) -> Path:
    out = IMG / name
    fig.savefig(out, format="svg", metadata={"Date": None, "Creator": "bench/plots.py"})
    plt.close(fig)
    return out


def caption(fig: Any, source: Path, text: str) -> None:
    fig.text(0.01, 0.01, f"{text}\nSource: {rel(source)}", fontsize=7, color="#555555", ha="left", va="bottom")


def plain_log_ticks(ax: Any, ticks: tuple[float, ...], fmt: str) -> None:
    low, high = ax.get_ylim()
    shown = [t for t in ticks if low <= t <= high]
    ax.set_yticks(shown, [fmt.format(t) for t in shown])
    ax.minorticks_off()


def draw_noop(plt: Any, source: Path) -> Path:
    table = noop_table(source)
    assert table is not None
    hosts = [int(h) for h in table["hosts"]]  # type: ignore[arg-type]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    for key, label, colour in (
        ("floor (s)", "floor: pyinfra exec -- true", FLOOR),
        ("gpufleet no-op (s)", "gpufleet no-op converge", GPUFLEET),
        ("ansible no-op (s)", "Ansible peer, no-op", ANSIBLE),
    ):
        left.plot(hosts, table[key], marker="o", color=colour, label=label)
    left.set_yscale("log")
    left.set_title("No-op converge, wall time (median)")
    left.set_ylabel("seconds (log scale)")
    left.legend(frameon=False, fontsize=8)
    right.axhline(1.0, color=FLOOR, linestyle="--", linewidth=1, label="floor = 1x")
    for key, label, colour in (
        ("gpufleet / floor", "gpufleet / floor", GPUFLEET),
        ("ansible / floor", "Ansible / floor", ANSIBLE),
    ):
        values = table[key]
        right.plot(hosts, values, marker="o", color=colour, label=label)
        for x, y in zip(hosts, values, strict=True):
            if y is not None:
                right.annotate(
                    f"{y:.2f}x",
                    (x, y),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=7,
                    color=colour,
                )
    right.set_yscale("log")
    plain_log_ticks(left, (0.5, 1, 2, 5, 10, 20, 50), "{:g} s")
    plain_log_ticks(right, (1, 2, 5, 10, 20, 50), "{:g}x")
    right.set_title("No-op converge time / floor")
    right.set_ylabel("ratio to the floor (log scale)")
    right.legend(frameon=False, fontsize=8, loc="center right")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(hosts, [str(h) for h in hosts])
        ax.minorticks_off()
        ax.set_xlabel("hosts in the run")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    caption(fig, source, "nspawn test hosts sharing one 2-core machine with the controller; 0 changes on every run.")
    return save(plt, fig, NOOP_SVG)


def candidate_label(name: str, candidate: dict[str, Any]) -> str:
    words = [candidate["policy"], *candidate.get("router_args", [])]
    label = " ".join(words)
    if candidate.get("replica_flags"):
        label += "\n(replicas " + " ".join(candidate["replica_flags"]) + ")"
    return f"default: {label}" if name == "default" else label


def draw_router(plt: Any, source: Path) -> Path:
    doc = json.loads(source.read_text())
    names = list(doc["candidates"])
    modes = (
        ("with X-Session-ID", "with X-Session-ID", "#1f77b4"),
        ("without X-Session-ID", "without X-Session-ID", "#ff7f0e"),
    )
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(10, 0.55 * len(names) + 2.0), sharey=True, gridspec_kw={"width_ratios": [3, 2]}
    )
    height = 0.38
    ys = list(range(len(names)))
    for i, (key, label, colour) in enumerate(modes):
        offset = (i - 0.5) * height
        hits = [doc["candidates"][n][key]["hit_ratio_later_turns"] for n in names]
        fair = [doc["candidates"][n][key]["busiest_over_fair_mean"] for n in names]
        left.barh([y + offset for y in ys], hits, height=height, color=colour, label=label)
        right.barh([y + offset for y in ys], fair, height=height, color=colour, label=label)
        for y, n, h in zip(ys, names, hits, strict=True):
            share = doc["candidates"][n][key].get("share_of_one_server_same_turns")
            text = f"{h:.3f}" + (f"  ({share:.0%} of one server's hits)" if share is not None else "")
            left.annotate(
                text,
                (h, y + offset),
                textcoords="offset points",
                xytext=(3, 0),
                va="center",
                fontsize=6.5,
                bbox=LABEL_BOX,
            )
        for y, f in zip(ys, fair, strict=True):
            right.annotate(
                f"{f:.2f}",
                (f, y + offset),
                textcoords="offset points",
                xytext=(3, 0),
                va="center",
                fontsize=6.5,
                bbox=LABEL_BOX,
            )
    single = doc.get("single_server", {})
    for key, style in (("scale-out replicas", ":"), ("replicas", "--")):
        if key in single:
            value = single[key]["hit_ratio_later_turns"]
            left.axvline(
                value,
                color="#555555",
                linestyle=style,
                linewidth=1,
                label=f"one server ({'--enable-scale-out' if key.startswith('scale') else 'plain'}): {value:.3f}",
            )
    left.set_yticks(ys, [candidate_label(n, doc["candidates"][n]) for n in names], fontsize=7.5)
    left.invert_yaxis()
    left.set_xlim(0, 1.25)
    left.set_xlabel("later-turn hit ratio (turns 2-4: cached / prompt tokens)")
    left.set_title("Prefix-cache hits behind the router, per policy")
    left.legend(frameon=False, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    target = doc.get("targets", {}).get("busiest_over_fair_mean_at_most")
    if target is not None:
        right.axvline(target, color="#555555", linestyle="--", linewidth=1, label=f"target: at most {target}")
    right.axvline(1.0, color="#999999", linestyle=":", linewidth=1, label="even spread: 1.0")
    right.set_xlim(0, 2.4)
    right.set_xlabel("busiest replica / fair share (mean)")
    right.set_title("Spread over the replicas")
    right.legend(frameon=False, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    caption(
        fig,
        source,
        (
            f"{doc['replicas']} vLLM replicas (CPU) behind vllm-router {doc['vllm_router']}; "
            f"{doc['agents']} agents x {doc['turns']} turns, {doc['runs_per_series']} runs per bar."
        ),
    )
    return save(plt, fig, ROUTER_SVG)


def draw_rollout(plt: Any, source: Path) -> Path:
    table = rollout_table(source)
    assert table is not None
    hosts = table["hosts"]
    median = [number(v) for v in table["downtime median"]]
    worst = [number(v) for v in table["downtime max"]]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.36
    xs = list(range(len(hosts)))
    for offset, values, label, colour in (
        (-width / 2, median, "median host", "#1f77b4"),
        (width / 2, worst, "worst host", "#ff7f0e"),
    ):
        ax.bar([x + offset for x in xs], [v or 0 for v in values], width=width, color=colour, label=label)
        for x, v in zip(xs, values, strict=True):
            if v is not None:
                ax.annotate(
                    f"{v:.1f} s", (x + offset, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8
                )
    ax.set_xticks(xs, [f"{h} hosts\n(rollout {t})" for h, t in zip(hosts, table["total"], strict=True)])
    ax.set_ylabel("seconds /health did not answer 200")
    ax.set_title("Downtime per host during a rollout (canary 1, batch 1)")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    caption(fig, source, "Stand-in hosts and image (ready 2 s after start): a real model load takes minutes.")
    return save(plt, fig, ROLLOUT_SVG)


def main() -> int:
    chosen = inputs()
    plt = setup()
    IMG.mkdir(parents=True, exist_ok=True)
    drawn = {
        NOOP_SVG: draw_noop(plt, chosen[NOOP_SVG]),
        ROUTER_SVG: draw_router(plt, chosen[ROUTER_SVG]),
        ROLLOUT_SVG: draw_rollout(plt, chosen[ROLLOUT_SVG]),
    }
    import matplotlib

    manifest = {
        "generator": rel(Path(__file__).resolve()),
        "generator_sha256": sha256(Path(__file__).resolve()),
        "matplotlib": matplotlib.__version__,
        "images": {
            name: {"source": rel(chosen[name]), "source_sha256": sha256(chosen[name]), "sha256": sha256(path)}
            for name, path in sorted(drawn.items())
        },
    }
    MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")
    for name, path in sorted(drawn.items()):
        print(f"{rel(path)}  <-  {rel(chosen[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
