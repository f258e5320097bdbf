"""`gpufleet rollout / history / rollback` on three real test hosts (nspawn, SSH, systemd, dockerd, the stand-in
vLLM image), with the hosts' vllm_image on a tag of this module's own that the test moves in the fleet's registry
(a manifest copied through the registry's HTTP API), as a nightly tag moves. Steps in file order (pytest keeps it):

1. converge on the tag (= `good`); move it to `good-next`; roll out: every host updated, never more than one host
   not ready (a background poller), no pull inside a swap; a re-run and a plain converge change nothing;
2. the tag on `rejects-flag`: caught in prepare, no host swapped (same containers);
3. the tag on `dies`: the canary rolled back and serving the old digest, the others untouched, exit 1; `history`
   shows the failure; a plain converge changes nothing; the same with `completions-fail` (up, and every completion
   answers 500), the canary's row naming the answer check, and with the tags each serving check catches (`slow`
   and `stalls-under-load` by the speed check, measured on the canary before and after its swap);
4. the tag back on `good` (an earlier committed digest); the controller killed mid-rollout; the re-run completes
   and no host was started twice;
5. `rollback --host` returns a host to its previous digest, gated;
6. a moved tag is looked up in the registry, nothing pulled before the prompt;
7. the model moves (`--model-revision`, a new commit of the stand-in hub's model): a rollout that does not ask leaves
   it; one that asks has every host download it while its old version serves, all before the canary's swap (the
   hub's access log against each host's journal), and commits it everywhere; with an image that fails its gate,
   the canary's rollback serves the old commit's files again, and a converge gives the hosts that were not swapped
   their old files back without a download.

GPU health, faults injected into the running hosts' stand-ins (gpufleet.sandbox.gpu_faults) and cleared after:
after 1, a GPU throttling for heat is served and warned in `status`, and preflight refuses a converge that would
restart a host onto a GPU pending a row remap (nothing changes) while a converge that restarts nothing goes on;
after 4, a host whose GPU fell off the bus (Xid 79) is skipped by a rollout with one line, another host is the
canary, the two others move, and the exit status is 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpufleet.health.api import get
from gpufleet.remote.ssh import open_ssh
from gpufleet.sandbox import gpu_faults, services
from gpufleet.sandbox import hub as standin_hub
from gpufleet.sandbox.config import H200x3
from gpufleet.sandbox.image import MODEL_REPO, REPOSITORY
from gpufleet.sandbox.registry import move_tag, tag_manifest
from gpufleet.vllm.settings import merged_settings
from gpufleet.vllm.spec import model_label_key
from gpufleet.wire.checks import SERVING_CHECKS
from tests.integration.fleets import module_tag, own_fleet_config, running_fleet, tagged_inventory
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.pyinfra_run import run_deploy

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = str(REPO_ROOT / "deploys" / "qwen35.py")
GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
SERVICE = "vllm-qwen35"
PORT = 5000
# The stand-in is ready in seconds. A short soak for every swap; `dies` dies 8 s after serving: its rollout's 15 s
# soak catches it (DIES_SOAK).
DATA = {"vllm_ready_timeout": 90, "vllm_ready_soak_s": 3}
DIES_SOAK = {"vllm_ready_soak_s": 15}


# --- helpers ---------------------------------------------------------------------------------------------------
def gpufleet(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUFLEET, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


def rollout_json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.stdout.strip(), proc.stderr[-4000:]
    return json.loads(proc.stdout)


def outcomes(doc: dict) -> dict[str, str]:
    return {h["host"]: h["outcome"] for h in doc["hosts"]}


def sh(fleet, host, command: str) -> str:
    return fleet.run_in(host, command).stdout


def container_id(fleet, host) -> str:
    return sh(fleet, host, f"docker ps -q --no-trunc --filter label=gpufleet.{SERVICE}").strip()


def running_image(fleet, host) -> str:
    cid = container_id(fleet, host)
    return sh(fleet, host, f"docker inspect --format '{{{{.Config.Image}}}}' {cid}").strip() if cid else ""


def starts_since(fleet, host, since: float) -> int:
    """How many times systemd started the service since `since` (epoch seconds)."""
    out = sh(
        fleet, host, f"journalctl -u {SERVICE} --since @{int(since)} -o cat --no-pager | grep -c '^Started ' || true"
    )
    return int(out.strip() or 0)


class ReadinessPoller:
    """Every host's /health through its SSH session, every 0.2 s, in a thread: the most hosts not ready at once."""

    def __init__(self, names: list[str], data: dict[str, dict]):
        self.sessions = {n: open_ssh(n, data[n]) for n in names}
        self.max_down, self.samples, self.down_sets = 0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _ready(self, name: str) -> bool:
        try:
            return get(self.sessions[name], PORT, "/health", timeout=2)[0] == 200
        except Exception:
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            down = [n for n in self.sessions if not self._ready(n)]
            self.samples += 1
            if down:
                self.down_sets.append(tuple(down))
            self.max_down = max(self.max_down, len(down))
            time.sleep(0.2)

    def __enter__(self) -> ReadinessPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for t in self.sessions.values():
            t.client.close()


