"""deploys/router.py on a real GPU-less test host in front of 3 real test-host replicas (stand-in vLLM), over SSH.

Its own fleet (gf-rtr, 10.213.7.0/24), so it never waits on, or clears, the session's test fleet. Order matters:
the replicas converge, then the router; later tests use the running router.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from gpufleet.hostlock import LOCK_PATH
from gpufleet.router import operations, wheels
from gpufleet.router.settings import build_router_spec
from gpufleet.router.spec import MARKER, RouterSpec
from gpufleet.sandbox.config import NO_GPU, FleetConfig, H200x3
from gpufleet.sandbox.fleet import Fleet
from tests import frontdoor
from tests.integration.fleets import own_fleet_config, running_fleet
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.pyinfra_run import run_deploy

REPO = Path(__file__).resolve().parents[2]
QWEN35 = str(REPO / "deploys" / "qwen35.py")
ROUTER = str(REPO / "deploys" / "router.py")
ROUTER_PORT = 8000
GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
# A short soak: no image here dies after ready (test_deploy_rollback proves the soak), and each swap waits it out.
TEST_DATA = {"vllm_ready_timeout": 120, "vllm_ready_soak_s": 2}
# The router host's lease: a run cut off from it frees its lock this long after its last heartbeat (one test waits
# for that).
ROUTER_DATA = {"gpufleet_lock_lease_s": 30}
MEMBERS = "/var/lib/gpufleet-router/vllm-router.workers"


@pytest.fixture(scope="module")
def rfleet_config() -> FleetConfig:
    return own_fleet_config("rtr", "10.213.7", "gfr", "GPUFLEET_ROUTER_FLEET_DIR")


@pytest.fixture(scope="module")
def rfleet(rfleet_config: FleetConfig):
    with running_fleet(rfleet_config) as fleet:
        fleet.add_hosts([H200x3] * 3, first=1)
        fleet.add_hosts([NO_GPU], first=4, role="router")
        yield fleet


@pytest.fixture(scope="module")
def inventory(rfleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    doc = rfleet.write_inventory()
    path = tmp_path_factory.mktemp("router") / "inventory.py"
    path.write_text(
        "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
        f"gpuhosts = [(n, {{**{TEST_DATA!r}, **d}}) for n, d in pyinfra_hosts({str(doc)!r})]\n"
        f"routers = [(n, {{**d, **{ROUTER_DATA!r}}}) for n, d in pyinfra_hosts({str(doc)!r}, routers=True)]\n"
    )
    return path


run = run_deploy


def router_host(rfleet: Fleet):
    return next(h for h in rfleet.hosts() if h.role == "router")


def replicas(rfleet: Fleet):
    return [h for h in rfleet.hosts() if h.role != "router"]


def served_prompt_tokens(rfleet: Fleet, host) -> float:
    """The replica's own count of prompt tokens (vLLM's vllm:prompt_tokens_total): proof it served requests."""
    text = rfleet.run_in(host, "curl -fsS --max-time 5 http://127.0.0.1:5000/metrics").stdout
    return sum(float(m) for m in re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def chat(base: str, model: str, text: str, timeout: float = 30, headers: dict[str, str] | None = None) -> int:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"{base}/v1/chat/completions", body, {"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()
        return resp.status


def test_router_deploys_in_front_of_three_replicas(rfleet, inventory, pyinfra):
    run(pyinfra, inventory, QWEN35)
    proc = run(pyinfra, inventory, ROUTER)
    ops = changed_ops(proc.stdout)
    assert ops.get("Install vllm-router into its venv") == 1 and ops.get("Enable and start vllm-router") == 1, ops
    router = router_host(rfleet)
    unit = rfleet.run_in(router, "cat /etc/systemd/system/vllm-router.service").stdout
    [exec_start] = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert "--policy sticky_least_loaded" in exec_start and "--worker-urls" not in exec_start
    # Its front door keys sessions with Debian's njs module.
    assert rfleet.run_in(router, "nginx -T 2>/dev/null | grep -c '^js_import '").stdout.strip() == "1"
    # The membership lives in the router (its API) and in the file its unit replays after a restart.
    urls = sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    assert sorted(rfleet.run_in(router, f"cat {MEMBERS}").stdout.split()) == urls
    assert live_workers(rfleet) == urls
    # Exactly the lock's wheels, in a venv of their own that the unit's stable path links to.
    s, install = router_spec(rfleet), locked(rfleet)
    assert rfleet.run_in(router, f"readlink {s.venv}").stdout.strip() == s.venv_dir(install.key)
    assert rfleet.run_in(router, f"cat {s.venv}/{MARKER}").stdout.strip() == install.key
    frozen = set(
        rfleet.run_in(router, f"{s.venv}/bin/pip list --format=freeze").stdout.lower().replace("_", "-").split()
    )
    assert {f"{w.name}=={w.version}" for w in install.wheels} <= frozen


def router_spec(rfleet: Fleet) -> RouterSpec:
    from gpufleet.sandbox.inventory import pyinfra_hosts

    ((name, data),) = pyinfra_hosts(rfleet.cfg.state_dir / "inventory.json", routers=True)
    return build_router_spec(name, data, ())


def locked(rfleet: Fleet) -> wheels.LockedInstall:
    router = router_host(rfleet)
    python = rfleet.run_in(router, "python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'").stdout.strip()
    s = router_spec(rfleet)
    return wheels.locked_install(router.name, s.version, python, rfleet.run_in(router, "uname -m").stdout.strip())


def test_second_router_run_changes_nothing(rfleet, inventory, pyinfra):
    proc = run(pyinfra, inventory, ROUTER)
    assert changes(proc.stdout) == 0, changed_ops(proc.stdout)


def test_a_venv_from_before_the_lock_is_switched_to_the_locked_one_then_pruned(rfleet, inventory, pyinfra):
    # A router installed before the lock: router_venv a directory of its own. The next run moves it aside, links
    # the locked venv (whole already here: no reinstall), restarts the router on it, and removes the old one.
    router, s, install = router_host(rfleet), router_spec(rfleet), locked(rfleet)
    rfleet.run_in(router, f"rm {s.venv} && cp -a {s.venv_dir(install.key)} {s.venv}")
    pid = main_pid(rfleet)
    proc = run(pyinfra, inventory, ROUTER)
    ops = changed_ops(proc.stdout)
    assert ops.get("Install vllm-router into its venv") == 1 and ops.get("Enable and start vllm-router") == 1, ops
    assert ops.get("Remove the router's old venvs") == 1, ops
    assert main_pid(rfleet) != pid
    assert rfleet.run_in(router, f"readlink {s.venv}").stdout.strip() == s.venv_dir(install.key)
    assert rfleet.run_in(router, f"ls {s.venvs_dir}").stdout.split() == [install.key[:16]]
    assert live_workers(rfleet) == sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    proc = run(pyinfra, inventory, ROUTER)
    assert changes(proc.stdout) == 0, changed_ops(proc.stdout)


def test_a_wheel_whose_hash_is_not_the_locks_is_refused_and_the_router_keeps_its_venv(rfleet):
    # The deploy's own install commands, from the sandbox's index of the real wheels, with vllm-router's sha256 in
    # the requirements changed by one digit: pip refuses the wheel, the venv is never switched to, nothing restarts.
    router, s, good = router_host(rfleet), router_spec(rfleet), locked(rfleet)
    wheels = tuple(
        w if w.name != "vllm-router" else replace(w, sha256=f"{(int(w.sha256[0], 16) + 1) % 16:x}" + w.sha256[1:])
        for w in good.wheels
    )
    bad = replace(good, wheels=wheels)
    target, pid = s.venv_dir(bad.key), main_pid(rfleet)
    try:
        rfleet.run_in(
            router,
            f"install -d {s.venvs_dir} && python3 -m venv {target} && cat > "
            f"{target}/{operations.REQUIREMENTS} <<'EOF'\n{bad.requirements()}EOF",
        )
        # As the deploy runs it (over SSH): none of this machine's environment (its pip settings) in it.
        clean = f"env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin sh -c {shlex.quote(operations.install_script(s, bad))}"
        proc = rfleet.run_in(router, clean, check=False)
        assert proc.returncode != 0 and "DO NOT MATCH THE HASHES" in proc.stdout + proc.stderr, proc.stderr[-2000:]
        assert rfleet.run_in(router, f"test -e {target}/{MARKER}", check=False).returncode != 0
        assert rfleet.run_in(router, f"readlink {s.venv}").stdout.strip() == s.venv_dir(good.key)
        assert main_pid(rfleet) == pid
    finally:
        rfleet.run_in(router, f"rm -rf {target}")


def test_a_router_host_another_run_holds_is_refused_naming_it(rfleet, inventory, pyinfra):
    router = router_host(rfleet)
    unit = "cat /etc/systemd/system/vllm-router.service; systemctl show -p MainPID vllm-router.service"
    before = rfleet.run_in(router, unit).stdout
    # Another operator's run, as gpufleet.hostlock holds a host: a flock on the lock file, its holder line in it.
    holder = "user=alice controller=laptop pid=4242 since=2026-12-01T03:00:00Z"
    pid = rfleet.run_in(
        router,
        f"setsid bash -c 'exec 9>>{LOCK_PATH}; flock 9; echo {holder} > {LOCK_PATH}; "
        f"exec sleep 300' >/dev/null 2>&1 < /dev/null & echo $!",
    ).stdout.strip()
    try:
        deadline = time.monotonic() + 30
        while holder not in rfleet.run_in(router, f"cat {LOCK_PATH}", check=False).stdout:
            assert time.monotonic() < deadline, "the stand-in holder did not take the lock"
            time.sleep(0.2)
        proc = run(pyinfra, inventory, ROUTER, check=False)
        assert proc.returncode != 0
        assert re.search(r"gfr4: locked by alice@laptop pid 4242 since 2026-12-01T03:00:00Z \(fix: ", proc.stdout), (
            proc.stdout[-3000:]
        )
        assert "Traceback" not in proc.stdout
        assert rfleet.run_in(router, unit).stdout == before
    finally:
        rfleet.run_in(router, f"kill {int(pid)}", check=False)
    proc = run(pyinfra, inventory, ROUTER)  # the holder gone, the next run goes ahead
    assert changes(proc.stdout) == 0, changed_ops(proc.stdout)


def test_a_replica_the_router_cannot_reach_refuses_the_run_naming_it(rfleet, inventory, pyinfra):
    router = router_host(rfleet)
    unit = "cat /etc/systemd/system/vllm-router.service; systemctl show -p MainPID vllm-router.service"
    before = rfleet.run_in(router, unit).stdout
    proc = run(pyinfra, inventory, ROUTER, "--data", "vllm_publish_address=127.0.0.1", check=False)
    assert proc.returncode != 0
    assert re.search(r"gfr1: vllm_publish_address: 127\.0\.0\.1 keeps vLLM off the network.*\(fix: ", proc.stdout), (
        proc.stdout[-3000:]
    )
    assert "Traceback" not in proc.stdout
    assert rfleet.run_in(router, unit).stdout == before


def live_workers(rfleet: Fleet) -> list[str]:
    listed = "curl -fsS --max-time 5 http://127.0.0.1:28000/list_workers"
    return sorted(json.loads(rfleet.run_in(router_host(rfleet), listed).stdout)["urls"])


def main_pid(rfleet: Fleet) -> str:
    return rfleet.run_in(router_host(rfleet), "systemctl show -p MainPID --value vllm-router.service").stdout.strip()


def test_a_router_deploy_with_a_replica_down_neither_rewrites_nor_restarts_the_router(rfleet, inventory, pyinfra):
    router, down = router_host(rfleet), replicas(rfleet)[2]
    base = f"http://{router.ip}:{ROUTER_PORT}"
    model = served_model(base)
    down_url = f"http://{down.ip}:5000"
    pid = main_pid(rfleet)
    rfleet.run_in(down, "systemctl stop vllm-qwen35")
    try:
        # The router's own health checks take it out of routing first (what it does without gpufleet).
        health = "curl -fsS --max-time 5 http://127.0.0.1:28000/workers"
        deadline = time.monotonic() + 90
        while any(
            w["url"] == down_url and w["is_healthy"]
            for w in json.loads(rfleet.run_in(router, health).stdout)["workers"]
        ):
            assert time.monotonic() < deadline, "the router never saw the stopped replica as unhealthy"
            time.sleep(1)
        failed: list[str] = []
        ok: list[int] = []
        stop = threading.Event()

        def client(k: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    ok.append(chat(base, model, f"agent {k} turn {i}", headers={"X-Session-ID": f"down-{k}"}))
                except (urllib.error.URLError, OSError) as error:
                    failed.append(f"agent {k} turn {i}: {error}")

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
        for th in threads:
            th.start()
        try:
            proc = run(pyinfra, inventory, ROUTER)
        finally:
            stop.set()
            for th in threads:
                th.join(timeout=40)
        assert "left out of the router's workers (not ready)" in proc.stdout
        ops = changed_ops(proc.stdout)
        assert "Install the vllm-router systemd unit" not in ops and "Enable and start vllm-router" not in ops, ops
        assert main_pid(rfleet) == pid  # not restarted: no open stream was cut
        assert failed == [], failed[:5]
        assert len(ok) > 10
        assert down_url not in live_workers(rfleet)
        assert down_url not in rfleet.run_in(router, f"cat {MEMBERS}").stdout
    finally:
        rfleet.run_in(down, "systemctl start vllm-qwen35")
        rfleet.run_in(
            down,
            "for i in $(seq 120); do curl -fs -o /dev/null --max-time 2 "
            "http://127.0.0.1:5000/health && exit 0; sleep 0.5; done; exit 1",
        )
    # Ready again: the next router deploy adds it back through the router's API, still without a restart.
    proc = run(pyinfra, inventory, ROUTER)
    assert main_pid(rfleet) == pid
    assert down_url in live_workers(rfleet) and down_url in rfleet.run_in(router, f"cat {MEMBERS}").stdout


def test_a_restarted_router_comes_back_with_its_members(rfleet, inventory):
    # A reboot or a crash of the router: no gpufleet run follows, the unit replays its members file itself.
    before = live_workers(rfleet)
    assert len(before) == 3
    rfleet.run_in(router_host(rfleet), "systemctl restart vllm-router.service")
    deadline = time.monotonic() + 60
    while live_workers_or_none(rfleet) != before:
        assert time.monotonic() < deadline, live_workers_or_none(rfleet)
        time.sleep(0.5)


def live_workers_or_none(rfleet: Fleet) -> list[str] | None:
    try:
        return live_workers(rfleet)
    except Exception:  # still starting
        return None


def served_model(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def test_requests_through_the_router_succeed(rfleet, inventory):
    router = router_host(rfleet)
    base = f"http://{router.ip}:{ROUTER_PORT}"
    model = served_model(base)
    before = sum(served_prompt_tokens(rfleet, h) for h in replicas(rfleet))
    codes = [chat(base, model, f"conversation {i}: " + "lorem ipsum " * (5 + i)) for i in range(12)]
    assert codes == [200] * 12
    assert sum(served_prompt_tokens(rfleet, h) for h in replicas(rfleet)) > before


def test_clients_reach_the_client_api_only_and_the_router_runs_unprivileged(rfleet, inventory):
    # vllm-router serves its worker management API on the port it listens on, without authentication: from the LAN
    # anyone could empty its worker set or add a worker of their own and receive every client's prompts and key.
    router, neighbour = router_host(rfleet), replicas(rfleet)[0]
    base = f"http://{router.ip}:{ROUTER_PORT}"

    def from_neighbour(method: str, url: str) -> str:
        return rfleet.run_in(
            neighbour,
            f"curl -s --path-as-is -o /dev/null -w '%{{http_code}}' -X {method} --max-time 10 '{url}'",
            check=False,
        ).stdout.strip()

    workers = sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    listed = "curl -fsS --max-time 5 http://127.0.0.1:28000/list_workers"
    assert sorted(json.loads(rfleet.run_in(router, listed).stdout)["urls"]) == workers
    for method, path in [
        ("POST", f"/remove_worker?url={workers[0]}"),
        ("POST", "/add_worker?url=http://10.213.7.99:5000"),
        ("GET", "/list_workers"),
        ("GET", "/workers"),
        ("GET", "/metrics"),
        ("POST", f"/v1/../remove_worker?url={workers[1]}"),
        ("POST", f"/v1/%2e%2e/remove_worker?url={workers[1]}"),
    ]:
        assert from_neighbour(method, base + path) == "404", (method, path)
    # The router's own port is on its loopback: nothing answers there from the LAN.
    assert from_neighbour("GET", f"http://{router.ip}:28000/list_workers") == "000"
    # Nothing changed, and clients still get their API.
    assert sorted(json.loads(rfleet.run_in(router, listed).stdout)["urls"]) == workers
    assert from_neighbour("GET", base + "/health") == "200" and from_neighbour("GET", base + "/v1/models") == "200"
    assert chat(base, served_model(base), "through the front door") == 200
    # The router process: a user systemd made for it, not root.
    user = rfleet.run_in(router, "ps -o user= -p $(systemctl show -p MainPID --value vllm-router.service)").stdout
    assert user.strip() not in ("", "root"), user


def as_nobody(rfleet: Fleet, method: str, path: str) -> int:
    """curl's exit status for a request to the router's own port by an unprivileged local user of the router host
    (7: the connection was refused; 0: it was answered)."""
    return rfleet.run_in(
        router_host(rfleet),
        f"setpriv --reuid=nobody --regid=nogroup --clear-groups curl -s -o "
        f"/dev/null --max-time 5 -X {method} 'http://127.0.0.1:28000{path}'",
        check=False,
    ).returncode


def test_a_local_user_cannot_reach_the_worker_api_and_gpufleet_and_clients_still_do(rfleet, inventory, pyinfra):
    # Without the fence, nobody's /add_worker of a listener of theirs got them client prompts and API keys, and
    # /remove_worker an outage. Now each is refused at the connection (a reset: curl's exit 7).
    router, stranger = router_host(rfleet), "http://10.213.7.99:5000"
    urls = sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    for method, path in [
        ("POST", f"/add_worker?url={stranger}"),
        ("POST", f"/remove_worker?url={stranger}"),
        ("GET", "/list_workers"),
        ("GET", "/v1/models"),
    ]:
        assert as_nobody(rfleet, method, path) == 7, (method, path)
    assert live_workers(rfleet) == urls
    # gpufleet's own calls (as root on the host, over the deploy user's SSH) and clients through nginx still work.
    proc = subprocess.run([GPUFLEET, "status", str(inventory), "--json"], capture_output=True, text=True, timeout=120)
    (row,) = json.loads(proc.stdout)["routers"]
    assert proc.returncode == 0 and row["fenced"] is True and sorted(w["url"] for w in row["workers"]) == urls, row
    base = f"http://{router.ip}:{ROUTER_PORT}"
    assert chat(base, served_model(base), "through the fenced front door") == 200
    # The ruleset flushed under the running router (an nftables.service reload): verify names it, and the next
    # router deploy loads the fence again without restarting the router.
    pid = main_pid(rfleet)
    rfleet.run_in(router, "nft flush ruleset")
    assert as_nobody(rfleet, "GET", "/list_workers") == 0
    proc = verify_cli(inventory, "--host", router.name)
    assert (
        proc.returncode == 1 and f"{router.name}: the router's worker API is open to every local user" in proc.stdout
    ), proc.stdout
    proc = run(pyinfra, inventory, ROUTER)
    assert changed_ops(proc.stdout) == {"Fence the router's port to root and nginx (nftables)": 1}, changed_ops(
        proc.stdout
    )
    assert main_pid(rfleet) == pid and as_nobody(rfleet, "GET", "/list_workers") == 7


def post(base: str, body: bytes | dict, headers: dict[str, str] | None = None, timeout: float = 60) -> int:
    """The HTTP status of a POST to the chat API through the front door (an error status included)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(
        f"{base}/v1/chat/completions", data, {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def served_by(rfleet: Fleet, request) -> str:
    """The replica that served `request()` (alone in flight), by the replicas' own prompt token counts."""
    before = {h.name: served_prompt_tokens(rfleet, h) for h in replicas(rfleet)}
    assert request() == 200
    after = {h.name: served_prompt_tokens(rfleet, h) for h in replicas(rfleet)}
    (name,) = [n for n in before if after[n] > before[n]]
    return name


def test_the_front_door_keys_a_session_only_when_the_client_names_none(rfleet, inventory):
    # The default policy, sticky_least_loaded, behind the front door's session key. A restart empties the router's
    # session table, so the new sessions below are placed by count alone.
    router = router_host(rfleet)
    base = f"http://{router.ip}:{ROUTER_PORT}"
    model = served_model(base)
    before = live_workers(rfleet)
    since = rfleet.run_in(router, "date +%s").stdout.strip()
    rfleet.run_in(router, "systemctl restart vllm-router.service")
    deadline = time.monotonic() + 60
    while live_workers_or_none(rfleet) != before:
        assert time.monotonic() < deadline, live_workers_or_none(rfleet)
        time.sleep(0.5)
    # Three agents sharing one long system prompt, no X-Session-ID: each keeps one replica for all its turns, and
    # the three sessions take one replica each.
    system = {"role": "system", "content": "You are a coding agent in this repository. " * 40}
    placed, keys = [], []
    for k in range(3):
        messages = [system, {"role": "user", "content": f"agent {k}: make the tests pass"}]
        keys.append(frontdoor.expected_key({"messages": messages}))
        turns = []
        for turn in range(3):
            body = {"model": model, "messages": list(messages), "max_tokens": 4}
            turns.append(served_by(rfleet, lambda body=body: post(base, body)))
            messages += [{"role": "assistant", "content": "done"}, {"role": "user", "content": f"turn {turn}"}]
        assert len(set(turns)) == 1, (k, turns)
        placed.append(turns[0])
    assert sorted(placed) == sorted(h.name for h in replicas(rfleet)), placed
    # The client's own X-Session-ID wins: no key is derived for it, and a new opening under it keeps its replica.
    mine = {"X-Session-ID": "client-7"}
    first = served_by(
        rfleet,
        lambda: post(
            base, {"model": model, "messages": [system, {"role": "user", "content": "client 7"}], "max_tokens": 4}, mine
        ),
    )
    other_opening = {"model": model, "messages": [{"role": "user", "content": "another opening"}], "max_tokens": 4}
    assert served_by(rfleet, lambda: post(base, other_opening, mine)) == first
    journal = rfleet.run_in(router, f"journalctl -u vllm-router.service --since @{since} -o cat --no-pager").stdout
    sessions = re.findall(r"SLL: new session '([^']*)'", journal)
    assert sessions == [*keys, "client-7"], sessions
    # Bodies the front door cannot key are still answered, each in a bound time: not JSON (the router's or vLLM's
    # 4xx), a body over the in-memory buffer (kept in a file), a body cut short (the connection closed).
    assert 400 <= post(base, b"not json {") < 500
    big = {"model": model, "messages": [{"role": "user", "content": "x" * (12 << 20)}], "max_tokens": 4}
    assert post(base, big, timeout=120) in (200, 400, 413)
    with socket.create_connection((router.ip, ROUTER_PORT), timeout=30) as conn:
        conn.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model": ')
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(65536) == b""
    assert (
        post(base, {"model": model, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}) == 200
    )


def test_consistent_hash_spreads_sessions_over_every_replica(rfleet, inventory, pyinfra):
    # A policy change rewrites the unit and restarts the router (and only the router).
    proc = run(pyinfra, inventory, ROUTER, "--data", "router_policy=consistent_hash")
    assert changed_ops(proc.stdout).get("Enable and start vllm-router") == 1, changed_ops(proc.stdout)
    router = router_host(rfleet)
    base = f"http://{router.ip}:{ROUTER_PORT}"
    model = served_model(base)
    before = {h.name: served_prompt_tokens(rfleet, h) for h in replicas(rfleet)}
    # 30 sessions hashed over 3 workers: the chance one worker gets none is 3 * (2/3)^30, about 1e-5.
    codes = [chat(base, model, f"session {i} turn 1", headers={"X-Session-ID": f"agent-{i}"}) for i in range(30)]
    assert codes == [200] * 30
    after = {h.name: served_prompt_tokens(rfleet, h) for h in replicas(rfleet)}
    assert all(after[n] > before[n] for n in before), (before, after)


def test_status_shows_the_router_and_its_workers(rfleet, inventory):
    proc = subprocess.run([GPUFLEET, "status", str(inventory), "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    (router,) = doc["routers"]
    assert router["state"] == "ready" and router["policy"] == "consistent_hash" and router["ok"] is True
    assert sorted(w["url"] for w in router["workers"]) == sorted(f"http://{h.ip}:5000" for h in replicas(rfleet))
    assert all(w["healthy"] for w in router["workers"])
    assert sum(w["routed"] for w in router["workers"]) >= 30
    assert {r["host"] for r in doc["hosts"]} == {h.name for h in replicas(rfleet)} and doc["ok"] is True


def test_replica_leaves_restarts_and_rejoins_with_zero_failed_requests(rfleet, inventory):
    from gpufleet.router import status, workers
    from gpufleet.sandbox.inventory import pyinfra_hosts

    router_h = router_host(rfleet)
    base = f"http://{router_h.ip}:{ROUTER_PORT}"
    model = served_model(base)
    ok, failed, stop = [], [], threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                chat(base, model, f"agent {k} turn {i}", headers={"X-Session-ID": f"loop-{k}"})
                ok.append(k)
            except (urllib.error.URLError, OSError) as error:
                failed.append(f"agent {k} turn {i}: {error}")

    # Enough sessions that every replica carries some of the loop's traffic.
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
    for th in threads:
        th.start()
    ((name, data),) = pyinfra_hosts(rfleet.cfg.state_dir / "inventory.json", routers=True)
    router = status.connect(name, data)
    try:
        time.sleep(2)
        for replica in replicas(rfleet):
            url = f"http://{replica.ip}:5000"
            drained = workers.leave(router, url, drain_timeout_s=30)
            assert url not in router.list_workers() and drained < 30
            rfleet.run_in(replica, "systemctl restart vllm-qwen35")
            rfleet.run_in(
                replica,
                "for i in $(seq 120); do curl -fs -o /dev/null --max-time 2 "
                "http://127.0.0.1:5000/health && exit 0; sleep 0.5; done; exit 1",
            )
            workers.join(router, url)
            assert url in router.list_workers()
        time.sleep(2)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=40)
        router.transport.client.close()  # type: ignore[attr-defined]
    assert failed == [], failed[:5]
    assert len(ok) > 50


def verify_cli(inventory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUFLEET, "verify", str(inventory), *args], capture_output=True, text=True, timeout=300)


def test_verify_checks_the_router_and_names_the_replica_it_lost(rfleet, inventory):
    # Last in the module: it stops one replica's vLLM and leaves the fleet as it found it (the replica ready and
    # healthy in the router again), checked by verify itself.
    proc = verify_cli(inventory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "routers" in proc.stdout
    router, gone = router_host(rfleet), replicas(rfleet)[1]
    url = f"http://{gone.ip}:5000"
    rfleet.run_in(gone, "systemctl stop vllm-qwen35")
    try:
        # The router finds out at its own health checks (router_health_check_interval_s, several misses in a row).
        start, problems = time.monotonic(), []
        while not problems:
            assert time.monotonic() - start < 120, "the router still calls the stopped replica healthy"
            time.sleep(2)
            proc = verify_cli(inventory, "--host", router.name, "--json")
            (row,) = json.loads(proc.stdout)["routers"]
            problems = row["problems"]
        print(f"the router saw the stopped replica after {time.monotonic() - start:.0f} s: {problems}")
        assert proc.returncode == 1 and row["ok"] is False
        proc = verify_cli(inventory)
        assert proc.returncode == 1
        assert re.search(
            rf"^{router.name}: worker {re.escape(url)} \({gone.name}\) is not (healthy in the router|in "
            r"the router's worker set) \(fix: ",
            proc.stdout,
            re.M,
        ), proc.stdout
        assert re.search(rf"verify failed on 2 of 4 host\(s\): ({gone.name}, {router.name})", proc.stderr), proc.stderr
    finally:
        rfleet.run_in(gone, "systemctl start vllm-qwen35")
    start = time.monotonic()
    proc = verify_cli(inventory, "--wait", "120")  # the replica ready, and healthy in the router again
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"verify --wait passed {time.monotonic() - start:.0f} s after the replica's start")
