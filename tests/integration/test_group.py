"""A replica group on the session's two test hosts: one model across both (PP 2, one GPU each), the first the head
serving the API, the second a headless rank, on the stand-in vLLM's multi-node engine. Its own service, port and
master port, beside what other modules run there; removed at the end. Steps in file order (pytest keeps it):

1. converged on the module's tag (= good): verified through the head, each ledger naming one group version; status
   shows one row with the rank's line under it; a second converge changes nothing;
2. the rank's container killed: the head's watch stops the head within its bound, and the group comes back;
3. the tag on good-next: a rollout swaps both ranks in one deploy run and commits once;
4. the tag on dies: the group's verify fails and both ranks roll back;
5. the tag back on good: the controller killed while the ranks swap; the re-run leaves one version on both.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.sandbox.image import REPOSITORY
from gpufleet.sandbox.registry import move_tag, tag_manifest
from gpufleet.wire.checks import SERVING_CHECKS
from tests.integration.fleets import module_tag
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.pyinfra_run import run_deploy

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = str(REPO_ROOT / "deploys" / "qwen35.py")
GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
SERVICE, PORT, MASTER_PORT = "vllm-pair", 5100, 29601
# The group's data (the inventory group `pair`): PP 2 across the two hosts, one GPU each. The stand-in is ready in
# seconds; `dies` dies 8 s after serving: a 15 s soak catches it.
GROUP = {
    "vllm_group": "pair",
    "vllm_profile": "qwen35-1gpu",
    "vllm_service": SERVICE,
    "vllm_port": PORT,
    "vllm_group_port": MASTER_PORT,
    "vllm_group_interface": "eth0",
    "vllm_group_link": "veth (test hosts)",
    "vllm_args": {"pipeline-parallel-size": 2},
    "vllm_ready_timeout": 120,
    "vllm_ready_soak_s": 15,
}

# The rollouts after the first prove what the group's versions do, not the checks (the first runs them all).
NO_SERVING_CHECKS = [arg for check in SERVING_CHECKS for arg in ("--no-check", check)]


def gpufleet(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUFLEET, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


def rollout_doc(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.stdout.strip(), proc.stderr[-4000:]
    return json.loads(proc.stdout)


def sh(fleet, host, command: str) -> str:
    return fleet.run_in(host, command).stdout


def container_id(fleet, host) -> str:
    return sh(fleet, host, f"docker ps -q --no-trunc --filter label=gpufleet.{SERVICE}").strip()


def running_image(fleet, host) -> str:
    cid = container_id(fleet, host)
    return sh(fleet, host, f"docker inspect --format '{{{{.Config.Image}}}}' {cid}").strip() if cid else ""


def ledger(fleet, host) -> dict:
    return json.loads(fleet.read_file(host, f"/var/lib/gpufleet/{SERVICE}.json"))


def head_health(fleet, head) -> str:
    return sh(
        fleet, head, f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 2 http://127.0.0.1:{PORT}/health || true"
    ).strip()


def wait_for(what: str, test, timeout_s: float) -> float:
    """Seconds until test() held; fails naming `what` past timeout_s."""
    start = time.monotonic()
    while not test():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.5)
    return time.monotonic() - start


def one_version(fleet, hosts, ref: str) -> str:
    """Both ranks run `ref` and committed it, nothing pending, naming one group version: that version."""
    versions = set()
    for h in hosts:
        assert running_image(fleet, h) == ref, h.name
        doc = ledger(fleet, h)
        assert doc["pending"] is None and doc["committed"]["ref"] == ref, (h.name, doc)
        versions.add(doc["committed"]["group"])
    (version,) = versions
    assert version.startswith("pair@"), version
    return version


@pytest.fixture(scope="module")
def pair(test_hosts):
    return test_hosts[:2]  # rank order: the head first


@pytest.fixture(scope="module")
def tag() -> str:
    return module_tag("group")


@pytest.fixture(scope="module")
def inventory(fleet, pair, inventory_json, tag, tmp_path_factory) -> Path:
    """The inventory group `pair` (its data: GROUP), the hosts on the module's own tag."""
    image = f"{fleet.cfg.registry}/{REPOSITORY}:{tag}"
    path = tmp_path_factory.mktemp("group") / "group_hosts.py"
    path.write_text(
        "from gpufleet.sandbox.inventory import pyinfra_hosts\n"
        f"_data = dict(pyinfra_hosts({str(inventory_json)!r}))\n"
        f"pair = ([(n, {{**_data[n], 'vllm_image': {image!r}}}) for n in {[h.name for h in pair]!r}], {GROUP!r})\n"
    )
    return path