def swap_runs(log: Path) -> list[str]:
    """The outputs of the deploy runs that swapped hosts (not the prepare runs), from the rollout's log."""
    runs = re.split(r"^\$ ", log.read_text(), flags=re.MULTILINE)[1:]
    return [
        r
        for r in runs
        if "gpufleet_image_ref=" in r.splitlines()[0] and "gpufleet_stage=prepare" not in r.splitlines()[0]
    ]


# --- fixtures --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet():
    """Its own fleet (gf-roll, 10.213.5.0/24) and registry: it never waits on the session's test fleet, and the
    tags it moves are nobody else's."""
    with running_fleet(own_fleet_config("roll", "10.213.5", "gfo", "GPUFLEET_ROLLOUT_FLEET_DIR")) as f:
        yield f


@pytest.fixture(scope="module")
def hosts(fleet):
    """Three 3x H200 hosts for the module's steps."""
    return fleet.add_hosts([H200x3, H200x3, H200x3], first=1)


@pytest.fixture(scope="module")
def logs(fleet) -> Path:
    """The rollouts' deploy output, kept with the fleet's state for a look after a failure."""
    path = fleet.cfg.state_dir / "rollout-logs"
    shutil.rmtree(path, ignore_errors=True)  # an earlier session's
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def tag() -> str:
    return module_tag("rollout")


@pytest.fixture(scope="module")
def inventory(hosts, fleet, tag, tmp_path_factory) -> Path:
    """A pyinfra inventory of the three hosts, vllm_image on the module's own tag."""
    return tagged_inventory(tmp_path_factory.mktemp("rollout") / "rollout_hosts.py", fleet, hosts, tag, DATA)


@pytest.fixture(scope="module")
def dies_inventory(hosts, fleet, tag, tmp_path_factory) -> Path:
    """The same hosts and tag, with the soak that catches `dies`."""
    return tagged_inventory(
        tmp_path_factory.mktemp("rollout") / "dies_hosts.py", fleet, hosts, tag, {**DATA, **DIES_SOAK}
    )


@pytest.fixture(scope="module")
def host_data(inventory) -> dict[str, dict]:
    from gpufleet.inventory import load_vllm_hosts

    return dict(load_vllm_hosts(inventory))


