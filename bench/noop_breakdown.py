#!/usr/bin/env python3
"""Where gpufleet's no-op converge spends its time: the commands it sends each host and how long they take there.

    sudo .venv/bin/python bench/noop_breakdown.py [--hosts 8] [--repeat 5] [--rev HEAD]

Boots the bench fleet (see deploy_bench.py) with N hosts, converges them once, then:
- runs the no-op converge on 1 host and on all N with every command it sends recorded (bench/pyinfra_traced.py):
  how many per host, and each one's round trip as the controller sees it;
- times each of those commands on the host itself (clock read on the host before and after, so SSH is not in it):
  on one host alone, then on all N hosts at once, --repeat times;
- times the no-op converge on 1 and on N hosts (wall and controller CPU) beside the floor, for context;
- times each section of the snapshot command (gpufleet.vllm.host_command, as the working tree builds it) on one host alone:
  where its host time goes.
Writes bench/results/noop-breakdown-<UTC time>.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from deploy_bench import (
    BENCH_DATA,
    REPO,
    Runner,
    bench_config,
    boot,
    code_state,
    ensure_ansible,
    ensure_peer_debs,
    export_revision,
    loadavg,
)

from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.hosts import Host
from gpufleet.sandbox.inventory import pyinfra_hosts
from gpufleet.vllm.deploy import plan_for
from gpufleet.vllm.host_command import SCRIPT, script, steps

TRACED = Path(__file__).with_name("pyinfra_traced.py")


def commands_sent(runner: Runner) -> dict[str, list[dict]]:
    """host -> the commands a no-op converge sent it ({"command", "seconds"}), in order."""
    trace = runner.fleet.cfg.state_dir / "trace.json"
    proc = subprocess.run(
        [sys.executable, str(TRACED), "-y", str(runner.pyinfra_inv), runner.deploy],
        capture_output=True,
        text=True,
        env={**runner.pyinfra_env, "BENCH_TRACE": str(trace)},
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"no-op converge failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    sent: dict[str, list[dict]] = {}
    for entry in json.loads(trace.read_text()):
        sent.setdefault(entry["host"], []).append(entry)
    return sent


def time_on_host(fleet: Fleet, host: Host, command: str) -> float:
    """Seconds the command takes on the host, read with the host's clock (no SSH setup in it)."""
    script = f"s=$(date +%s%N); {{ {command} ; }} >/dev/null 2>&1; e=$(date +%s%N); echo $((e - s))"
    return int(fleet.ssh(host, script).stdout.strip().splitlines()[-1]) / 1e9


def snapshot_steps(fleet: Fleet, host: Host) -> list[str]:
    """The calls of the snapshot the deploy runs on the host (in its lock's shell: pyinfra does not send it)."""
    data = dict(pyinfra_hosts(str(fleet.cfg.state_dir / "inventory.json")))[host.name]
    return steps(plan_for(host.name, {**BENCH_DATA, **data}).paths)


