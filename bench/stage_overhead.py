#!/usr/bin/env python3
"""What a rollout stage pays for being a pyinfra subprocess rather than a call into pyinfra's Python API in the
rollout's own process (issue 25): the fixed cost of one run on this machine, against what a stage takes.

    sudo .venv/bin/python bench/stage_overhead.py [--runs 11] [--hosts 1 4 8]

Root only for the throwaway sshd (tests/sshd.py: OpenSSH on 127.0.0.1, temp keys); no test hosts, no network. Each
measure runs once unmeasured (warm caches), then --runs times; the report gives median and min-max:

  interpreter       python -c pass
  pyinfra imports   python -c "import pyinfra_cli.main" (the CLI: gevent's patching, the API, its operations)
  deploy imports    the same and every module the packaged deploy file (data/deploys/qwen35.py) imports
  cli @local        pyinfra -y @local exec -- true: a whole CLI run without SSH
  cli exec, N       pyinfra -y INV exec -- true, N inventory hosts on the one sshd (the deploy bench's floor)
  cli stage, N      pyinfra -y INV stage.py with the result file the rollout reads: a deploy file importing what the
                    real one imports, registering as it does, running one command per host
  api stage, N      in ONE long-lived process (gevent patched and every module imported once, as the rollout
                    process already is): per stage a fresh State, connect_all, the same one command, run_ops,
                    disconnect_all. What a stage would still cost in-process.

Wall time is measured around each run; CPU is the controller's (the child's user+sys for a subprocess, the process's
for an API stage), never sshd's. The per-stage price of a subprocess is `cli stage, N` minus `api stage, N`; it is
set against the stage and rollout times the rollout and site-cache benches measured (bench/results/rollout-*.md,
site-cache-*.md). Writes bench/results/stage-overhead-<UTC time>.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.sshd

PYTHON = sys.executable
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
DEPLOY_FILE = REPO / "src" / "gpufleet" / "data" / "deploys" / "qwen35.py"
# Where a deploy run writes its result (gpufleet.harness.result.RESULT_ENV, spelled here: importing gpufleet would
# patch gevent into this process, which must stay unpatched to time the others).
RESULT_ENV = "GPUFLEET_RUN_RESULT"


@dataclass(frozen=True)
class Sample:
    wall: float
    cpu: float


@dataclass(frozen=True)
class Measure:
    name: str
    samples: tuple[Sample, ...]

    def median(self) -> float:
        return statistics.median(s.wall for s in self.samples)

    def cell(self) -> str:
        walls = [s.wall for s in self.samples]
        return f"{self.median():.3f} ({min(walls):.3f}-{max(walls):.3f})"

    def cpu(self) -> float:
        return statistics.median(s.cpu for s in self.samples)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Sample:
    cpu0, t0 = children_cpu(), time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    wall, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    return Sample(wall, cpu)


def interleaved(runs: int, named: dict[str, Callable[[], Sample]]) -> list[Measure]:
    """Each measure once per round, the order turned by one every round, so that a change in this (shared) machine's
    load falls on all of them alike and the i-th samples of two measures are neighbours in time. Round 0 is a
    warm-up (page cache, .pyc files, sshd's first fork) and is not kept."""
    names = list(named)
    got: dict[str, list[Sample]] = {name: [] for name in names}
    for round_ in range(runs + 1):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            sample = named[name]()
            if round_:
                got[name].append(sample)
    measures = [Measure(name, tuple(got[name])) for name in names]
    for m in measures:
        print(f"{m.name}: {m.cell()} s", flush=True)
    return measures


def deploy_imports() -> list[str]:
    """The modules the packaged deploy file imports, read from its source (whatever the package layout is now)."""
    tree = ast.parse(DEPLOY_FILE.read_text())
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def register_module() -> str:
    """The module the deploy file takes register_deploy_file from."""
    for node in ast.parse(DEPLOY_FILE.read_text()).body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "register_deploy_file" for a in node.names):
            assert node.module is not None
            return node.module
    raise RuntimeError(f"{DEPLOY_FILE} does not import register_deploy_file")


def stage_deploy_file() -> str:
    """A deploy file that loads what the real one loads and registers as it does (the result file at exit), then
    runs one command per host: the fixed part of a stage, without the vLLM work."""
    imports = "".join(f"import {module}  # noqa: F401\n" for module in deploy_imports())
    return (
        f"{imports}from pyinfra.operations import server\n\nfrom {register_module()} import register_deploy_file\n\n"
        "register_deploy_file(__file__)\nserver.shell(name='Run one command', commands=['true'])\n"
    )