@pytest.fixture(scope="module")
def digests(fleet, tag, inventory, pyinfra, pair) -> dict[str, str]:
    """The group converged on the module's tag (= good); the digest refs of the stand-in tags. At the end the
    group's service is removed from both hosts, which go back to what other modules left there."""
    registry = fleet.cfg.registry
    refs = {
        name: f"{registry}/{REPOSITORY}@{tag_manifest(registry, name)[2]}" for name in ("good", "good-next", "dies")
    }
    assert move_tag(registry, tag, "good") == refs["good"]
    try:
        yield refs
    finally:
        for h in pair:
            fleet.run_in(
                h,
                f"systemctl disable --now {SERVICE}; rm -f /etc/systemd/system/{SERVICE}*.service "
                f"/var/lib/gpufleet/{SERVICE}* /etc/gpufleet/{SERVICE}.env; systemctl daemon-reload",
                check=False,
            )


@pytest.fixture(scope="module")
def converged(digests, inventory, pyinfra) -> str:
    """The first converge's output."""
    return run_deploy(pyinfra, inventory, DEPLOY).stdout


# --- 1. converge, verify through the head, no-op -----------------------------------------------------------------
def test_a_group_converges_verified_through_its_head_and_names_one_version(
    fleet, pair, digests, converged, inventory, pyinfra
):
    head, rank = pair
    assert "ready: /health 200" in converged, converged[-3000:]
    one_version(fleet, pair, digests["good"])
    # The head serves; the rank runs headless, joined to the head's master port, and serves nothing.
    argv = {
        h.name: sh(fleet, h, f"docker inspect --format '{{{{json .Args}}}}' {container_id(fleet, h)}") for h in pair
    }
    assert '"--node-rank","0"' in argv[head.name] and "--headless" not in argv[head.name]
    assert '"--node-rank","1"' in argv[rank.name] and '"--headless"' in argv[rank.name]
    assert f'"--master-addr","{head.ip}"' in argv[rank.name]
    assert head_health(fleet, head) == "200" and head_health(fleet, rank) == "000"
    joined = sh(fleet, rank, f"ss -Htn state established '( dport = :{MASTER_PORT} )'")
    assert f"{head.ip}:{MASTER_PORT}" in joined, joined
    # status: one row for the group, the rank's line under it; --json: a row per rank naming its group.
    status = gpufleet("status", str(inventory), "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    rows = {r["host"]: r for r in json.loads(status.stdout)["hosts"]}
    assert rows[head.name]["state"] == "ready" and rows[head.name]["group"] == {
        "name": "pair",
        "rank": 0,
        "head": head.name,
    }
    assert rows[rank.name]["state"] == "ready" and rows[rank.name]["group"]["rank"] == 1
    table = gpufleet("status", str(inventory)).stdout
    assert f"{head.name} (group pair)" in table and f"└ {rank.name}: rank 1" in table, table
    assert table.index(f"{head.name} (group pair)") < table.index(f"└ {rank.name}")
    # A second converge changes nothing on either rank.
    out = run_deploy(pyinfra, inventory, DEPLOY).stdout
    assert changes(out) == 0, changed_ops(out)


# --- 2. a rank that dies takes the group down cleanly --------------------------------------------------------------
def test_a_rank_that_dies_stops_the_head_within_the_bound_and_the_group_comes_back(fleet, pair, digests, converged):
    head, rank = pair
    before = container_id(fleet, head)
    since = time.time() - 1
    sh(fleet, rank, f"docker kill {container_id(fleet, rank)}")
    # vLLM's head would stay "ready" with a rank gone (measured: docs/multi-node.md); the watch stops it.
    took = wait_for("the head stopped", lambda: container_id(fleet, head) != before, 60)
    assert took < 30, took
    log = sh(fleet, head, f"journalctl -u {SERVICE} --since @{int(since)} -o cat --no-pager")
    assert f"gpufleet group watch: {rank.ip} left group pair" in log, log[-2000:]
    # Both restart (systemd), the rank rejoins, the head serves again: no deploy needed.
    wait_for("the group serving again", lambda: head_health(fleet, head) == "200", 120)
    one_version(fleet, pair, digests["good"])


# --- 3. a rollout swaps both ranks and commits once ----------------------------------------------------------------
def test_a_rollout_swaps_both_ranks_in_one_run_and_commits_once(
    fleet, tag, inventory, pair, digests, converged, tmp_path
):
    head, rank = pair
    before = one_version(fleet, pair, digests["good"])
    assert move_tag(fleet.cfg.registry, tag, "good-next") == digests["good-next"]
    log = tmp_path / "rollout.log"
    proc = gpufleet("rollout", str(inventory), "--yes", "--json", "--log", str(log))
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = rollout_doc(proc)
    assert {r["host"]: r["outcome"] for r in doc["hosts"]} == {head.name: "updated", rank.name: "updated"}
    rows = {r["host"]: r for r in doc["hosts"]}
    assert rows[head.name]["checks"][:2] == [{"check": "completion", "ok": True}, {"check": "stream", "ok": True}]
    assert {"check": "speed", "ok": True} in rows[head.name]["checks"], rows[head.name]["checks"]
    assert rows[rank.name]["checks"] == []  # the head's answers are the group's
    # The speed the head measured is the group's: every rank commits it with the head's verdict.
    figures = {h.name: ledger(fleet, h)["committed"]["speed"] for h in pair}
    assert figures[head.name] is not None and figures[rank.name] == figures[head.name], figures
    swaps = [
        r
        for r in re.split(r"^\$ ", log.read_text(), flags=re.MULTILINE)[1:]
        if "gpufleet_image_ref=" in r.splitlines()[0] and "gpufleet_stage=prepare" not in r.splitlines()[0]
    ]
    assert len(swaps) == 1 and head.name in swaps[0].splitlines()[0] and rank.name in swaps[0].splitlines()[0]
    after = one_version(fleet, pair, digests["good-next"])
    assert after != before
    for h in pair:  # committed once: the version before it went to the history, once
        history = [c["ref"] for c in ledger(fleet, h)["history"]]
        assert history[-1] == digests["good"] and history.count(digests["good-next"]) == 0, (h.name, history)


# --- 4. a failing nightly rolls both ranks back --------------------------------------------------------------------
def test_a_failing_nightly_rolls_both_ranks_back(fleet, tag, inventory, pair, digests, converged):
    version = one_version(fleet, pair, digests["good-next"])
    assert move_tag(fleet.cfg.registry, tag, "dies") == digests["dies"]
    proc = gpufleet("rollout", str(inventory), "--yes", "--json", *NO_SERVING_CHECKS)
    assert proc.returncode == 1, proc.stderr[-4000:]
    doc = rollout_doc(proc)
    assert {r["outcome"] for r in doc["hosts"]} == {"rolled-back"}, doc["hosts"]
    assert one_version(fleet, pair, digests["good-next"]) == version
    for h in pair:
        assert [f["ref"] for f in ledger(fleet, h)["failed"]] == [digests["dies"]], h.name


# --- 5. the controller killed while the ranks swap ------------------------------------------------------------------
def test_a_controller_killed_between_the_ranks_swaps_ends_with_one_version(
    fleet, tag, inventory, pair, digests, converged
):
    head, _ = pair
    move_tag(fleet.cfg.registry, tag, "good")  # committed before on both ranks: not marked failed
    old = container_id(fleet, head)
    proc = subprocess.Popen(
        [GPUFLEET, "rollout", str(inventory), "--yes", "--json", *NO_SERVING_CHECKS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    # Killed once the head's restart began (its old container gone), before the group's verify could end.
    deadline = time.monotonic() + 300
    while container_id(fleet, head) in (old, "") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.3)
    assert proc.poll() is None, "the rollout ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    resumed = gpufleet("rollout", str(inventory), "--yes", "--json", *NO_SERVING_CHECKS)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert {r["outcome"] for r in rollout_doc(resumed)["hosts"]} <= {"updated", "unchanged"}
    one_version(fleet, pair, digests["good"])
