"""`gpufleet rollout` behind vllm-router: 3 real test-host replicas (stand-in vLLM) and a router host, over SSH,
while a client loop sends requests through the router the whole time. Each replica leaves the router's worker set
before its drain and rejoins after its outcome: the router's clients see no failed request.

A fleet built like tests/integration/test_router.py's, of its own (gf-rroll, 10.213.100.0/24), so the two modules run
side by side. The rollout's target is the stand-in tag `good-next` (never moved by any test); the replicas first
converge on the inventory's `nightly` (= `good`), so every run of this module swaps all three.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
from pathlib import Path

import pytest

from gpufleet.hostlock import LOCK_PATH, process_ended
from gpufleet.router.settings import router_settings
from gpufleet.sandbox import gpu_faults
from gpufleet.sandbox.config import FleetConfig
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.image import REPOSITORY
from gpufleet.sandbox.inventory import pyinfra_hosts
from tests.integration.fleets import own_fleet_config
from tests.integration.pyinfra_run import run_deploy
from tests.integration.test_router import (
    GPUFLEET,
    QWEN35,
    REPO,
    ROUTER,
    ROUTER_PORT,
    TEST_DATA,
    chat,
    inventory,
    replicas,
    rfleet,
    router_host,
    served_model,
)

__all__ = ["inventory", "rfleet"]  # the fleet and inventory fixtures of test_router.py
CLIENTS = 6


@pytest.fixture(scope="module")
def rfleet_config() -> FleetConfig:
    return own_fleet_config("rroll", "10.213.100", "gfq", "GPUFLEET_ROUTER_ROLLOUT_FLEET_DIR")


def connect_router(rfleet: Fleet):
    from gpufleet.router import status

    ((name, data),) = pyinfra_hosts(rfleet.cfg.state_dir / "inventory.json", routers=True)
    return status.connect(name, data)


def router_workers(rfleet: Fleet) -> list[str]:
    router = connect_router(rfleet)
    try:
        return router.list_workers()
    finally:
        router.transport.client.close()  # type: ignore[attr-defined]


def wait_until_one_leaves(router, urls: list[str], proc: subprocess.Popen[str]) -> set[str]:
    """The replicas out of the router's worker set as soon as one is (within 300 s, the rollout `proc` still running)."""
    deadline = time.monotonic() + 300
    out: set[str] = set()
    while not out and time.monotonic() < deadline and proc.poll() is None:
        out = set(urls) - set(router.list_workers())
        time.sleep(0.1)
    assert out and proc.poll() is None, "the rollout ended before a replica left the router"
    return out


def deploy_runs(inventory) -> list[int]:
    """The PIDs of the live processes (zombies aside) running a pyinfra deploy of `inventory`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        pid = int(proc.name)
        if any(a.endswith(b"pyinfra") for a in argv) and str(inventory).encode() in argv and not process_ended(pid):
            found.append(pid)
    return found


class WorkerWatch:
    """The router's worker set every 0.3 s, in a thread: which replicas were ever out, and the most out at once."""

    def __init__(self, rfleet: Fleet, urls: list[str]):
        self.router, self.urls = connect_router(rfleet), set(urls)
        self.ever_out: set[str] = set()
        self.most_out = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = self.urls - set(self.router.list_workers())
                self.ever_out |= out
                self.most_out = max(self.most_out, len(out))
            except Exception:  # a missed look is no evidence either way
                pass
            time.sleep(0.3)

    def __enter__(self) -> WorkerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.router.transport.client.close()  # type: ignore[attr-defined]