# --- the in-process side: runs in a child of its own (`--api-worker`), so that this process stays unpatched ----------
def api_worker(inventory_json: str, runs: int) -> None:
    from gevent import monkey

    if not monkey.is_module_patched("socket"):
        monkey.patch_all()
    for module in deploy_imports():  # loaded once, as in the rollout's process
        __import__(module)
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all, disconnect_all
    from pyinfra.api.operation import add_op
    from pyinfra.api.operations import run_ops
    from pyinfra.operations import server

    hosts = [tuple(h) for h in json.loads(inventory_json)]
    samples = []
    for _ in range(runs + 1):
        cpu0, t0 = time.process_time(), time.perf_counter()
        state = State(Inventory((hosts, {})), Config())
        connect_all(state)
        if len(state.activated_hosts) != len(hosts):
            raise RuntimeError(f"connected {len(state.activated_hosts)} of {len(hosts)} hosts")
        add_op(state, server.shell, name="Run one command", commands=["true"])
        run_ops(state)
        disconnect_all(state)
        samples.append({"wall": time.perf_counter() - t0, "cpu": time.process_time() - cpu0})
    print(json.dumps(samples[1:]))  # the first is the warm-up


def api_stage(hosts: list[tuple[str, dict]]) -> Sample:
    """One stage through the API in a worker that has imported everything and run one stage before it."""
    proc = subprocess.run(
        [PYTHON, __file__, "--api-worker", json.dumps(hosts), "--runs", "1"], capture_output=True, text=True, cwd=REPO
    )
    if proc.returncode != 0:
        raise RuntimeError(f"api worker exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])
    return Sample(row["wall"], row["cpu"])


# --- what a stage takes, as the rollout benches measured it ---------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    source: str
    what: str
    seconds: float
    runs: int  # deploy runs inside `seconds`


def measured_stages() -> list[Measured]:
    found: list[Measured] = []
    results = REPO / "bench" / "results"
    row = re.compile(r"^\| (\d+) \| ([\d.]+) s \|", re.MULTILINE)
    for path in sorted(results.glob("rollout-*.md")):
        for hosts, total in row.findall(path.read_text()):
            # canary 1, batch 1, no site cache: one prepare run, then one swap run per host
            found.append(Measured(path.name, f"rollout of {hosts} hosts", float(total), int(hosts) + 1))
    cache_row = re.compile(
        r"^\| (?P<mode>[^|]+) \| (?P<hosts>\d+) \|(?:[^|]*\|){3} (?P<prepare>[^|]+) \| "
        r"(?P<total>[\d.]+) s \|",
        re.MULTILINE,
    )
    for path in sorted(results.glob("site-cache-*.md")):
        for m in cache_row.finditer(path.read_text()):
            prepares = [float(s) for s in re.findall(r": ([\d.]+) s", m["prepare"])]
            if not prepares:
                continue
            found.append(
                Measured(
                    path.name,
                    f"rollout of {m['hosts']} hosts, {m['mode'].strip()}",
                    float(m["total"]),
                    len(prepares) + int(m["hosts"]),
                )
            )
            found += [Measured(path.name, f"one prepare run ({m['mode'].strip()})", s, 1) for s in prepares]
    return found


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    import pyinfra

    version = getattr(pyinfra, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("pyinfra")
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; Python "
        f"{platform.python_version()}, pyinfra {version}; load average at start {loadavg()}"
    )


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def report(measures: list[Measure], hosts: Sequence[int], runs: int, about: str, started: str) -> str:
    by = {m.name.partition(":")[0]: m for m in measures}
    lines = [
        f"# stage overhead {started}",
        "",
        f"Machine: {about}; at end {loadavg()}. Code: {code_state()}.",
        "",
        f"bench/stage_overhead.py: {runs} rounds after a warm-up round; the import measures interleaved in each "
        "round, and so are the three measures of one host count (the order turned each round). Seconds, median "
        "(min-max); CPU: the controller's user+sys (median), never sshd's. Hosts: N inventory names for one "
        "throwaway sshd on 127.0.0.1 (tests/sshd.py), so SSH's handshake is real and the network is not in it. "
        "The machine is shared: other work ran beside it (the load averages).",
        "",
        "| measure | wall (s) | controller CPU (s) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {m.name} | {m.cell()} | {m.cpu():.3f} |" for m in measures]
    lines += [
        "",
        "What a subprocess adds per stage: `cli stage, N` minus `api stage, N` of the same round (the two ran "
        "next to each other), median (min-max) over the rounds.",
        "",
        "| hosts | cli stage (s) | api stage (s) | subprocess adds (s) |",
        "|---:|---:|---:|---:|",
    ]
    extra: dict[int, float] = {}
    for n in hosts:
        cli, api = by[f"cli stage, {n}"], by[f"api stage, {n}"]
        added = [c.wall - a.wall for c, a in zip(cli.samples, api.samples, strict=True)]
        extra[n] = statistics.median(added)
        lines.append(
            f"| {n} | {cli.median():.3f} | {api.median():.3f} | {extra[n]:.3f} ({min(added):.3f}-{max(added):.3f}) |"
        )
    largest = max(extra.values())
    lines += [
        "",
        f"Against what stages took in the rollout benches (stand-in vLLM on nspawn hosts; a stage on real "
        f"GPUs is longer: a real pull, a real engine start), at the largest added cost above ({largest:.3f} s "
        "a run):",
        "",
        "| bench result | what | seconds | deploy runs in it | subprocess share |",
        "|---|---|---:|---:|---:|",
    ]
    for m in measured_stages():
        lines.append(
            f"| {m.source} | {m.what} | {m.seconds:.1f} | {m.runs} | {100 * largest * m.runs / m.seconds:.1f} % |"
        )
    return "\n".join(lines) + "\n"


def code_state() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src", "bench"], capture_output=True, text=True, cwd=REPO
    )
    head = rev.stdout.strip() or "unknown"
    return f"working tree at {head}" + (" with uncommitted changes in src/ or bench/" if dirty.stdout.strip() else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--api-worker", metavar="HOSTS_JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.api_worker is not None:
        api_worker(args.api_worker, args.runs)
        return 0

    from tests.sshd import Sshd

    why = Sshd.available()
    if why:
        print(f"no throwaway sshd: {why}", file=sys.stderr)
        return 2
    started = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    about = machine()
    runs = args.runs
    imports = deploy_imports()
    deploy_import = "; ".join(["import pyinfra_cli.main", *(f"import {m}" for m in imports)])
    with tempfile.TemporaryDirectory(prefix="gpufleet-stage-overhead-") as scratch:
        work = Path(scratch)
        (work / "sshd").mkdir()
        sshd = Sshd(work / "sshd").start()
        try:
            local_inv = work / "local.py"
            local_inv.write_text("hosts = ['@local']\n")
            measures = interleaved(
                runs,
                {
                    "interpreter: python -c pass": lambda: timed([PYTHON, "-c", "pass"]),
                    "pyinfra imports: import pyinfra_cli.main": lambda: timed(
                        [PYTHON, "-c", "import pyinfra_cli.main"]
                    ),
                    "deploy imports: the above + the deploy file's": lambda: timed(
                        [PYTHON, "-c", deploy_import], cwd=REPO
                    ),
                    "cli @local: pyinfra -y @local exec -- true": lambda: timed(
                        [PYINFRA, "-y", str(local_inv), "exec", "--", "true"], cwd=work
                    ),
                },
            )
            stage = work / "stage.py"
            stage.write_text(stage_deploy_file())
            login = {
                "ssh_hostname": "127.0.0.1",
                "ssh_port": sshd.port,
                "ssh_user": sshd.user,
                "ssh_key": str(sshd.client_key),
                "ssh_known_hosts_file": str(work / "known_hosts"),
                "ssh_strict_host_key_checking": "accept-new",
            }
            env = {**os.environ, RESULT_ENV: str(work / "result.json"), "PYTHONUNBUFFERED": "1"}
            for n in args.hosts:
                hosts = [(f"h{i}", login) for i in range(1, n + 1)]
                inv = work / f"inv{n}.py"
                inv.write_text(f"hosts = {hosts!r}\n")
                measures += interleaved(
                    runs,
                    {
                        f"cli exec, {n}: pyinfra -y INV exec -- true": lambda inv=inv: timed(
                            [PYINFRA, "-y", str(inv), "exec", "--", "true"], cwd=work
                        ),
                        f"cli stage, {n}: pyinfra -y INV stage.py": lambda inv=inv: timed(
                            [PYINFRA, "-y", str(inv), str(stage)], env=env, cwd=work
                        ),
                        f"api stage, {n}: State, connect_all, run_ops, disconnect_all": lambda hosts=hosts: api_stage(
                            hosts
                        ),
                    },
                )
        finally:
            sshd.stop()
    text = report(measures, args.hosts, runs, about, started)
    out = REPO / "bench" / "results" / f"stage-overhead-{started}.md"
    out.write_text(text)
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
