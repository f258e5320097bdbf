"""`gpufleet rollout` behind vllm-router: 3 real test-host replicas (stand-in vLLM) and a router host, over SSH,
while a client loop sends requests through the router the whole time. Each replica leaves the router's worker set
before its drain and rejoins after its outcome: the router's clients see no failed request.

The fleet of tests/integration/test_router.py (gf-rtr, 10.213.7.0/24; one module at a time uses it). The rollout's
target is the stand-in tag `good-next` (never moved by any test); the replicas first converge on the inventory's
`nightly` (= `good`), so every run of this module swaps all three.
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

from tests.integration.pyinfra_run import run_deploy
from tests.integration.test_router import (
    GPUFLEET,
    QWEN35,
    REPO,
    ROUTER,
    ROUTER_PORT,
    chat,
    inventory,
    replicas,
    rfleet,
    router_host,
    served_model,
)

from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.image import REPOSITORY
from gpufleet.sandbox.inventory import pyinfra_hosts

__all__ = ["inventory", "rfleet"]  # the fleet and inventory fixtures of test_router.py
CLIENTS = 6


def connect_router(rfleet: Fleet):
    from gpufleet.router import status

    (name, data), = pyinfra_hosts(rfleet.cfg.state_dir / "inventory.json", routers=True)
    return status.connect(name, data)


def router_workers(rfleet: Fleet) -> list[str]:
    router = connect_router(rfleet)
    try:
        return router.list_workers()
    finally:
        router.transport.client.close()  # type: ignore[attr-defined]


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
    whole = subprocess.run([GPUFLEET, "rollout", str(inventory), "--image", f"{registry}/{REPOSITORY}:good-next",
                            "--yes", "--canary", "0", "--batch", "3"], capture_output=True, text=True, timeout=300,
                           cwd=REPO)
    assert whole.returncode != 0 and "would leave it no replica in service" in whole.stderr, whole.stderr[-2000:]
    assert "Traceback" not in whole.stderr
    assert sorted(router_workers(rfleet)) == urls
    with ClientLoop(base, served_model(base)) as clients, WorkerWatch(rfleet, urls) as watch:
        time.sleep(2)
        started = time.monotonic()
        rolling = subprocess.Popen([GPUFLEET, "rollout", str(inventory), "--image",
                                    f"{registry}/{REPOSITORY}:good-next", "--yes", "--json", "--log", str(log)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        # While it runs it holds the router host's lock: a router deploy now is refused, naming the rollout.
        while not watch.ever_out and rolling.poll() is None:
            time.sleep(0.2)
        during = run_deploy(pyinfra, inventory, ROUTER, check=False)
        stdout, stderr = rolling.communicate(timeout=900)
        proc = subprocess.CompletedProcess(rolling.args, rolling.returncode, stdout, stderr)
        seconds = time.monotonic() - started
        time.sleep(2)
    assert during.returncode != 0 and re.search(rf"{router_host(rfleet).name}: locked by \S+ pid {rolling.pid} ",
                                                during.stdout), during.stdout[-3000:]
    print(f"rollout of 3 replicas behind the router: {seconds:.0f} s; client requests: {len(clients.ok)} ok, "
          f"{len(clients.failed)} failed")
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    target = doc["target"]
    assert "@sha256:" in target
    assert {h["host"]: h["outcome"] for h in doc["hosts"]} == {h.name: "updated" for h in replicas(rfleet)}, doc
    assert all(h["to"] == target for h in doc["hosts"])
    assert clients.failed == [], clients.failed[:5]
    assert len(clients.ok) > 50
    # Each replica's ledger commits the new digest, and every replica is back in the router's worker set.
    history = subprocess.run([GPUFLEET, "history", str(inventory), "--json"], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
    assert history.returncode == 0, history.stderr[-2000:]
    for name, entry in json.loads(history.stdout).items():
        assert entry["rows"][0]["state"] == "committed" and entry["rows"][0]["ref"] == target, (name, entry)
    assert sorted(router_workers(rfleet)) == urls
    # Each replica left the router's set for its swap, one at a time (--batch 1).
    assert watch.ever_out == set(urls) and watch.most_out == 1, (watch.ever_out, watch.most_out)


def rollout(inventory, image: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUFLEET, "rollout", str(inventory), "--image", image, "--yes", "--json"],
                          capture_output=True, text=True, timeout=900, cwd=REPO, **kwargs)


def test_a_controller_killed_after_a_replica_left_the_router_strands_nothing(rfleet, inventory):
    # After the test above every replica runs good-next; this rollout goes back to good (committed before, not
    # failed). The controller is killed (SIGKILL, its deploy run dies with it) right after the first replica left
    # the router's worker set: the laptop that died mid-rollout.
    urls = sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    assert sorted(router_workers(rfleet)) == urls
    image = f"{rfleet.cfg.registry}/{REPOSITORY}:good"
    proc = subprocess.Popen([GPUFLEET, "rollout", str(inventory), "--image", image, "--yes", "--json"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    router = connect_router(rfleet)
    try:
        deadline = time.monotonic() + 300
        stranded: set[str] = set()
        while not stranded and time.monotonic() < deadline and proc.poll() is None:
            stranded = set(urls) - set(router.list_workers())
            time.sleep(0.1)
        assert stranded and proc.poll() is None, "the rollout ended before a replica left the router"
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        time.sleep(1)
        assert set(urls) - set(router.list_workers()) == stranded, "the kill must leave the replica out"

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
