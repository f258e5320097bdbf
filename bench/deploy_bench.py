#!/usr/bin/env python3
"""Deploy timing on nspawn test hosts (not a timed test): gpufleet's cold and no-op converge beside the SSH floor
and an Ansible peer (bench/ansible-peer/: the same steps with Ansible's stock modules), for 1, 2, 4 and 8 hosts.

    sudo .venv/bin/python bench/deploy_bench.py [--sizes 1 2 4 8] [--repeat 7] [--cold-repeat 1]

For each host count N:
- cold: boot N fresh hosts, time `pyinfra -y INV deploys/qwen35.py`; boot N fresh hosts again, time the peer's
  `ansible-playbook` (each --cold-repeat times, fresh hosts each time);
- no-op: on the peer's hosts, converge once more with gpufleet (so both tools' end states are on the hosts), then
  run floor (`pyinfra -y INV exec -- true`) and gpufleet no-op in --repeat adjacent pairs (which goes first
  alternating: A B B A ...), then the Ansible no-op --repeat times, and report medians. Every no-op run must
  report zero changes (pyinfra's Grand total, Ansible's changed=0), or the bench stops.
- each run's CPU: the tool's process tree (the controller), and the whole machine's busy CPU meanwhile (/proc/stat):
  the hosts share this machine's cores, so what their reads cost shows there, and how close the machine was to
  running out of cores.

Boots its own fleet (bridge gf-bench, 10.213.3.0/24, state /var/lib/gpufleet/bench) with gpufleet.sandbox, so it
never touches the sandbox (10.213.0), test (10.213.1) or teardown-test (10.213.2) fleets, and stops it at the end,
also on errors and Ctrl-C. Ansible is installed on first run in a venv of its own (ANSIBLE_VENV), never in the
project's. Writes bench/results/deploy-<UTC time>.md.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from gpufleet.sandbox.config import CACHE_DIR, FleetConfig, H200x3
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.hosts import Host
from gpufleet.sandbox.image import MODEL_REPO, image_ref

REPO = Path(__file__).resolve().parents[1]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
PEER = REPO / "bench" / "ansible-peer"
# As in tests/integration/test_deploy_qwen35.py: a short readiness deadline; the sandbox's own host data otherwise.
BENCH_DATA = {"vllm_ready_timeout": 120}

ANSIBLE_VERSION = "12.3.0"  # the `ansible` package: ansible-core 2.19 plus community.docker
ANSIBLE_VENV = CACHE_DIR / f"bench-ansible-{ANSIBLE_VERSION}" / "venv"
# Ansible's managed-node requirements that a stock Debian server image has and the test hosts' minimal rootfs and
# local mirror lack: python3-apt (ansible.builtin.apt) and python3-requests (community.docker). Fetched once from the
# machine's Debian mirror (same release as the hosts) and installed on every fresh host, gpufleet's too, untimed.
PEER_HOST_DEBS = (
    "python3-apt",
    "python-apt-common",
    "distro-info-data",
    "python3-requests",
    "python3-urllib3",
    "python3-idna",
    "python3-certifi",
    "python3-charset-normalizer",
    "python3-chardet",
    "python3-six",
    "python3-pkg-resources",
)
DEBS_DIR = CACHE_DIR / "bench-peer-debs"
HOST_DEBS_DIR = "/var/cache/bench-peer-debs"
# The stand-in image's model (what its `hf download` serves, also baked into the image) and vLLM's default port.
STANDIN_MODEL_DIR = f"/opt/gpufleet-standin/hub/{MODEL_REPO}"


def bench_config() -> FleetConfig:
    return FleetConfig(
        name="bench", bridge="gf-bench", net="10.213.3", host_prefix="gfb", state_dir=Path("/var/lib/gpufleet/bench")
    )


# ------------------------------------------------------------------------------------------------------- setup
def ensure_ansible() -> Path:
    playbook_bin = ANSIBLE_VENV / "bin" / "ansible-playbook"
    if not playbook_bin.exists():
        print(f"installing ansible {ANSIBLE_VERSION} into {ANSIBLE_VENV} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(ANSIBLE_VENV)], check=True)
        subprocess.run(
            [str(ANSIBLE_VENV / "bin" / "pip"), "install", "-q", f"ansible=={ANSIBLE_VERSION}"], check=True, timeout=900
        )
    return playbook_bin


def ensure_peer_debs() -> list[Path]:
    debs = sorted(DEBS_DIR.glob("*.deb"))
    if len(debs) < len(PEER_HOST_DEBS):
        DEBS_DIR.mkdir(parents=True, exist_ok=True)
        shutil.chown(DEBS_DIR, "_apt")  # apt-get download drops to _apt
        subprocess.run(
            ["apt-get", "download", "-q", *PEER_HOST_DEBS],
            cwd=DEBS_DIR,
            check=True,
            timeout=300,
            stdout=subprocess.DEVNULL,
        )
        debs = sorted(DEBS_DIR.glob("*.deb"))
    return debs


def boot(fleet: Fleet, n: int, debs: list[Path]) -> list[Host]:
    hosts = fleet.add_hosts([H200x3] * n, first=1)
    for h in hosts:
        target = h.root / HOST_DEBS_DIR.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for deb in debs:
            shutil.copy(deb, target / deb.name)
        fleet.ssh(h, f"sudo apt-get install -y -q --no-install-recommends {HOST_DEBS_DIR}/*.deb >/dev/null")
    return hosts


def write_inventories(fleet: Fleet, hosts: list[Host]) -> tuple[Path, Path]:
    """The pyinfra inventory (the sandbox's host data) and the Ansible INI for the same hosts."""
    names = [h.name for h in hosts]
    inventory_json = fleet.write_inventory()
    state = fleet.cfg.state_dir
    pyinfra_inv = state / "inventory-bench.py"
    pyinfra_inv.write_text(
        "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
        f"gpuhosts = [(n, {{**{BENCH_DATA!r}, **d}}) for n, d in pyinfra_hosts({str(inventory_json)!r}) "
        f"if n in {names!r}]\n"
    )
    ansible_inv = state / "inventory-bench.ini"
    ansible_inv.write_text(
        "[gpuhosts]\n"
        + "".join(
            f"{h.name} ansible_host={h.ip} ansible_user=deploy ansible_ssh_private_key_file={fleet.key}\n"
            for h in hosts
        )
    )
    return pyinfra_inv, ansible_inv


def peer_vars(cfg: FleetConfig) -> dict:
    """Point the peer at the bench fleet's local services, as gpufleet.sandbox.inventory does for pyinfra."""
    return {
        "docker_repo_base": f"{cfg.docker_repo_url}/debian",
        "docker_apt_line": f"deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] {cfg.docker_repo_url}/debian "
        "bookworm stable",
        "nvidia_repo_base": cfg.nvidia_repo_url,
        "vllm_image": image_ref(cfg, "nightly"),
        "vllm_args": f"{STANDIN_MODEL_DIR} --port 8000",
    }


# ------------------------------------------------------------------------------------------------------- runs
class Run(NamedTuple):
    wall: float
    cpu: float  # user + system seconds of the tool's process tree on this machine (the controller)
    changes: int
    machine: float = 0.0  # busy CPU seconds of the whole machine meanwhile: controller, hosts, their services


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_busy() -> float:
    """CPU seconds this machine spent busy since boot, all cores (user, nice, system, irq, softirq, steal): the
    test hosts share its kernel, so their programs, sshd and services count here too."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
    ticks = sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8))
    return ticks / os.sysconf("SC_CLK_TCK")


def export_revision(rev: str, state_dir: Path) -> Path:
    """A copy of the project at `rev` (git archive: the tree and index stay as they are) to time instead of the
    working tree, which may be mid-edit."""
    out = state_dir / "code"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


class Runner:
    def __init__(self, fleet: Fleet, playbook_bin: Path, code: Path):
        self.fleet = fleet
        self.playbook_bin = playbook_bin
        self.deploy = str(code / "deploys" / "qwen35.py")
        # pyinfra imports gpufleet from the code timed; PYTHONPATH comes before the venv's editable install.
        self.pyinfra_env = {**os.environ, "PYTHONPATH": str(code / "src")}
        # Byte-compiled as an install leaves it (pip compiles what it installs), whatever PYTHONDONTWRITEBYTECODE
        # says here: else every timed run compiles gpufleet's modules again (~45 ms) and pyinfra's never.
        compileall.compile_dir(str(code / "src"), quiet=1)
        state = fleet.cfg.state_dir
        self.vars_file = state / "peer-vars.json"
        self.vars_file.write_text(json.dumps(peer_vars(fleet.cfg)))
        self.ansible_env = {
            **os.environ,
            "ANSIBLE_CONFIG": str(PEER / "ansible.cfg"),
            "ANSIBLE_HOME": str(state / "ansible-home"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(state / "ansible-cp"),
        }
        self.pyinfra_inv = self.ansible_inv = Path()

    def use(self, hosts: list[Host]) -> None:
        self.n = len(hosts)
        self.pyinfra_inv, self.ansible_inv = write_inventories(self.fleet, hosts)

    def _timed(
        self, argv: list[str], parse_changes: Callable[[str], int], env: dict | None = None, cwd: Path | None = None
    ) -> Run:
        cpu0, busy0, t0 = children_cpu(), machine_busy(), time.monotonic()
        proc = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, env=env, cwd=cwd
        )
        elapsed, cpu, busy = time.monotonic() - t0, children_cpu() - cpu0, machine_busy() - busy0
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}")
        return Run(elapsed, cpu, parse_changes(proc.stdout), busy)

    def floor(self) -> Run:
        return self._timed(
            [PYINFRA, "-y", str(self.pyinfra_inv), "exec", "--", "true"], lambda _out: 0, env=self.pyinfra_env
        )

    def gpufleet(self) -> Run:
        return self._timed([PYINFRA, "-y", str(self.pyinfra_inv), self.deploy], pyinfra_changes, env=self.pyinfra_env)

    def ansible(self) -> Run:
        return self._timed(
            [str(self.playbook_bin), "-i", str(self.ansible_inv), "playbook.yml", "-e", f"@{self.vars_file}"],
            lambda out: ansible_changes(out, self.n),
            env=self.ansible_env,
            cwd=PEER,
        )

    def sudo_per_host(self, hosts: list[Host], tool) -> float:
        """Run `tool` once more and count the sudo invocations it made on each host (the hosts' journals): the
        commands that reached a host as root. Mean over the hosts."""
        t0 = time.time()  # the hosts share this machine's kernel, so its clock
        tool()
        time.sleep(1)  # let journald take the last lines
        # journalctl exits 1 when no entry matches (the floor runs nothing as root)
        logs = [
            self.fleet.run_in(
                h, f"journalctl -q --no-pager -o short-unix _COMM=sudo --since @{int(t0)}", check=False
            ).stdout
            for h in hosts
        ]
        return statistics.mean(
            sum(1 for line in log.splitlines() if "COMMAND=" in line and float(line.split(" ", 1)[0]) >= t0)
            for log in logs
        )


def pyinfra_changes(output: str) -> int:
    row = next(line for line in output.splitlines() if line.strip().startswith("Grand total"))
    success = re.split(r"\s{2,}", row.strip())[2]
    return 0 if success == "-" else int(success)


def ansible_changes(output: str, hosts: int) -> int:
    """Sum of changed= over the PLAY RECAP; every host must be in it, none failed or unreachable."""
    recap = re.findall(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", output, re.M)
    if len(recap) != hosts or any(int(u) or int(f) for _, _, _, u, f in recap):
        raise SystemExit(f"ansible-playbook recap is not {hosts} healthy host(s):\n{output[-3000:]}")
    return sum(int(c) for _, _, c, _, _ in recap)


def must_be_noop(tool: str, n: int, run: Run) -> Run:
    if run.changes:
        raise SystemExit(f"{tool} no-op run on {n} host(s) reported {run.changes} change(s): not a no-op")
    return run


# ------------------------------------------------------------------------------------------------------- main
def measure(fleet: Fleet, runner: Runner, n: int, debs: list[Path], repeat: int, cold_repeat: int) -> dict:
    row: dict = {"n": n, "gf_cold": [], "ans_cold": []}
    for _ in range(cold_repeat):
        runner.use(boot(fleet, n, debs))
        runner.floor()  # first contact (host keys, sshd): not part of the cold figure
        cold = runner.gpufleet()
        row["gf_cold"].append(cold.wall)
        row["gf_cold_changes"] = cold.changes
        print(f"  {n} host(s): gpufleet cold {cold.wall:.2f}s ({cold.changes} changes)", flush=True)
        fleet.remove_hosts()
    for i in range(cold_repeat):
        hosts = boot(fleet, n, debs)
        runner.use(hosts)
        runner.floor()
        cold = runner.ansible()
        row["ans_cold"].append(cold.wall)
        row["ans_cold_changes"] = cold.changes
        print(f"  {n} host(s): ansible cold {cold.wall:.2f}s ({cold.changes} changed)", flush=True)
        if i < cold_repeat - 1:
            fleet.remove_hosts()
    if not cold_repeat:  # --cold-repeat 0: no-op figures only, on hosts the peer converges first (untimed)
        hosts = boot(fleet, n, debs)
        runner.use(hosts)
        runner.floor()
        runner.ansible()
    # Both tools' end states on the same hosts: gpufleet converges the peer's hosts once (untimed), then each tool
    # re-runs once to show it is at rest before the timed, interleaved runs.
    runner.gpufleet()
    must_be_noop("gpufleet", n, runner.gpufleet())
    must_be_noop("ansible", n, runner.ansible())
    # The floor and gpufleet in adjacent pairs, which goes first alternating, and Ansible's runs after all pairs:
    # an Ansible run loads the machine for tens of seconds after it ends (its forks, sudo lines, ControlPersist
    # masters), which slowed whichever run came next, the floor, when the three ran A B C A B C.
    floor, gf, ans = [], [], []
    for i in range(repeat):
        if i % 2:
            gf.append(must_be_noop("gpufleet", n, runner.gpufleet()))
            floor.append(runner.floor())
        else:
            floor.append(runner.floor())
            gf.append(must_be_noop("gpufleet", n, runner.gpufleet()))
    for _ in range(repeat):
        ans.append(must_be_noop("ansible", n, runner.ansible()))
    row.update(
        floor=floor,
        gf_noop=gf,
        ans_noop=ans,
        sudo={
            "floor": runner.sudo_per_host(hosts, runner.floor),
            "gpufleet": runner.sudo_per_host(hosts, lambda: must_be_noop("gpufleet", n, runner.gpufleet())),
            "ansible": runner.sudo_per_host(hosts, lambda: must_be_noop("ansible", n, runner.ansible())),
        },
    )
    fleet.remove_hosts()
    f, g, a = (statistics.median(r.wall for r in x) for x in (floor, gf, ans))
    print(
        f"  {n} host(s): floor {f:.2f}s  gpufleet no-op {g:.2f}s ({g / f:.2f}x)  ansible no-op {a:.2f}s ({a / f:.2f}x)",
        flush=True,
    )
    return row


def report(rows: list[dict], args: argparse.Namespace, load: tuple[str, str], started: str, code: str) -> str:
    med = statistics.median
    lines = [
        f"# deploy bench {started}",
        "",
        f"nspawn test hosts (3x H200 stand-ins, stand-in vLLM image) on this machine ({os.cpu_count()} cores). "
        f"Load average at start: {load[0]}; at end: {load[1]}. Code: {code}.",
        "",
        *([args.note, ""] if args.note else []),
        f"- floor: `pyinfra -y INV exec -- true`; gpufleet: `pyinfra -y INV deploys/qwen35.py`; ansible: "
        f"bench/ansible-peer/playbook.yml (ansible {ANSIBLE_VERSION}, forks 16, pipelining, ControlPersist 60s).",
        f"- no-op columns: medians of {args.repeat} runs on the same hosts (which carry both tools' end states): floor "
        "and gpufleet in adjacent pairs (which goes first alternating), then Ansible's runs; `paired` is the median "
        "of each pair's gpufleet / floor; every no-op run reported 0 changes (checked).",
        f"- cold: {args.cold_repeat} run(s) per tool per host count, each on freshly booted hosts (median shown).",
        "",
        "| hosts | floor (s) | gpufleet no-op (s) | gpufleet / floor | paired | ansible no-op (s) | ansible / floor "
        "| gpufleet cold (s) | ansible cold (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        f, g, a = (med(x.wall for x in r[k]) for k in ("floor", "gf_noop", "ans_noop"))
        paired = med(gx.wall / fx.wall for fx, gx in zip(r["floor"], r["gf_noop"], strict=True))
        lines.append(
            f"| {r['n']} | {f:.2f} | {g:.2f} | {g / f:.2f}x | {paired:.2f}x | {a:.2f} | {a / f:.2f}x "
            f"| {cold(r['gf_cold'])} | {cold(r['ans_cold'])} |"
        )
    lines += [
        "",
        "Where the no-op time goes: controller CPU (user+sys seconds of the tool's process tree, median of the "
        "same runs) and commands run as root on each host per run (sudo lines in the host's journal, one extra "
        "run each after the timed ones, mean over hosts).",
        "",
        "| hosts | floor CPU (s) | gpufleet CPU (s) | ansible CPU (s) | floor sudo/host | gpufleet sudo/host "
        "| ansible sudo/host |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        f, g, a = (med(x.cpu for x in r[k]) for k in ("floor", "gf_noop", "ans_noop"))
        sudo = r["sudo"]
        lines.append(
            f"| {r['n']} | {f:.2f} | {g:.2f} | {a:.2f} | {sudo['floor']:.1f} | {sudo['gpufleet']:.1f} "
            f"| {sudo['ansible']:.1f} |"
        )
    lines += [
        "",
        "The whole machine's busy CPU during the same runs (median, seconds over all cores: the controller, the "
        "hosts' programs, sshd and services, which share this machine's cores) and how many of its "
        f"{os.cpu_count()} cores that kept busy on average over the run (CPU / wall).",
        "",
        "| hosts | floor machine CPU (s) | gpufleet machine CPU (s) | of which not the controller | floor cores busy "
        "| gpufleet cores busy |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fm, gm = (med(x.machine for x in r[k]) for k in ("floor", "gf_noop"))
        hosts_share = med(x.machine - x.cpu for x in r["gf_noop"])
        fb, gb = (med(x.machine / x.wall for x in r[k]) for k in ("floor", "gf_noop"))
        lines.append(f"| {r['n']} | {fm:.2f} | {gm:.2f} | {hosts_share:.2f} | {fb:.2f} | {gb:.2f} |")
    lines += ["", "Raw runs (wall seconds):", ""]
    for r in rows:
        lines.append(
            f"- {r['n']} host(s): floor {fmt(r['floor'])}; gpufleet no-op {fmt(r['gf_noop'])}; "
            f"ansible no-op {fmt(r['ans_noop'])}; gpufleet cold {fmt(r['gf_cold'])} "
            f"({r.get('gf_cold_changes', '-')} changes); ansible cold {fmt(r['ans_cold'])} "
            f"(changed={r.get('ans_cold_changes', '-')})"
        )
    return "\n".join(lines) + "\n"


def cold(walls: list[float]) -> str:
    return f"{statistics.median(walls):.2f}" if walls else "not run"


def fmt(xs: list) -> str:
    return " ".join(f"{x.wall if isinstance(x, Run) else x:.2f}" for x in xs)


def code_state(rev: str | None) -> str:
    """The commit timed; without --rev, also whether the working tree (what then runs) differed from it."""
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short", rev or "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if rev:
        return f"commit {commit} (--rev {rev})"
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "src", "deploys"], capture_output=True, text=True
    ).stdout.strip()
    return f"working tree at {commit}{' with uncommitted changes in src/ or deploys/' if dirty else ''}"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=7, help="interleaved floor / no-op runs per size (median)")
    parser.add_argument(
        "--cold-repeat",
        type=int,
        default=1,
        help="cold runs per tool per size, fresh hosts each (0: no-op figures only)",
    )
    parser.add_argument("--note", default="", help="a line for the result file's header (e.g. what else ran)")
    parser.add_argument("--rev", help="time this git revision (e.g. HEAD) instead of the working tree")
    args = parser.parse_args()

    started = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    load_start, code = loadavg(), code_state(args.rev)
    playbook_bin = ensure_ansible()
    debs = ensure_peer_debs()
    fleet = Fleet(bench_config())
    rows = []
    try:
        fleet.start()
        runner = Runner(fleet, playbook_bin, export_revision(args.rev, fleet.cfg.state_dir) if args.rev else REPO)
        for n in args.sizes:
            rows.append(measure(fleet, runner, n, debs, args.repeat, args.cold_repeat))
    finally:
        fleet.stop()
        if rows:  # the sizes measured before a failure are still worth keeping
            out_dir = REPO / "bench" / "results"
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"deploy-{started}.md"
            path.write_text(report(rows, args, (load_start, loadavg()), started, code))
            print(path.read_text())
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