class ClientLoop:
    """CLIENTS threads, each a conversation of its own sending chat requests through the router until stopped."""

    def __init__(self, base: str, model: str):
        self.base, self.model = base, model
        self.ok: list[int] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(CLIENTS)]

    def _client(self, k: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                chat(self.base, self.model, f"agent {k} turn {i}: " + "lorem ipsum " * 8)
                self.ok.append(k)
            except (urllib.error.URLError, OSError) as error:
                self.failed.append(f"agent {k} turn {i} at {time.strftime('%H:%M:%S')}: {error}")

    def __enter__(self) -> ClientLoop:
        for th in self._threads:
            th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(timeout=40)


def test_rollout_behind_the_router_fails_no_client_request(rfleet, inventory, pyinfra, tmp_path):
    run_deploy(pyinfra, inventory, QWEN35)  # every replica on the inventory's image (nightly = good)
    run_deploy(pyinfra, inventory, ROUTER)
    urls = sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    assert sorted(router_workers(rfleet)) == urls
    registry = rfleet.cfg.registry
    base = f"http://{router_host(rfleet).ip}:{ROUTER_PORT}"
    log = tmp_path / "rollout.log"
    # Every replica at once behind the router is refused before anything changes.
    whole = subprocess.run(
        [
            GPUFLEET,
            "rollout",
            str(inventory),
            "--image",
            f"{registry}/{REPOSITORY}:good-next",
            "--yes",
            "--canary",
            "0",
            "--batch",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert whole.returncode != 0 and "would leave it no replica in service" in whole.stderr, whole.stderr[-2000:]
    assert "Traceback" not in whole.stderr
    assert sorted(router_workers(rfleet)) == urls
    with ClientLoop(base, served_model(base)) as clients, WorkerWatch(rfleet, urls) as watch:
        time.sleep(2)
        started = time.monotonic()
        rolling = subprocess.Popen(
            [
                GPUFLEET,
                "rollout",
                str(inventory),
                "--image",
                f"{registry}/{REPOSITORY}:good-next",
                "--yes",
                "--json",
                "--log",
                str(log),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        # While it runs it holds the router host's lock: a router deploy now is refused, naming the rollout.
        while not watch.ever_out and rolling.poll() is None:
            time.sleep(0.2)
        during = run_deploy(pyinfra, inventory, ROUTER, check=False)
        stdout, stderr = rolling.communicate(timeout=900)
        proc = subprocess.CompletedProcess(rolling.args, rolling.returncode, stdout, stderr)
        seconds = time.monotonic() - started
        time.sleep(2)
    assert during.returncode != 0 and re.search(
        rf"{router_host(rfleet).name}: locked by \S+ pid {rolling.pid} ", during.stdout
    ), during.stdout[-3000:]
    print(
        f"rollout of 3 replicas behind the router: {seconds:.0f} s; client requests: {len(clients.ok)} ok, "
        f"{len(clients.failed)} failed"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    target = doc["target"]
    assert "@sha256:" in target
    assert {h["host"]: h["outcome"] for h in doc["hosts"]} == {h.name: "updated" for h in replicas(rfleet)}, doc
    assert all(h["to"] == target for h in doc["hosts"])
    assert clients.failed == [], clients.failed[:5]
    assert len(clients.ok) > 50
    # Each replica's ledger commits the new digest, and every replica is back in the router's worker set.
    history = subprocess.run(
        [GPUFLEET, "history", str(inventory), "--json"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert history.returncode == 0, history.stderr[-2000:]
    for entry in json.loads(history.stdout)["hosts"]:
        assert entry["rows"][0]["state"] == "committed" and entry["rows"][0]["ref"] == target, entry
    assert sorted(router_workers(rfleet)) == urls
    # Each replica left the router's set for its swap, one at a time (--batch 1).
    assert watch.ever_out == set(urls) and watch.most_out == 1, (watch.ever_out, watch.most_out)


def rollout(inventory, image: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GPUFLEET, "rollout", str(inventory), "--image", image, "--yes", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        **kwargs,
    )


def test_a_controller_killed_after_a_replica_left_the_router_strands_nothing(rfleet, inventory):
    # After the test above every replica runs good-next; this rollout goes back to good (committed before, not
    # failed). The controller is killed (SIGKILL, its deploy run dies with it) right after the first replica left
    # the router's worker set: the laptop that died mid-rollout.
    urls = sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    assert sorted(router_workers(rfleet)) == urls
    image = f"{rfleet.cfg.registry}/{REPOSITORY}:good"
    proc = subprocess.Popen(
        [GPUFLEET, "rollout", str(inventory), "--image", image, "--yes", "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    router = connect_router(rfleet)
    try:
        stranded = wait_until_one_leaves(router, urls, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        time.sleep(1)
        assert set(urls) - set(router.list_workers()) == stranded, "the kill must leave the replica out"
        # Its deploy run (when it had started one, however close to the kill) died with it: none holds a host.
        assert deploy_runs(inventory) == [], "a deploy run outlived its killed controller"

        resumed = rollout(inventory, image)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert {h["outcome"] for h in json.loads(resumed.stdout)["hosts"]} <= {"updated", "unchanged"}
        assert sorted(router.list_workers()) == urls, resumed.stderr[-3000:]

        # Killed later, after a swap committed but before its rejoin: the next run has nothing to swap, and still
        # puts the replica back (a run with nothing to do reconciles the routers too).
        left = urls[0]
        router.remove_worker(left)
        again = rollout(inventory, image)
        assert again.returncode == 0, again.stderr[-4000:]
        assert {h["outcome"] for h in json.loads(again.stdout)["hosts"]} == {"unchanged"}
        assert sorted(router.list_workers()) == urls
        assert "put back in router" in again.stderr, again.stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        router.transport.client.close()  # type: ignore[attr-defined]


# --- faults at the router while a replica is out of it -----------------------------------------------------------
# The progress lines go to stderr through rich, which wraps at 80 columns off a terminal: wide, so a line stays one.
WIDE = {**os.environ, "COLUMNS": "400"}


def ssh_sessions(pid: int, address: str) -> list[str]:
    """The local ports of process `pid`'s SSH connections to address:22, as ss lists them."""
    listed = subprocess.run(
        ["ss", "-tnpH", "state", "established", "dst", address, "dport", "=", ":22"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split()[2].rsplit(":", 1)[1] for line in listed.splitlines() if f"pid={pid}," in line]


def netns(rfleet: Fleet, host, *argv: str) -> subprocess.CompletedProcess[str]:
    """A command of this machine's own in the test host's network namespace only (its firewall, its sockets)."""
    from gpufleet.sandbox.hosts import leader_pid

    return subprocess.run(
        ["nsenter", "-t", str(leader_pid(rfleet.state, host)), "-n", "--", *argv],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )


def test_the_routers_ssh_cut_after_a_replica_left_it_is_one_line_and_the_replica_rejoins(rfleet, inventory):
    # The rollout's own SSH connection to the router host is reset (ss -K: the kernel aborts the socket and sends
    # the router host a RST, as a NAT or firewall dropping the flow would) a second after the first replica left the
    # router's worker set, while it swaps. Then, going back, the router host refuses the controller's SSH (a
    # firewall rule in its netns, REJECT with a reset) from the first leave to the end of the run.
    urls = sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    host = router_host(rfleet)
    router = connect_router(rfleet)
    try:
        assert sorted(router.list_workers()) == urls
        proc = subprocess.Popen(
            [GPUFLEET, "rollout", str(inventory), "--image", f"{rfleet.cfg.registry}/{REPOSITORY}:good-next", "--yes"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=WIDE,
        )
        out = wait_until_one_leaves(router, urls, proc)
        time.sleep(1)  # its leave (the drain's metrics read, the members file) is over: the swap is under way
        ports = ssh_sessions(proc.pid, host.ip)
        assert len(ports) == 1, ports  # one session per router: worker API, members file and lock all ride it
        killed = subprocess.run(
            [
                "ss",
                "-K",
                "-tnH",
                "state",
                "established",
                "dst",
                host.ip,
                "dport",
                "=",
                ":22",
                "sport",
                "=",
                f":{ports[0]}",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        print(f"cut with {out} out of the router: {killed.stdout.strip()}")
        stdout, stderr = proc.communicate(timeout=900)
        print(stderr[-3000:])
        assert "Traceback" not in stderr and "Traceback" not in stdout
        broke = [line for line in stderr.splitlines() if "SSH session broke" in line]
        assert broke == [f"{host.name}: the router's SSH session broke; reached it again, its lock taken again"], (
            stderr[-3000:]
        )
        assert proc.returncode == 0, stderr[-3000:]
        for h in replicas(rfleet):  # the outcome table
            assert re.search(rf"{h.name}\s.*updated", stdout), stdout
        assert sorted(router.list_workers()) == urls  # rejoined in the same run, over the new session

        # The router stays out of reach from the first leave to the end: the replica it let go stays out (it was
        # swapped, but the router did not take it back), the rollout stops there with one line for the router and
        # the table; the next run, with the router back, puts it back and swaps the rest.
        rule = ["-s", rfleet.cfg.gateway, "-p", "tcp", "--dport", "22", "-j", "REJECT", "--reject-with", "tcp-reset"]
        image = f"{rfleet.cfg.registry}/{REPOSITORY}:good"
        proc = subprocess.Popen(
            [GPUFLEET, "rollout", str(inventory), "--image", image, "--yes", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=WIDE,
        )
        blocked = False
        try:
            out = wait_until_one_leaves(router, urls, proc)
            time.sleep(1)  # its leave is over: the swap is under way
            netns(rfleet, host, "iptables", "-I", "INPUT", *rule)
            blocked = True
            stdout, stderr = proc.communicate(timeout=900)
        finally:
            if blocked:
                netns(rfleet, host, "iptables", "-D", "INPUT", *rule)
        print(stdout[-3000:], stderr[-3000:])
        assert "Traceback" not in stderr and "Traceback" not in stdout
        assert proc.returncode != 0
        [left] = [h.name for h in replicas(rfleet) if f"http://{h.ip}:5000" in out]
        outcomes = {h["host"]: h for h in json.loads(stdout)["hosts"]}  # the --json document
        assert outcomes[left]["outcome"] == "failed", outcomes
        assert f"did not rejoin router {host.name}: " in outcomes[left]["detail"], outcomes
        assert {o["outcome"] for name, o in outcomes.items() if name != left} == {"not-started"}, outcomes
        unreachable = [line for line in stderr.splitlines() if f"router {host.name}: worker list:" in line]
        assert len(unreachable) == 1, stderr[-3000:]
        router.transport.client.close()  # type: ignore[attr-defined]  # the block reset it too
        router = connect_router(rfleet)
        assert set(urls) - set(router.list_workers()) == out
        # The router host never saw the link go (the reject answered the controller, not it): the lock's shell there
        # holds the lock until its lease runs out without heartbeats, and a run meanwhile is refused naming it.
        started = time.monotonic()
        while rfleet.run_in(host, f"flock -n -E 75 {LOCK_PATH} true", check=False).returncode == 75:
            assert time.monotonic() - started < 150, "the lock outlived its lease"
            time.sleep(2)
        print(f"the blocked run's lock on {host.name} went {time.monotonic() - started:.0f} s after the run")
        again = rollout(inventory, image)
        assert again.returncode == 0, again.stderr[-3000:]
        assert {h["outcome"] for h in json.loads(again.stdout)["hosts"]} <= {"updated", "unchanged"}
        assert "put back in router" in again.stderr, again.stderr[-3000:]
        assert sorted(router.list_workers()) == urls
    finally:
        router.transport.client.close()  # type: ignore[attr-defined]


NAN_PORT = 29001  # beside the router's own metrics port (router_metrics_port, 29000)
NAN_METRICS = r"""
import http.server, sys, urllib.request
real, urls, log = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
FAMILY = "vllm_router_running_requests"

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        text = urllib.request.urlopen(real, timeout=5).read().decode()
        kept = [line for line in text.splitlines() if not line.startswith(FAMILY) and FAMILY not in line.split()[:3]]
        body = "\n".join(kept + [f"# TYPE {FAMILY} gauge"] + [f'{FAMILY}{{worker="{u}"}} NaN' for u in urls]) + "\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())
        with open(log, "a") as f:
            f.write("GET\n")

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[4])), Handler).serve_forever()
"""


def test_a_router_whose_metrics_say_nan_is_one_line_and_every_replica_rejoins(rfleet, inventory, tmp_path):
    # vllm-router 0.1.17's series are counts (requests, running requests, decisions, worker health, circuit state)
    # and a histogram with buckets: none is a ratio, so it has no NaN to give. Its exposition, read live, with every
    # running-requests sample NaN (one per replica) is served beside it on the router host; the rollout's inventory
    # points router_metrics_port there, the setting gpufleet reads the router's metrics at.
    urls = sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    host = router_host(rfleet)
    ((_, data),) = pyinfra_hosts(rfleet.cfg.state_dir / "inventory.json", routers=True)
    real = f"http://127.0.0.1:{router_settings(data)['router_metrics_port']}/metrics"
    rfleet.run_in(host, f"cat > /tmp/gf-nan-metrics.py <<'EOF'\n{NAN_METRICS}\nEOF\n: > /tmp/gf-nan-metrics.log")
    pid = rfleet.run_in(
        host,
        f"nohup python3 /tmp/gf-nan-metrics.py {real} {','.join(urls)} /tmp/gf-nan-metrics.log "
        f"{NAN_PORT} >/tmp/gf-nan-metrics.out 2>&1 </dev/null & echo $!",
    ).stdout.strip()
    doc = rfleet.cfg.state_dir / "inventory.json"
    nan_inventory = tmp_path / "inventory.py"
    nan_inventory.write_text(
        "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
        f"gpuhosts = [(n, {{**{TEST_DATA!r}, **d}}) for n, d in pyinfra_hosts({str(doc)!r})]\n"
        f"routers = [(n, {{**d, 'router_metrics_port': {NAN_PORT}}}) for n, d in pyinfra_hosts({str(doc)!r}, "
        "routers=True)]\n"
    )
    try:
        for _ in range(50):
            served = rfleet.run_in(
                host,
                "python3 -c 'import urllib.request; print(urllib.request.urlopen("
                f'"http://127.0.0.1:{NAN_PORT}/metrics", timeout=5).read().decode())\'',
                check=False,
            )
            if served.returncode == 0:
                break
            time.sleep(0.2)
        assert f'vllm_router_running_requests{{worker="{urls[0]}"}} NaN' in served.stdout, served
        assert "vllm_router_requests_total" in served.stdout  # the rest is the real router's
        rfleet.run_in(host, ": > /tmp/gf-nan-metrics.log")
        proc = rollout(nan_inventory, f"{rfleet.cfg.registry}/{REPOSITORY}:good-next", env=WIDE)
        print(proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr
        assert proc.returncode == 0, proc.stderr[-3000:]
        doc_out = json.loads(proc.stdout)  # the --json document
        assert {h["host"]: h["outcome"] for h in doc_out["hosts"]} == {h.name: "updated" for h in replicas(rfleet)}
        said = [line for line in proc.stderr.splitlines() if "not a number" in line]
        assert len(said) == 1 and said[0].startswith(f"{host.name}: the router's metrics gave 3 sample(s)"), (
            proc.stderr[-3000:]
        )
        reads = rfleet.run_in(host, "cat /tmp/gf-nan-metrics.log").stdout.split()
        assert len(reads) >= 3, reads  # each leave's drain read them
        assert sorted(router_workers(rfleet)) == urls
    finally:
        rfleet.run_in(host, f"kill {pid}", check=False)


def ledger_and_image(rfleet: Fleet, host) -> tuple[dict, str]:
    """The replica's ledger and the image its vLLM container runs ("" when none runs), in one look."""
    out = rfleet.run_in(
        host,
        "cat /var/lib/gpufleet/vllm-qwen35.json; echo @@; docker ps --filter "
        "label=gpufleet.vllm-qwen35 --no-trunc --format '{{.Image}}'",
    ).stdout
    ledger, _, image = out.partition("@@")
    return json.loads(ledger), image.strip()


def test_two_replicas_a_rollout_killed_while_its_canary_verifies_is_settled_by_the_rerun(rfleet, inventory, tmp_path):
    # The fleet's first two replicas in an inventory of their own: its third is then a worker the router holds that
    # is no replica of that inventory. Measured before: the re-run refused at its capacity check ("swapping gfr2 at
    # once would leave it no replica in service") and the canary stayed out of the router.
    first, second, third = replicas(rfleet)
    urls = sorted(f"http://{h.ip}:5000" for h in (first, second))
    foreign = f"http://{third.ip}:5000"
    doc = rfleet.cfg.state_dir / "inventory.json"
    two = tmp_path / "two.py"
    two.write_text(
        "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
        f"gpuhosts = [(n, {{**{TEST_DATA!r}, **d}}) for n, d in pyinfra_hosts({str(doc)!r}) if n in "
        f"{(first.name, second.name)!r}]\n"
        f"routers = pyinfra_hosts({str(doc)!r}, routers=True)\n"
    )

    def status(inv: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [GPUFLEET, "status", str(inv), *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=WIDE
        )

    # Reported, then removed by `status --fix`.
    seen = status(two)
    assert (
        seen.returncode == 1
        and f"worker {foreign} is not a replica of the inventory (fix: `gpufleet status {two} --fix` removes it)"
        in seen.stdout
    ), seen.stdout[-3000:]
    fixed = status(two, "--fix")
    assert fixed.returncode == 0, fixed.stdout[-3000:] + fixed.stderr[-3000:]
    assert f"{router_host(rfleet).name}: removed {foreign}: no replica of the inventory" in fixed.stderr, fixed.stderr
    assert sorted(router_workers(rfleet)) == urls

    image = f"{rfleet.cfg.registry}/{REPOSITORY}:good"
    proc = subprocess.Popen(
        [GPUFLEET, "rollout", str(two), "--image", image, "--yes", "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        # Killed while the canary verifies: its new version pending in the ledger and running.
        deadline = time.monotonic() + 300
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "the canary never ran its pending version"
            ledger, running = ledger_and_image(rfleet, first)
            if ledger.get("pending") and running.endswith(ledger["pending"]["ref"].rpartition("@")[2]):
                break
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert router_workers(rfleet) == [f"http://{second.ip}:5000"]  # the canary left the router, and stays out
    assert ledger_and_image(rfleet, first)[0]["pending"] is not None

    resumed = subprocess.run(
        [GPUFLEET, "rollout", str(two), "--image", image, "--yes", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env=WIDE,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rows = {h["host"]: h["outcome"] for h in json.loads(resumed.stdout)["hosts"]}
    assert rows == {first.name: "updated", second.name: "updated"}, rows
    assert sorted(router_workers(rfleet)) == urls

    # The whole inventory's `status --fix` puts the third replica back (committed, ready).
    fixed = status(inventory, "--fix")
    assert f"{third.name}: put back in router {router_host(rfleet).name}" in fixed.stderr, fixed.stderr
    assert fixed.returncode == 0, fixed.stdout[-3000:]
    assert sorted(router_workers(rfleet)) == sorted([*urls, foreign])


# --- GPU health: a replica whose GPU needs a reset leaves the worker set until it is healthy again ------------------
def test_a_replica_whose_gpu_fails_leaves_the_worker_set_and_rejoins_once_healthy(rfleet, inventory):
    # Every replica on the target first (the tests before leave them on several): the rollout with the fault then
    # swaps nothing and reconciles the routers, as it does at the start and the end of every run
    # (gpufleet.rollout.membership).
    urls = sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    sick = replicas(rfleet)[1]
    image = f"{rfleet.cfg.registry}/{REPOSITORY}:good-next"
    on_target = rollout(inventory, image, env=WIDE)
    assert on_target.returncode == 0, on_target.stderr[-3000:]
    assert sorted(router_workers(rfleet)) == urls
    gpu_faults.inject(sick.root, 0, "reset-required")
    try:
        out = rollout(inventory, image, env=WIDE)
        assert out.returncode == 0, out.stderr[-3000:]
        assert {h["outcome"] for h in json.loads(out.stdout)["hosts"]} == {"unchanged"}
        assert sorted(router_workers(rfleet)) == [u for u in urls if u != f"http://{sick.ip}:5000"]
        assert f"{sick.name}: taken out of router {router_host(rfleet).name}" in out.stderr, out.stderr[-3000:]
    finally:
        gpu_faults.clear(sick.root)
    back = rollout(inventory, image, env=WIDE)
    assert back.returncode == 0, back.stderr[-3000:]
    assert sorted(router_workers(rfleet)) == urls
    assert f"{sick.name}: put back in router {router_host(rfleet).name}" in back.stderr, back.stderr[-3000:]