def converge(pyinfra, inventory: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_deploy(pyinfra, inventory, DEPLOY, *args, check=check)


@pytest.fixture(scope="module")
def digests(fleet, tag, inventory, pyinfra, hosts) -> dict[str, str]:
    """The hosts converged on the module's tag (= good); the digest refs of the stand-in tags."""
    registry = fleet.cfg.registry
    refs = {
        name: f"{registry}/{REPOSITORY}@{tag_manifest(registry, name)[2]}"
        for name in ("good", "good-next", "rejects-flag", "dies")
    }
    assert move_tag(registry, tag, "good") == refs["good"]
    converge(pyinfra, inventory)
    for h in hosts:
        assert running_image(fleet, h) == refs["good"]
    return refs


# --- 1. a good new digest ----------------------------------------------------------------------------------------
def test_good_new_digest_updates_every_host_one_at_a_time(
    fleet, tag, inventory, pyinfra, hosts, digests, host_data, logs
):
    names = [h.name for h in hosts]
    assert move_tag(fleet.cfg.registry, tag, "good-next") == digests["good-next"]
    log = logs / "good.log"
    with ReadinessPoller(names, host_data) as poller:
        proc = gpufleet("rollout", str(inventory), "--yes", "--json", "--log", str(log))
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = rollout_json(proc)
    assert doc["target"] == digests["good-next"]
    assert outcomes(doc) == dict.fromkeys(names, "updated")
    for row in doc["hosts"]:
        assert row["from"] == digests["good"] and row["to"] == digests["good-next"]
        assert row["downtime_s"] is not None and 0 < row["downtime_s"] < 60
    # The canary was held to every serving check its settings apply to; the hosts after it to the answers.
    checks = {row["host"]: [(c["check"], c["ok"]) for c in row["checks"]] for row in doc["hosts"]}
    assert [name for name, _ in checks[names[0]]][:4] == ["completion", "stream", "speed", "prefix-cache"]
    assert {"cached-cold", "sessions"} <= {name for name, _ in checks[names[0]]}
    assert all(ok for _, ok in checks[names[0]]) and all(
        checks[n] == [("completion", True), ("stream", True)] for n in names[1:]
    ), checks
    assert "serving check cached-cold: the same" in log.read_text()
    # Its speed, measured before the swap (good) and after it (good-next, the same stand-in), new against old; kept
    # in its ledger with the committed version, as `history` shows.
    speed = doc["hosts"][0]["speed"]
    assert (
        speed["before"]
        and speed["after"]
        and set(speed["ratios"])
        == {"prefill_tokens_per_s", "cached_ttft_s", "decode_tokens_per_s", "batch_tokens_per_s"}
    )
    assert all(row["speed"] is None for row in doc["hosts"][1:])
    assert "serving check speed: prefill " in log.read_text()
    history = json.loads(gpufleet("history", str(inventory), "--host", names[0], "--json").stdout)
    assert history["hosts"][0]["rows"][0]["speed"] == speed["after"]
    # `verify --checks speed` holds the canary to those figures; the hosts without any are measured, not held.
    verified = gpufleet("verify", str(inventory), "--checks", "speed", "--json")
    assert verified.returncode == 0, verified.stdout[-4000:]
    rows = {row["host"]: row for row in json.loads(verified.stdout)["hosts"]}
    assert rows[names[0]]["speed"]["recorded"] == speed["after"] and rows[names[0]]["checks"][0]["ok"], rows[names[0]]
    assert all(
        rows[n]["speed"]["recorded"] is None
        and rows[n]["checks"][0]["detail"].startswith("no earlier figures on this host to compare: ")
        for n in names[1:]
    ), rows
    for h in hosts:
        assert running_image(fleet, h) == digests["good-next"]
    # Never more than one host (--batch 1) out of service, and each one was out at some point.
    assert poller.samples > 20 and poller.max_down == 1, poller.down_sets
    assert {n for s in poller.down_sets for n in s} == set(names)
    # No pull inside any downtime window: the swap runs pulled nothing (prepare did).
    runs = swap_runs(log)
    assert len(runs) == 3
    for run in runs:
        assert not [op for op in changed_ops(run) if "pull" in op.lower()], run[-3000:]
        assert "Pulling from" not in run
        # ... nor the image's flag check: prepare did it, and the swap run (after the drain) found its note.
        assert "accepted the serve flags in an earlier run" in run
        assert not re.search(r"\] sha256:\w+ accepts the serve flags", run)

    ids = {h.name: container_id(fleet, h) for h in hosts}
    again = gpufleet("rollout", str(inventory), "--yes", "--json")
    assert again.returncode == 0 and outcomes(rollout_json(again)) == dict.fromkeys(names, "unchanged")
    assert "already runs" in again.stderr
    assert changes(converge(pyinfra, inventory).stdout) == 0
    assert {h.name: container_id(fleet, h) for h in hosts} == ids


# --- 1b. GPU health: a degraded GPU serves, a converge that would restart onto a sick one is refused -------------
def test_a_host_whose_gpu_throttles_for_heat_is_served_and_warned_in_status(fleet, inventory, hosts, digests):
    hot = hosts[1]
    gpu_faults.inject(hot.root, 0, "thermal")
    try:
        doc = gpufleet("status", str(inventory), "--json")
        table = gpufleet("status", str(inventory))
    finally:
        gpu_faults.clear(hot.root)
    assert doc.returncode == 0 and table.returncode == 0, doc.stdout[-3000:] + table.stdout[-3000:]
    rows = {row["host"]: row for row in json.loads(doc.stdout)["hosts"]}
    assert rows[hot.name]["ok"] and rows[hot.name]["state"] == "ready" and rows[hot.name]["problems"] == []
    assert {name: row["gpu"]["verdict"] for name, row in rows.items()} == {
        h.name: "degraded" if h is hot else "ok" for h in hosts
    }
    assert (
        f"{hot.name}: warning: GPU 0 (00000000:00:06.0) degraded: clocks_event_reasons.hw_thermal_slowdown "
        "(0x40) at 91 C"
    ) in table.stdout, table.stdout[-3000:]
    assert re.search(rf"│ {hot.name} .*│ degraded: 0 ", table.stdout), table.stdout[-3000:]


def test_preflight_refuses_a_converge_that_would_restart_onto_a_gpu_pending_a_remap(
    fleet, inventory, pyinfra, hosts, digests
):
    host = hosts[2]
    unit = f"/etc/systemd/system/{SERVICE}.service"
    before = (
        container_id(fleet, host),
        fleet.read_file(host, unit),
        fleet.read_file(host, f"/var/lib/gpufleet/{SERVICE}.json"),
    )
    other = digests["good"] if running_image(fleet, host) != digests["good"] else digests["good-next"]
    gpu_faults.inject(host.root, 0, "remap-pending")
    try:
        # Nothing to restart: the converge goes on and says what the GPU needs.
        same = converge(pyinfra, inventory, "--limit", host.name)
        refused = converge(
            pyinfra, inventory, "--limit", host.name, "--data", f"gpufleet_image_ref={other}", check=False
        )
    finally:
        gpu_faults.clear(host.root)
    assert changes(same.stdout) == 0
    assert "GPU 0 (00000000:00:06.0) needs GPU reset: remapped_rows.pending=Yes (the service runs on it)" in same.stdout
    assert refused.returncode != 0 and "nothing was changed on any host" in refused.stdout, refused.stdout[-3000:]
    lines = [line.strip() for line in refused.stdout.splitlines() if "needs GPU reset" in line]
    assert len(lines) == 1 and lines[0].startswith(
        f"{host.name}: GPU 0 (00000000:00:06.0) needs GPU reset: remapped_rows.pending=Yes: this converge would "
        f"restart {SERVICE}.service ("
    ), lines
    assert (
        "(fix: stop the service and reset the GPU (`nvidia-smi -r -i 0`), or reboot the host (NVIDIA: RESET_GPU)"
        in lines[0]
    )
    after = (
        container_id(fleet, host),
        fleet.read_file(host, unit),
        fleet.read_file(host, f"/var/lib/gpufleet/{SERVICE}.json"),
    )
    assert after == before


# --- 2. a flag the new image rejects -----------------------------------------------------------------------------
def test_a_rejected_flag_is_caught_in_prepare_and_no_host_is_swapped(fleet, tag, inventory, hosts, digests):
    ids = {h.name: container_id(fleet, h) for h in hosts}
    move_tag(fleet.cfg.registry, tag, "rejects-flag")
    proc = gpufleet("rollout", str(inventory), "--yes", "--json")
    assert proc.returncode == 1, proc.stderr[-4000:]
    doc = rollout_json(proc)
    assert doc["target"] == digests["rejects-flag"]
    assert set(outcomes(doc).values()) == {"failed-prepare"}  # every host's image check refuses it
    for row in doc["hosts"]:
        assert "--performance-mode" in row["detail"] and digests["rejects-flag"] in row["detail"]
        # Piped, the progress on stderr ends each host on a line that says why, as the JSON's detail does.
        assert f"{row['host']}: failed-prepare: {row['detail']}" in proc.stderr.splitlines(), proc.stderr[-3000:]
    for h in hosts:
        assert container_id(fleet, h) == ids[h.name] and running_image(fleet, h) == digests["good-next"]


# --- 3. an image that starts, then dies ----------------------------------------------------------------------------
def test_a_dying_image_rolls_the_canary_back_and_stops(fleet, tag, inventory, dies_inventory, pyinfra, hosts, digests):
    canary, *others = hosts
    ids = {h.name: container_id(fleet, h) for h in hosts}
    move_tag(fleet.cfg.registry, tag, "dies")
    proc = gpufleet("rollout", str(dies_inventory), "--yes", "--json")
    assert proc.returncode == 1, proc.stderr[-4000:]
    doc = rollout_json(proc)
    assert outcomes(doc) == {canary.name: "rolled-back", **{h.name: "not-started" for h in others}}
    assert running_image(fleet, canary) == digests["good-next"]
    for h in others:
        assert container_id(fleet, h) == ids[h.name]  # untouched: the same container, never restarted

    history = gpufleet("history", str(inventory), "--host", canary.name, "--json")
    assert history.returncode == 0, history.stderr
    (entry,) = json.loads(history.stdout)["hosts"]
    assert entry["host"] == canary.name and entry["ok"] is True
    rows = entry["rows"]
    assert rows[0]["state"] == "committed" and rows[0]["ref"] == digests["good-next"]
    failed = [r for r in rows if r["state"] == "failed"]
    assert [r["ref"] for r in failed] == [digests["dies"]] and failed[0]["detail"]
    table = gpufleet("history", str(inventory), "--host", canary.name)
    assert "failed" in table.stdout and digests["dies"].rsplit("@", 1)[1][:19] in table.stdout

    ids = {h.name: container_id(fleet, h) for h in hosts}
    assert changes(converge(pyinfra, inventory).stdout) == 0  # the failed digest is not tried again
    assert {h.name: container_id(fleet, h) for h in hosts} == ids
    # A rollout of the same digest is refused up front, naming the failure and how to retry on purpose.
    again = gpufleet("rollout", str(inventory), "--yes")
    assert again.returncode == 1 and "--retry-failed" in again.stderr and canary.name in again.stderr


# --- 3b. an image that is up but fails its clients ----------------------------------------------------------------
@pytest.mark.parametrize(("broken_tag", "check", "caught"), [
    ("completions-fail", "completion", "answers: completion: POST /v1/chat/completions answered 500"),
    # Serving checks the canary is held to: answers that change once cached, tool calls that come back as text.
    ("cache-corrupt", "cached-cold", "check cached-cold: the cached answer differs from the cold one"),
    ("tools-broken", "tools", 'check tools: tool_choice "required": no parsed tool call'),
    # Right answers, slower than the version before it on the same host: the figure and both values are named.
    ("slow", "speed", r"check speed: .*prefill \d+ tokens/s, was \d+ \(0\.\d\dx the speed\)"),
    ("stalls-under-load", "speed", r"check speed: 1 of 2 requests sent at once did not finish within \d+ s, while "
                                   r"/health answered 200 all along"),
])  # fmt: skip
def test_an_image_that_fails_its_clients_rolls_the_canary_back_naming_the_check(
    fleet, tag, inventory, hosts, digests, broken_tag, check, caught
):
    # /health, /v1/models and /metrics all pass: only real requests show the nightly is broken.
    canary, *others = hosts
    ids = {h.name: container_id(fleet, h) for h in hosts}
    broken = move_tag(fleet.cfg.registry, tag, broken_tag)
    proc = gpufleet("rollout", str(inventory), "--yes", "--json")
    assert proc.returncode == 1, proc.stderr[-4000:]
    doc = rollout_json(proc)
    assert doc["target"] == broken
    assert outcomes(doc) == {canary.name: "rolled-back", **{h.name: "not-started" for h in others}}
    (row,) = [r for r in doc["hosts"] if r["host"] == canary.name]
    assert re.search(caught, row["detail"]), row
    assert row["checks"][-1] == {"check": check, "ok": False} and all(c["ok"] for c in row["checks"][:-1]), row
    assert running_image(fleet, canary) == digests["good-next"]
    for h in others:
        assert container_id(fleet, h) == ids[h.name]


# --- 4. the controller killed mid-rollout --------------------------------------------------------------------------
def test_a_killed_rollout_resumes_and_no_host_restarts_twice(fleet, tag, inventory, hosts, digests, logs):
    move_tag(fleet.cfg.registry, tag, "good")  # committed before on every host: not marked failed
    since = time.time() - 1
    log = logs / "killed.log"
    proc = subprocess.Popen(
        [GPUFLEET, "rollout", str(inventory), "--yes", "--json", "--log", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    # Killed while the first host swaps: after its restart began (its old container gone).
    first = hosts[0]
    old = container_id(fleet, first)
    deadline = time.monotonic() + 300
    while container_id(fleet, first) in (old, "") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.3)
    assert proc.poll() is None, "the rollout ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)

    resumed = gpufleet("rollout", str(inventory), "--yes", "--json")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert set(outcomes(rollout_json(resumed)).values()) <= {"updated", "unchanged"}
    for h in hosts:
        assert running_image(fleet, h) == digests["good"]
        assert starts_since(fleet, h, since) == 1, h.name


# --- 4b. a GPU that fell off the bus: its host is skipped, another is the canary ------------------------------------
def test_a_host_whose_gpu_fell_off_the_bus_is_skipped_and_another_host_is_the_canary(
    fleet, tag, inventory, hosts, digests
):
    sick, canary, other = hosts  # the canary would be the first host: the one whose GPU fell off the bus
    kept = container_id(fleet, sick)
    move_tag(fleet.cfg.registry, tag, "good-next")  # committed before on every host: not marked failed
    gpu_faults.log_xid(sick.root, 1, 79)
    try:
        proc = gpufleet("rollout", str(inventory), "--yes", "--json")
    finally:
        gpu_faults.clear(sick.root)  # as a reboot leaves it: an empty kernel log
    assert proc.returncode == 1, proc.stderr[-4000:]
    doc = rollout_json(proc)
    assert outcomes(doc) == {sick.name: "skipped", canary.name: "updated", other.name: "updated"}
    rows = {row["host"]: row for row in doc["hosts"]}
    assert re.fullmatch(
        r"GPU 1 \(00000000:00:07\.0\) needs reboot: Xid 79 at \S+ \(GPU has fallen off the bus\.\) "
        r"\(fix: reboot the host \(NVIDIA: RESTART_BM\), then run the rollout again\)",
        rows[sick.name]["detail"],
    ), rows[sick.name]["detail"]
    said = [line for line in proc.stderr.splitlines() if line.startswith(f"{sick.name}: ")]
    assert said == [f"{sick.name}: skipped: {rows[sick.name]['detail']}"], proc.stderr[-3000:]
    # The canary was the next host: held to the serving checks, the host after it to the answers.
    assert "cached-cold" in [c["check"] for c in rows[canary.name]["checks"]]
    assert [c["check"] for c in rows[other.name]["checks"]] == ["completion", "stream"]
    assert container_id(fleet, sick) == kept and running_image(fleet, sick) == digests["good"]
    for h in (canary, other):
        assert running_image(fleet, h) == digests["good-next"]
    # Each swap's ledger entry records the GPU verdict it was made on.
    history = json.loads(gpufleet("history", str(inventory), "--host", canary.name, "--json").stdout)
    assert history["hosts"][0]["rows"][0]["detail"].endswith("; GPU ok"), history


# --- 5. rollback ---------------------------------------------------------------------------------------------------
def test_rollback_returns_a_host_to_its_previous_digest_gated(fleet, inventory, hosts, digests):
    host, *others = hosts
    ids = {h.name: container_id(fleet, h) for h in others}
    proc = gpufleet("rollback", str(inventory), "--host", host.name, "--yes", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = rollout_json(proc)["hosts"]
    assert (row["host"], row["from"], row["to"], row["outcome"]) == (
        host.name,
        digests["good"],
        digests["good-next"],
        "updated",
    )
    assert running_image(fleet, host) == digests["good-next"]
    assert {h.name: container_id(fleet, h) for h in others} == ids


# --- 6. the target: a moved tag is looked up in the registry, nothing pulled before the prompt ----------------------
def test_a_moved_tag_is_looked_up_in_the_registry_and_nothing_is_pulled_before_the_prompt(
    fleet, tag, inventory, hosts, digests
):
    from gpufleet.sandbox.image import TAGS

    registry = fleet.cfg.registry

    def present(host, ref: str) -> bool:
        return fleet.run_in(host, f"docker image inspect {ref} >/dev/null 2>&1", check=False).returncode == 0

    # A stand-in tag whose digest no host has pulled: its image can only get there by a pull.
    fresh = {name: f"{registry}/{REPOSITORY}@{tag_manifest(registry, name)[2]}" for name in TAGS}
    unseen = [name for name, ref in fresh.items() if not any(present(h, ref) for h in hosts)]
    assert unseen, "every stand-in tag's image is on some host already"
    moved = move_tag(registry, tag, unseen[0])
    # COLUMNS: the progress lines are not wrapped; the prompt is answered "n".
    proc = subprocess.run(
        [GPUFLEET, "rollout", str(inventory)],
        input="n\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert proc.returncode == 1 and "not confirmed: nothing was changed" in proc.stderr, proc.stderr[-3000:]
    named = re.search(r"^target: (\S+)", proc.stderr, re.MULTILINE)
    assert named is not None and named[1] == moved, proc.stderr[-3000:]  # the registry's digest for the tag
    assert f"to {moved}? [y/N]" in proc.stderr
    for h in hosts:  # the lookup pulled nothing, anywhere
        assert not present(h, moved), h.name
    # ... and named the digest `docker pull` of the tag pins (RepoDigests).
    first, by_tag = hosts[0], f"{registry}/{REPOSITORY}:{tag}"
    try:
        fleet.run_in(first, f"docker pull -q {by_tag}")
        pinned = json.loads(sh(fleet, first, f"docker image inspect --format '{{{{json .RepoDigests}}}}' {by_tag}"))
        assert moved in pinned, pinned
    finally:
        fleet.run_in(first, f"docker rmi {by_tag}", check=False)


# --- 7. the model moves ----------------------------------------------------------------------------------------------
MODEL_DIR = "{vllm_models_dir}/{vllm_model}".format(**merged_settings({}))
LEDGER = f"/var/lib/gpufleet/{SERVICE}.json"
DOWNLOAD = "Download the model's commit unless it is here and checked"  # the deploy's operation


def next_weights(fleet) -> str:
    """A new commit of the stand-in model on main: its weights' data turned by one byte (still a valid
    safetensors file), the other files as they were; the hub's branch moves to it."""
    root = services.hub_root(fleet.cfg)
    head = standin_hub.resolve(root, MODEL_REPO, "main")
    assert head is not None
    files: dict[str, bytes | Path] = {
        f.path: root / MODEL_REPO / "commits" / head / f.path for f in standin_hub.listing(root, MODEL_REPO, head)
    }
    weights = Path(files["model.safetensors"]).read_bytes()
    start = 8 + struct.unpack("<Q", weights[:8])[0]
    turned = weights[:start] + weights[start + 1 :] + weights[start : start + 1]
    return standin_hub.publish(root, MODEL_REPO, {**files, "model.safetensors": turned})


def hub_offset(fleet) -> int:
    log = services.hub_log(fleet.cfg)
    return log.stat().st_size if log.exists() else 0


def committed_model(fleet, host) -> str | None:
    return json.loads(sh(fleet, host, f"cat {LEDGER}"))["committed"].get("model")


def container_model(fleet, host) -> str:
    label = model_label_key(SERVICE)
    return sh(
        fleet, host, f"docker inspect --format '{{{{index .Config.Labels \"{label}\"}}}}' {container_id(fleet, host)}"
    ).strip()


def holds(fleet, host, commit: str) -> bool:
    """Whether the host's model directory holds exactly the files of `commit` (each hashed there, against the hub's
    copy), and its mark says so."""
    root = services.hub_root(fleet.cfg)
    want = {
        f.path: hashlib.sha256((root / MODEL_REPO / "commits" / commit / f.path).read_bytes()).hexdigest()
        for f in standin_hub.listing(root, MODEL_REPO, commit)
    }
    got = dict(
        reversed(line.split("  ", 1))
        for line in sh(fleet, host, f"cd {MODEL_DIR} && sha256sum {' '.join(sorted(want))}").splitlines()
    )
    return got == want and sh(fleet, host, f"cat {MODEL_DIR}/.gpufleet-model").strip() == f"{MODEL_REPO}@{commit}"


def unit_events(fleet, host, since: float) -> list[tuple[float, str]]:
    """(epoch seconds, systemd's line) for the service since `since`: its stops and starts."""
    out = sh(
        fleet,
        host,
        f"journalctl -u {SERVICE} --since @{int(since) - 1} -o json "
        "--output-fields=MESSAGE,SYSLOG_IDENTIFIER --no-pager",
    )
    events = [json.loads(line) for line in out.splitlines()]
    return [
        (int(e["__REALTIME_TIMESTAMP"]) / 1e6, e["MESSAGE"])
        for e in events
        if e.get("SYSLOG_IDENTIFIER") == "systemd"
        and isinstance(e.get("MESSAGE"), str)
        and int(e["__REALTIME_TIMESTAMP"]) / 1e6 >= since
    ]


def test_a_model_move_is_downloaded_everywhere_before_the_canarys_swap_never_in_a_downtime(
    fleet, inventory, hosts, digests, logs
):
    names = [h.name for h in hosts]
    image = running_image(fleet, hosts[0])
    assert all(running_image(fleet, h) == image for h in hosts)
    old = committed_model(fleet, hosts[0])
    assert old and all(committed_model(fleet, h) == old for h in hosts)
    new = next_weights(fleet)  # main moves on the hub
    # A rollout that does not ask for the model leaves every host on its recorded commit.
    same = gpufleet("rollout", str(inventory), "--image", image, "--yes", "--json")
    assert same.returncode == 0 and outcomes(rollout_json(same)) == dict.fromkeys(names, "unchanged"), same.stderr

    offset, began = hub_offset(fleet), time.time()
    # The canary, then the other two at once; the canary held to the answers alone (step 1 runs the serving checks).
    no_checks = [a for name in SERVING_CHECKS for a in ("--no-check", name)]
    log = logs / "model.log"
    proc = gpufleet(
        "rollout",
        str(inventory),
        "--image",
        image,
        "--model-revision",
        "main",
        "--batch",
        "2",
        *no_checks,
        "--yes",
        "--json",
        "--log",
        str(log),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"model: main -> {new}" in proc.stderr
    assert outcomes(rollout_json(proc)) == dict.fromkeys(names, "updated")
    # The hub's side: each host fetched the new weights itself (no site cache here), once, and nothing else.
    served = standin_hub.requests(services.hub_log(fleet.cfg), offset)
    fetched = [r for r in served if r.download]
    assert sorted((r.client, r.path, r.status) for r in fetched) == sorted(
        (h.ip, f"/{MODEL_REPO}/resolve/{new}/model.safetensors", 200) for h in hosts
    ), fetched
    # The hosts' side: each stopped once and started once, the canary first; the hub's last answer of the whole
    # rollout ended before the canary's stop, so every download ran while every old version served, and none
    # inside any host's downtime (a downtime starts at its stop).
    events = {h.name: unit_events(fleet, h, began) for h in hosts}
    stops = {n: [t for t, line in e if line.startswith("Stopping ")] for n, e in events.items()}
    starts = {n: [t for t, line in e if line.startswith("Started ")] for n, e in events.items()}
    assert all(len(stops[n]) == 1 and len(starts[n]) == 1 and stops[n][0] < starts[n][0] for n in names), events
    assert stops[names[0]][0] == min(t for n in names for t in stops[n])
    assert max(r.ended_at for r in served) < stops[names[0]][0], (served[-1], stops)
    # ... and each swap's own run (drain, restart, verify) downloaded nothing: its pyinfra results say so.
    runs = swap_runs(log)
    assert len(runs) == 2 and not [run for run in runs if DOWNLOAD in changed_ops(run)], runs[0][-3000:]
    # Committed on every host: its ledger, what `status` reads from the container, the files it holds.
    status = gpufleet("status", str(inventory), "--json")
    assert status.returncode == 0, status.stdout[-3000:]
    models = {row["host"]: row["container"]["model"] for row in json.loads(status.stdout)["hosts"]}
    assert models == dict.fromkeys(names, f"{MODEL_REPO}@{new}")
    for h in hosts:
        assert committed_model(fleet, h) == f"{MODEL_REPO}@{new}" and holds(fleet, h, new), h.name
        assert fleet.run_in(h, f"test -e {MODEL_DIR}.gpufleet-kept", check=False).returncode == 1, h.name


def test_a_model_move_that_fails_its_gate_serves_the_old_commits_files_again(fleet, inventory, pyinfra, hosts, digests):
    canary, *others = hosts
    image = running_image(fleet, canary)
    old = committed_model(fleet, canary)
    assert old and all(committed_model(fleet, h) == old for h in hosts)
    old_commit = old.rpartition("@")[2]
    ids = {h.name: container_id(fleet, h) for h in hosts}
    new = next_weights(fleet)
    broken = f"{fleet.cfg.registry}/{REPOSITORY}@{tag_manifest(fleet.cfg.registry, 'stream-broken')[2]}"
    proc = gpufleet("rollout", str(inventory), "--image", broken, "--model-revision", new, "--yes", "--json")
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert outcomes(rollout_json(proc)) == {canary.name: "rolled-back", **{h.name: "not-started" for h in others}}
    # The canary: the old unit (its image, its container labelled with the old commit), started on the old commit's
    # files, put back before its start (no file or directory changed after it), recorded in its ledger.
    assert running_image(fleet, canary) == image and container_model(fleet, canary) == old
    assert holds(fleet, canary, old_commit)
    started = float(
        sh(
            fleet,
            canary,
            f"date -d \"$(docker inspect --format '{{{{.State.StartedAt}}}}' {container_id(fleet, canary)})\" +%s.%N",
        )
    )
    changed = [float(t) for t in sh(fleet, canary, f"find {MODEL_DIR} -printf '%C@\\n'").split()]
    assert max(changed) < started, (max(changed), started)
    assert committed_model(fleet, canary) == old
    # The others were never swapped: they prefetched the new commit while serving the old one; a converge (the old
    # version pinned in their ledgers) puts the old files back without a download or a restart.
    for h in others:
        assert container_id(fleet, h) == ids[h.name] and holds(fleet, h, new), h.name
    offset = hub_offset(fleet)
    again = converge(pyinfra, inventory)
    assert changed_ops(again.stdout) == {DOWNLOAD: 2}, changed_ops(again.stdout)
    assert [r for r in standin_hub.requests(services.hub_log(fleet.cfg), offset) if r.download] == []
    for h in others:
        assert container_id(fleet, h) == ids[h.name] and holds(fleet, h, old_commit), h.name
