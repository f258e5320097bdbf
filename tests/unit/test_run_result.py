"""The run's result file (gpufleet.harness.result): what a deploy run says of each host, written at exit, and how
the rollout reads it (gpufleet.rollout.deploy_run). The real pyinfra CLI over a throwaway sshd (the unreachable host is a
closed port); preflight's refusal through pyinfra's API (no host); a stand-in pyinfra for runs that die."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import DeployError

from gpufleet.harness import preflight
from gpufleet.harness import result as run_result
from gpufleet.harness.result import RESULT_ENV, HostResult, read_result, write_result
from gpufleet.rollout import deploy_run as rollout_deploy
from gpufleet.rollout.deploy_run import DeployRun, RunSettings, run_deploy
from gpufleet.rollout.prepare import failures
from gpufleet.vllm.deploy import deploy_qwen35, plan_for
from tests.ports import free_port

DEPLOY = """
from pyinfra import host
from pyinfra.api import FunctionCommand, operation
from pyinfra.operations import server

from gpufleet.harness import register_deploy_file
from gpufleet.operations.base import fail

register_deploy_file(__file__)


def check(state, host):
    return fail(host, f"{host.name}: image x rejects --performance-mode of vllm_args (fix: drop it)")


@operation()
def refuse():
    yield FunctionCommand(check, (), {})


if host.data.get("refuses"):
    refuse(name="Check the serve flags")