def section_times(fleet: Fleet, host: Host, repeat: int) -> list[tuple[str, float]]:
    """(section, median seconds) for each call of the host's snapshot, timed in one shell on the host after the
    snapshot's functions are defined (so later calls see what earlier ones set), `date` read around each."""
    calls = snapshot_steps(fleet, host)
    # The ledger reader's lines and the end marker are shell of their own, not calls of the snapshot's functions.
    functions = set(re.findall(r"^(\w+)\(\)", SCRIPT, re.MULTILINE))
    names = [call.split(None, 1)[0] if call.split(None, 1)[0] in functions else "(ledger, end)" for call in calls]
    timed = [
        f's=$(date +%s%N); {{ {call}\n}} >/dev/null 2>&1; e=$(date +%s%N); echo "@@t {i} $((e - s))"'
        for i, call in enumerate(calls)
    ]
    command = script(timed)
    runs: list[list[float]] = [[] for _ in calls]
    for _ in range(repeat):
        for out in fleet.ssh(host, f"sudo sh -c {shlex.quote(command)}").stdout.splitlines():
            if out.startswith("@@t "):
                _, i, ns = out.split()
                runs[int(i)].append(int(ns) / 1e9)
    totals: dict[str, list[float]] = {}
    for name, times in zip(names, runs, strict=True):  # the ledger's lines summed per run
        totals.setdefault(name, [0.0] * repeat)
        totals[name] = [a + b for a, b in zip(totals[name], times, strict=True)]
    return [(name, statistics.median(times)) for name, times in totals.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rev", help="time this git revision (e.g. HEAD) instead of the working tree")
    args = parser.parse_args()

    started = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    load_start, code = loadavg(), code_state(args.rev)
    fleet = Fleet(bench_config())
    lines: list[str] = []
    try:
        fleet.start()
        runner = Runner(fleet, ensure_ansible(), export_revision(args.rev, fleet.cfg.state_dir) if args.rev else REPO)
        hosts = boot(fleet, args.hosts, ensure_peer_debs())
        runner.use(hosts)
        runner.gpufleet()  # cold converge, untimed
        table = [
            "| hosts in the run | floor wall (s) | no-op wall (s) | no-op CPU (s) | commands per host "
            "| round trip per command, controller (s) | command on its host alone (s) "
            "| same, on all hosts at once (s) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for subset in (hosts[:1], hosts):
            runner.use(subset)
            sent = commands_sent(runner)
            counts = sorted({len(sent.get(h.name, [])) for h in subset})
            floor = statistics.median(runner.floor().wall for _ in range(args.repeat))
            noops = [runner.gpufleet() for _ in range(args.repeat)]
            # The commands pyinfra sent, then the snapshot (sent on the host lock's own channel, so not traced).
            first = subset[0]
            traced = [e["command"] for e in sent.get(first.name, [])]
            commands = traced + [f"sudo sh -c {shlex.quote(script(snapshot_steps(fleet, first)))}"]
            # per command position: median over the hosts of the traced run
            trips = [
                statistics.median(sent[h.name][i]["seconds"] for h in subset if len(sent.get(h.name, [])) > i)
                for i in range(len(traced))
            ]
            alone = [[time_on_host(fleet, first, c) for _ in range(args.repeat)] for c in commands]
            with ThreadPoolExecutor(len(subset)) as pool:
                together = [
                    [t for _ in range(args.repeat) for t in pool.map(lambda h, c=c: time_on_host(fleet, h, c), subset)]
                    for c in commands
                ]
            table.append(
                f"| {len(subset)} | {floor:.2f} | {statistics.median(r.wall for r in noops):.2f} "
                f"| {statistics.median(r.cpu for r in noops):.2f} | {'/'.join(map(str, counts))} "
                f"| {' + '.join(f'{t:.3f}' for t in trips) or '-'} "
                f"| {' + '.join(f'{statistics.median(t):.3f}' for t in alone)} "
                f"| {' + '.join(f'{statistics.median(t):.3f}' for t in together)} |"
            )
            print(table[-1], flush=True)
        sections = section_times(fleet, hosts[0], args.repeat)
        lines = [
            f"# no-op breakdown {started}",
            "",
            f"{args.hosts} nspawn test hosts on this machine; load average at start {load_start}, at end "
            f"{loadavg()}. Code: {code}. Medians of {args.repeat}.",
            "",
            "Commands per host: what a no-op `pyinfra -y INV deploys/qwen35.py` sent each host through pyinfra "
            "(recorded in pyinfra's SSH connector; the host lock's channel, which also runs the snapshot, is not "
            "in it); round trip: from sending each to its exit status, as pyinfra saw it (median over hosts). "
            "Command times: those commands and then the snapshot run again over SSH but timed with the host's own "
            "clock (no SSH in it), on the first host alone and on every host of the run at once (median over "
            "hosts and runs).",
            "",
            *table,
            "",
            f"The snapshot command's sections on {hosts[0].name} alone (host clock around each line, medians of "
            f"{args.repeat}; `(setup)`: the lines before the first section; a `date` pair costs about 1 ms):",
            "",
            "| section | host time (ms) |",
            "|---|---:|",
            *(f"| {name} | {seconds * 1000:.1f} |" for name, seconds in sections),
            f"| total | {sum(s for _, s in sections) * 1000:.1f} |",
            "",
        ]
    finally:
        fleet.stop()
    if lines:
        path = REPO / "bench" / "results" / f"noop-breakdown-{started}.md"
        path.write_text("\n".join(lines).rstrip() + "\n")
        print(path.read_text())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
