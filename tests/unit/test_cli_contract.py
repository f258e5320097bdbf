"""The CLI's contract (docs/cli.md), held for every command of click's tree: a command added without a case here
fails test_every_command_has_a_case.

- Exit status: 0 all good, 1 problems found, 2 bad usage or input (a missing, unloadable or empty inventory, an
  option click refuses).
- --json (status, verify, history, rollout, rollback; lint's own shape in the same envelope): one document with
  command, ok, error, hosts and routers; every row with host, ok and problems [{id, message, fix}]; no table
  placeholder ("-") anywhere.
- Every problem line names its fix; progress on stderr, silent under -q; -v lets paramiko's own logs through;
  shell completion.

Real invocations on inventories written to tmp_path; the hosts and the router point at loopback ports nothing
listens on, so each is out of reach at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from gpufleet.cli import main
from gpufleet.cli.logs import NORMAL, set_verbosity
from gpufleet.defaults import DEFAULTS
from tests.ports import free_port

DIGEST = f"{DEFAULTS['vllm_image'].rsplit(':', 1)[0]}@sha256:{'a' * 64}"

# Every command, by its path in the tree: does it take an INVENTORY first, and the extra arguments of its --json run
# (None: no --json).
INVENTORY_COMMANDS: dict[tuple[str, ...], list[str] | None] = {
    ("render",): None,
    ("lint",): [],
    ("status",): [],
    ("verify",): [],
    ("history",): [],
    ("rollout",): ["--image", DIGEST, "--yes"],
    ("rollback",): ["--yes"],
    ("deploy",): None,
}
# The commands without an inventory, and a bad usage of each.
OTHER_COMMANDS: dict[tuple[str, ...], list[str]] = {
    ("init",): ["--host", "gpu-box-1"],  # DIR missing, and a host without an address
    ("sandbox", "up"): ["0"],  # COUNT is 1-200
    ("sandbox", "down"): ["extra"],  # takes no argument
    ("sandbox", "gpu-fault"): [],  # HOST missing
}
ENVELOPE = {"command", "ok", "error", "hosts", "routers"}


def leaves(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from leaves(sub, (*path, name))
    else:
        yield path


@pytest.fixture(autouse=True)
def normal_verbosity() -> Iterator[None]:
    yield
    set_verbosity(NORMAL)  # a `gpufleet -q` run leaves its setting in the process


def gpufleet(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), prog_name="gpufleet")


@pytest.fixture
def inventories(tmp_path: Path) -> dict[str, str]:
    one_gpu = {"vllm_gpus": [0], "vllm_args": {"pipeline-parallel-size": 1}}
    gpuhosts = [
        (name, {"ssh_hostname": "127.0.0.1", "ssh_port": free_port(), **one_gpu}) for name in ("gpu-a", "gpu-b")
    ]
    routers = [("rtr", {"ssh_hostname": "127.0.0.1", "ssh_port": free_port()})]
    paths = {
        "missing": tmp_path / "nope.py",
        "empty": tmp_path / "empty.py",
        "unloadable": tmp_path / "broken.py",
        "out-of-reach": tmp_path / "fleet.py",
    }
    paths["empty"].write_text("# no hosts yet\n")
    paths["unloadable"].write_text("gpuhosts = [(\n")
    paths["out-of-reach"].write_text(f"gpuhosts = {gpuhosts!r}\nrouters = {routers!r}\n")
    return {kind: str(path) for kind, path in paths.items()}


def test_every_command_has_a_case():
    assert set(leaves(main)) == {*INVENTORY_COMMANDS, *OTHER_COMMANDS}


# --- exit status 2: bad usage or input ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(INVENTORY_COMMANDS), ids=" ".join)
@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("missing", "inventory file not found"),
        ("empty", "no hosts in the inventory"),
        ("unloadable", "cannot load inventory: SyntaxError"),
    ],
)
def test_an_inventory_that_cannot_be_used_exits_2_with_one_line(path, kind, says, inventories):
    json_args = INVENTORY_COMMANDS[path]
    for extra in ([], *([["--json"]] if json_args is not None else [])):
        result = gpufleet(*path, inventories[kind], *extra)
        assert result.exit_code == 2, (result.exit_code, result.output)
        assert result.stdout == "" and "Traceback" not in result.output
        (line,) = result.stderr.splitlines()
        assert says in line and "(fix: " in line


@pytest.mark.parametrize("path", sorted({*INVENTORY_COMMANDS, *OTHER_COMMANDS}), ids=" ".join)
def test_an_unknown_option_exits_2(path):
    result = gpufleet(*path, "--no-such-option")
    assert result.exit_code == 2 and "Traceback" not in result.output


@pytest.mark.parametrize("path", sorted(OTHER_COMMANDS), ids=" ".join)
def test_bad_usage_of_the_commands_without_an_inventory_exits_2(path):
    result = gpufleet(*path, *OTHER_COMMANDS[path])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output


def test_a_bad_option_value_and_a_host_the_inventory_lacks_exit_2(inventories):
    fleet = inventories["out-of-reach"]
    for args in (
        ["verify", fleet, "--checks", "nope"],
        ["verify", fleet, "--wait", "-1"],
        ["status", fleet, "--host", "nope"],
        ["status", fleet, "--fix", "--host", "gpu-a"],
        ["history", fleet, "--host", "nope"],
        ["rollback", fleet, "--to", "vllm/vllm-openai:nightly", "--yes"],
        ["rollout", fleet, "--image", "other/repo:tag", "--yes"],
        ["render", fleet, "--host", "nope"],
    ):
        result = gpufleet(*args)
        assert result.exit_code == 2 and "Traceback" not in result.output, (args, result.output)


def test_an_invalid_setting_is_bad_input_for_every_command_but_lint_which_reports_it(tmp_path):
    inventory = tmp_path / "bad.py"
    inventory.write_text('gpuhosts = [("gpu-a", {"vllm_port": 0, "ssh_hostname": "127.0.0.1"})]\n')
    for path in INVENTORY_COMMANDS:
        result = gpufleet(*path, str(inventory), *(["--yes"] if path in (("rollout",), ("rollback",)) else []))
        if path == ("deploy",):
            continue  # pyinfra's run: the deploy's own preflight refuses it there, one line per host
        assert result.exit_code == (1 if path == ("lint",) else 2), (path, result.output)
        assert "gpu-a: vllm_port: " in result.output and "Traceback" not in result.output
    # --fix with a router: refused as bad input before any router is reached.
    fronted = tmp_path / "fronted.py"
    router = f'routers = [("rtr", {{"ssh_hostname": "127.0.0.1", "ssh_port": {free_port()}}})]\n'
    fronted.write_text(inventory.read_text() + router)
    result = gpufleet("status", str(fronted), "--fix")
    assert result.exit_code == 2 and "gpu-a: vllm_port: " in result.output, result.output


# --- --json: one envelope ------------------------------------------------------------------------------------
def placeholders(value: Any, where: str = "") -> list[str]:
    """Where a table's "-" (or an empty string standing for "unknown") sits in a JSON value."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in placeholders(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in placeholders(v, f"{where}[{i}]")]
    return [where] if value == "-" else []