server.shell(name="a step", commands=["echo the disk is full >&2; exit 3" if host.data.get("breaks") else "true"])
"""
REJECTED = "refuser: image x rejects --performance-mode of vllm_args (fix: drop it)"


def test_a_real_run_writes_each_hosts_outcome_and_the_rollout_reads_it(sshd, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    login = {
        "ssh_hostname": "127.0.0.1",
        "ssh_port": sshd.port,
        "ssh_user": sshd.user,
        "ssh_key": str(sshd.client_key),
        "ssh_known_hosts_file": str(known_hosts),
        "ssh_strict_host_key_checking": "accept-new",
    }
    hosts = [
        ("fine", login),
        ("down", {**login, "ssh_port": free_port()}),
        ("broken", {**login, "breaks": True}),
        ("refuser", {**login, "refuses": True}),
        ("elsewhere", login),
    ]
    (tmp_path / "inventory.py").write_text(f"hosts = {hosts!r}\n")
    (tmp_path / "deploy.py").write_text(DEPLOY)
    names = ["fine", "down", "broken", "refuser"]  # not `elsewhere`: a host outside the run is not in its result
    run = run_deploy(str(tmp_path / "inventory.py"), names, RunSettings(), tmp_path / "deploy.py", log=tmp_path / "log")
    assert run.returncode == 1, run.output[-3000:]
    assert list(run.results) == names
    fine, down, broken, refuser = (run.results[name] for name in names)
    assert fine == HostResult("fine", ok=True, reached=True, problems=())
    assert not down.ok and not down.reached and down.problems[0].startswith("down: could not be reached over SSH")
    # No line reported for it: pyinfra's own record of the failed operation, its name and last line of stderr.
    assert not broken.ok and broken.reached
    assert broken.problems == (
        "broken: 'a step' failed: the disk is full (fix: its full error is in the deploy output, --log)",
    )
    assert refuser == HostResult("refuser", ok=False, reached=True, problems=(REJECTED,))
    assert run.problems("fine") == [] and run.summary("refuser") == REJECTED
    assert failures(run) == {"down": down.problems[0], "broken": broken.problems[0], "refuser": REJECTED}


def test_the_result_file_is_json_with_one_entry_per_host_of_the_run(sshd, tmp_path, monkeypatch):
    login = {
        "ssh_hostname": "127.0.0.1",
        "ssh_port": sshd.port,
        "ssh_user": sshd.user,
        "ssh_key": str(sshd.client_key),
        "ssh_known_hosts_file": str(tmp_path / "known_hosts"),
        "ssh_strict_host_key_checking": "accept-new",
    }
    (tmp_path / "inventory.py").write_text(f"hosts = {[('fine', login)]!r}\n")
    (tmp_path / "deploy.py").write_text(DEPLOY)
    where = tmp_path / "result.json"
    pyinfra = str(Path(sys.executable).with_name("pyinfra"))
    monkeypatch.setenv(RESULT_ENV, str(where))
    ran = subprocess.run(
        [pyinfra, "-y", str(tmp_path / "inventory.py"), str(tmp_path / "deploy.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(where.read_text()) == {
        "finished": True,
        "hosts": [{"host": "fine", "ok": True, "reached": True, "problems": []}],
    }
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".result.json")] == []  # no temp file left


# --- preflight's refusal, through pyinfra's API ----------------------------------------------------------------
DATA = {
    "docker_install": "docker-ce",
    "vllm_api_key": "sk-test",
    "vllm_hf_token": "hf_test",
    "vllm_image": "reg:5000/vllm/vllm-openai:nightly",
}


def test_a_preflight_refusal_is_the_refused_hosts_problem_and_stops_the_others(tmp_path, monkeypatch):
    inventory = Inventory(([("gpu1", DATA), ("gpu2", DATA)], {}))
    state = State(inventory, Config())
    for host in inventory:
        state.activate_host(host)
    line = "gpu2: vllm_gpus [0, 1, 2] needs GPU index 2, the host has 1 GPU(s) (fix: list GPU indexes below 1)"

    def read_fleet(*_: Any, **__: Any) -> dict[str, preflight.Reading[Any]]:
        return {
            "gpu1": preflight.Reading(plan_for("gpu1", DATA), None, []),
            "gpu2": preflight.Reading(None, None, [line]),
        }

    monkeypatch.setattr(preflight, "read_fleet", read_fleet)
    with pytest.raises(DeployError):
        add_deploy(state, deploy_qwen35)
    write_result(state, tmp_path / "result.json")
    doc = json.loads((tmp_path / "result.json").read_text())
    assert doc == {
        "finished": False,
        "hosts": [
            {"host": "gpu1", "ok": False, "reached": True, "problems": []},  # stopped: another host was refused
            {"host": "gpu2", "ok": False, "reached": True, "problems": [line]},
        ],
    }
    run = DeployRun(("gpu1", "gpu2"), 1, "", 1.0, read_result(tmp_path / "result.json") or {})
    assert failures(run) == {"gpu2": line}
    assert "stopped for another host" in run.summary("gpu1")


def test_a_state_that_never_connected_fails_every_host_it_could_not_reach():
    state = State(Inventory(([("gpu1", {})], {})), Config())
    finished, (result,) = run_result.results(state)
    assert not finished and not result.ok and not result.reached
    assert result.problems[0].startswith("gpu1: could not be reached over SSH")


# --- the rollout's side: what it reads, and what it does without a result ----------------------------------------
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    pyinfra = tmp_path / "pyinfra"
    pyinfra.write_text("#!/bin/sh\n" + script)
    pyinfra.chmod(0o755)
    monkeypatch.setattr(rollout_deploy, "pyinfra_command", lambda: str(pyinfra))


def test_the_result_decides_not_what_the_output_says(tmp_path, monkeypatch):
    # The output blames h1 in the words a failure prints; the result names h2: h2 failed, h1 is not blamed.
    result = {
        "finished": True,
        "hosts": [
            {"host": "h1", "ok": True, "reached": True, "problems": []},
            {"host": "h2", "ok": False, "reached": True, "problems": ["h2: not ready (fix: see its journal)"]},
        ],
    }
    stand_in(
        tmp_path,
        monkeypatch,
        "echo '[h1] h1: image x rejects --performance-mode: Error'\n"
        f"echo '{json.dumps(result)}' > \"${RESULT_ENV}\"\nexit 1\n",
    )
    run = run_deploy("inv.py", ["h1", "h2"], RunSettings(), tmp_path / "deploy.py", log=tmp_path / "log")
    assert run.returncode == 1 and "rejects" in run.output
    assert failures(run) == {"h2": "h2: not ready (fix: see its journal)"}
    assert run.problems("h1") == []


def test_a_run_that_wrote_no_result_fails_each_host_on_one_honest_line(tmp_path, monkeypatch):
    stand_in(tmp_path, monkeypatch, "echo '[h1] h1: image x rejects --performance-mode'\nexit 1\n")
    run = run_deploy("inv.py", ["h1", "h2"], RunSettings(), tmp_path / "deploy.py", log=tmp_path / "log")
    assert run.results == {}
    assert failures(run) == {
        host: f"{host}: the deploy run exited 1 without a result for this host (fix: see why in "
        "the deploy output, --log)"
        for host in ("h1", "h2")
    }
    # pyinfra exits 0 having run nothing (no host matched, or a deploy file that writes no result): never done.
    stand_in(tmp_path, monkeypatch, "exit 0\n")
    nothing = run_deploy("inv.py", ["h1"], RunSettings(), tmp_path / "deploy.py", log=tmp_path / "log")
    assert not nothing.ok and "without writing its result: it ran nothing" in failures(nothing)["h1"]
    assert "without writing its result" in (tmp_path / "log").read_text()


def test_a_host_the_result_does_not_list_is_not_done_even_when_the_run_exited_0(tmp_path, monkeypatch):
    result = {"finished": True, "hosts": [{"host": "h1", "ok": True, "reached": True, "problems": []}]}
    stand_in(tmp_path, monkeypatch, f"echo '{json.dumps(result)}' > \"${RESULT_ENV}\"\nexit 0\n")
    run = run_deploy("inv.py", ["h1", "gpu9"], RunSettings(), tmp_path / "deploy.py")
    assert not run.ok and list(failures(run)) == ["gpu9"]
    assert "the inventory names no such host" in run.summary("gpu9")


def test_an_unreadable_result_is_no_result():
    assert read_result(Path("/nonexistent/result.json")) is None