def check_rows(rows: list[dict]) -> None:
    for row in rows:
        assert {"host", "ok", "problems"} <= set(row) and isinstance(row["ok"], bool), row
        assert row["ok"] == (row["problems"] == []), row
        for problem in row["problems"]:
            assert set(problem) == {"id", "message", "fix"} and all(problem.values()), problem


@pytest.mark.parametrize("path", sorted(p for p, args in INVENTORY_COMMANDS.items() if args is not None), ids=" ".join)
def test_json_is_one_envelope_with_ok_and_problems_on_every_row_and_no_placeholders(path, inventories):
    result = gpufleet(*path, inventories["out-of-reach"], "--json", *INVENTORY_COMMANDS[path])
    doc = json.loads(result.stdout)
    assert set(doc) >= ENVELOPE and doc["command"] == path[-1], doc
    check_rows(doc["hosts"])
    check_rows(doc["routers"])
    assert placeholders(doc) == [], placeholders(doc)
    if path == ("lint",):
        assert result.exit_code == 0 and doc["ok"] is True  # offline: nothing is out of reach for lint
        return
    # Nothing answers: every command found problems, and says so in ok and in its exit status.
    assert result.exit_code == 1 and doc["ok"] is False, result.output
    if doc["error"] is None:
        assert [r["host"] for r in doc["hosts"]] == ["gpu-a", "gpu-b"] and not any(r["ok"] for r in doc["hosts"])
    if path in (("status",), ("verify",)):
        (router,) = doc["routers"]
        assert router["host"] == "rtr" and router["problems"][0]["id"] == "ssh-unreachable"
        assert doc["hosts"][0]["problems"][0]["id"] == "ssh-unreachable"


def test_status_fix_with_a_router_out_of_reach_is_one_line_and_changes_nothing(inventories):
    result = gpufleet("status", inventories["out-of-reach"], "--fix")
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: router rtr: cannot SSH to 127.0.0.1:") and "(fix: " in line, line
    doc = json.loads(gpufleet("status", inventories["out-of-reach"], "--fix", "--json").stdout)
    assert doc["ok"] is False and doc["error"].startswith("router rtr: cannot SSH to ") and doc["hosts"] == []


def test_rollout_rows_carry_the_rollouts_own_fields_and_the_target(inventories):
    doc = json.loads(gpufleet("rollout", inventories["out-of-reach"], "--json", "--image", DIGEST, "--yes").stdout)
    assert doc["target"] == DIGEST
    for row in doc["hosts"]:
        assert {"from", "to", "outcome", "downtime_s", "detail", "checks"} <= set(row)
        assert row["outcome"] == row["problems"][0]["id"] == "failed-prepare"


# --- every problem line has its fix; progress on stderr -----------------------------------------------------------
@pytest.mark.parametrize(
    ("command", "extra"), [("status", []), ("verify", []), ("history", []), ("rollout", ["--image", DIGEST, "--yes"])]
)
def test_every_problem_line_names_its_fix(command, extra, inventories):
    result = gpufleet(command, inventories["out-of-reach"], *extra)
    assert result.exit_code == 1
    named = [line for line in result.stdout.splitlines() if line.startswith(("gpu-a: ", "gpu-b: ", "rtr: "))]
    assert named and all("(fix: " in line for line in named), result.stdout
    if command in ("status", "verify"):
        assert f"gpufleet {command}" in result.stdout  # the table's title names the command


def test_verify_says_what_it_does_on_stderr_and_nothing_under_quiet(inventories):
    said = gpufleet("verify", inventories["out-of-reach"], "--wait", "1")
    assert said.exit_code == 1
    assert "waiting up to 1 s for each host to be ready" in said.stderr and "gpu-a: connecting over SSH" in said.stderr
    assert "connecting" not in said.stdout
    quiet = gpufleet("-q", "verify", inventories["out-of-reach"])
    assert quiet.exit_code == 1 and "connecting" not in quiet.stderr
    assert "gpu-a: ssh-unreachable: " in quiet.stdout  # the result stays


def test_quiet_keeps_lints_findings_and_drops_its_summary(tmp_path):
    inventory = tmp_path / "inv.py"
    inventory.write_text('gpuhosts = [("gpu-a", {})]\n')
    assert "host(s): " in gpufleet("lint", str(inventory)).stderr
    quiet = gpufleet("-q", "lint", str(inventory))
    assert quiet.stderr == "" and "gpu-a: warning [" in quiet.stdout


def test_quiet_and_verbose_together_are_bad_usage():
    assert gpufleet("-q", "-v", "status", "x.py").exit_code == 2


def test_verbose_lets_paramikos_own_log_through(inventories):
    cmd = [sys.executable, "-m", "gpufleet.cli"]
    plain = subprocess.run([*cmd, "status", inventories["out-of-reach"]], capture_output=True, text=True, timeout=60)
    verbose = subprocess.run(
        [*cmd, "-v", "status", inventories["out-of-reach"]], capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == verbose.returncode == 1
    assert "paramiko" not in plain.stderr and "paramiko" in verbose.stderr, verbose.stderr[-2000:]


# --- shell completion ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_the_completion_script_is_produced(shell):
    result = CliRunner().invoke(main, [], prog_name="gpufleet", env={"_GPUFLEET_COMPLETE": f"{shell}_source"})
    assert result.exit_code == 0 and "_GPUFLEET_COMPLETE" in result.output, result.output


def test_completion_offers_the_commands():
    env = {"_GPUFLEET_COMPLETE": "bash_complete", "COMP_WORDS": "gpufleet ro", "COMP_CWORD": "1"}
    result = CliRunner().invoke(main, [], prog_name="gpufleet", env=env)
    assert sorted(result.output.split()) == ["plain,rollback", "plain,rollout"]


def test_each_router_problem_gets_its_own_id_and_keeps_its_fix():
    from gpufleet.cli.health_report import router_problems
    from gpufleet.router.check import RouterExpected, RouterVerdict, problems
    from gpufleet.router.status import RouterStatus, WorkerRow

    mine, stranger = "http://10.0.0.11:5000", "http://10.0.0.99:5000"
    expected = RouterExpected({mine: "gpu1", "http://10.0.0.12:5000": "gpu2"}, inventory="fleet.py")
    looks = {
        "ssh-unreachable": RouterStatus("rtr", "unreachable", "cannot SSH to 10.0.0.5:22: refused"),
        "router-down": RouterStatus("rtr", "down", "connection refused"),
        "front-door": RouterStatus("rtr", "ready", front_door="502", workers=(WorkerRow(mine, True, 0, 0, 0),)),
        "worker-missing": RouterStatus("rtr", "ready", workers=(WorkerRow(mine, True, 0, 0, 0),)),
        "worker-unhealthy": RouterStatus("rtr", "ready", workers=(WorkerRow(mine, False, 0, 0, 0),)),
        "worker-unknown": RouterStatus("rtr", "ready", workers=(WorkerRow(stranger, True, 0, 0, 0),)),
        "worker-api-open": RouterStatus("rtr", "ready", workers=(WorkerRow(mine, True, 0, 0, 0),), fenced=False),
    }
    for id, look in looks.items():
        found = router_problems(RouterVerdict(look, problems(look, expected)))
        assert id in {p.id for p in found}, (id, found)
        assert all(p.fix and "(fix: " not in p.message and not p.message.startswith("rtr: ") for p in found), found


def test_a_routers_invalid_setting_is_bad_input_for_status_and_verify(tmp_path):
    inventory = tmp_path / "inv.py"
    inventory.write_text(
        'gpuhosts = [("gpu-a", {"ssh_hostname": "10.0.0.11"})]\nrouters = [("rtr", {"router_prot": 8001})]\n'
    )
    for command in ("status", "verify"):
        result = gpufleet(command, str(inventory))
        assert result.exit_code == 2 and "rtr: router_prot: unknown setting (fix: " in result.stderr, result.output


def test_a_rollout_stopped_before_any_deploy_leaves_no_log_behind(inventories, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gpufleet("rollout", inventories["empty"], "--image", DIGEST, "--yes")
    gpufleet("rollout", inventories["out-of-reach"], "--image", DIGEST, "--yes")
    logs = sorted(tmp_path.glob("gpufleet-rollout-*.log"))
    assert all(log.stat().st_size for log in logs), logs
