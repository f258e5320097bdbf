"""The verify's verdict, the rollback inside the verify operation and the commit after it: `--dry` lists the verify
(its name says it rolls back) and the commit apart (pyinfra's plan of the qwen35 playbook, prepared offline on a given
snapshot); while executing, the rollback runs at once after a failed verify and fails the host, the commit only after
a passed one; a check whose request got no answer leaves the version pending, with no failure mark, and a rollout
says so on the host's line."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pyinfra.api import Host, State
from pyinfra.api.operations import run_host_op
from pyinfra.connectors.util import CommandOutput
from pyinfra.context import ctx_host, ctx_state
from pyinfra_cli.prints import build_plan_json, print_meta

from gpufleet.harness.result import HostResult as RunResult
from gpufleet.health import HealthReport, HealthState
from gpufleet.health.answers import AnswerCheck
from gpufleet.hoststate.ledger import Committed, Ledger, Version, begin, render
from gpufleet.operations.run import host_run, reported
from gpufleet.remote.transport import LOOPBACK, ContainerInfo, DeadlineExceeded
from gpufleet.rollout.deploy_run import DeployRun
from gpufleet.rollout.ledgers import parse_read
from gpufleet.rollout.report import Outcome, short
from gpufleet.rollout.swap import judge
from gpufleet.vllm import verify
from gpufleet.vllm.deploy import plan_for
from gpufleet.vllm.verify import VerifyOutcome
from gpufleet.wire.speed import SpeedFigures
from tests.unit.test_ledger_reader import output as reading
from tests.unit.test_vllm_deploy import DATA, REF, bare_but_installed, converged_host, planned

VERIFY = "Verify vLLM is ready (/health, /v1/models), else roll back"
COMMIT = "Commit the verified vLLM version"


def op_name(state: State, op_hash: str) -> str:
    return next(iter(state.get_op_meta(op_hash).names)).rsplit(" | ", 1)[-1]


def plan_rows(state: State) -> dict[str, tuple[list[str], list[str]]]:
    """What `--dry` says of each operation (pyinfra's own plan): (hosts it changes, hosts it may change)."""
    return {
        op["name"].rsplit(" | ", 1)[-1]: (op["hosts_with_change"], op["hosts_with_conditional_change"])
        for op in build_plan_json(state)
    }


def test_dry_lists_the_verify_with_its_rollback_and_the_commit_of_a_host_to_restart(monkeypatch, caplog):
    _, state, _ = planned(bare_but_installed(), monkeypatch)  # a unit to install: restarted, then verified
    rows = plan_rows(state)
    names = list(rows)
    assert names[-2:] == [VERIFY, COMMIT]
    assert rows[VERIFY] == (["gpu1"], [])
    # Whether the commit runs is known only once the verify ran: a conditional change (pyinfra's `_if`).
    assert rows[COMMIT] == ([], ["gpu1"])
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        print_meta(state)  # the table `pyinfra ... --dry` prints
    printed = [line for line in caplog.text.splitlines() if COMMIT in line or VERIFY in line]
    assert len(printed) == 2 and all("1 (gpu1)" in line for line in printed), caplog.text


def test_dry_on_a_converged_host_shows_no_verify_or_commit(monkeypatch):
    _, state, _ = planned(converged_host(monkeypatch), monkeypatch)
    rows = plan_rows(state)
    assert not [name for name, (changes, _) in rows.items() if changes]
    assert rows[VERIFY] == rows[COMMIT] == ([], [])


def pending_over_committed() -> Ledger:
    """What the unit operation's begin wrote while executing: the new version pending over the committed one."""
    plan = plan_for("gpu1", DATA)
    old = Version(plan.spec.image, REF, "a" * 64, "0" * 16, plan.spec.service, plan.spec.port)
    new = Version(plan.spec.image, REF[:-1] + "2", "b" * 64, plan.spec.spec_hash, plan.spec.service, plan.spec.port)
    return begin(Ledger(committed=Committed(old, "t0")), new, "ops@laptop pid 7", "t1")


REAL = VerifyOutcome(passed=False, failed="the real verify_rollout decides")


def execute_from_verify(monkeypatch: pytest.MonkeyPatch, found: VerifyOutcome | None, ledger: Ledger,
                        other_host: bool = False) -> tuple[State, Host, dict[str, bool], list[tuple[str, Any]]]:  # fmt: skip
    """Prepare the playbook for a host to restart, take the operations before the verify as executed as planned,
    then let pyinfra execute the verify (with its rollback) and the commit: (state, host, each one's result, the calls
    they made: the verify's verdict is `found`, or what verify_rollout decides for REAL; the commit and the rollback
    are recorded)."""
    _, state, target = planned(bare_but_installed(), monkeypatch)
    calls: list[tuple[str, Any]] = []
    if found is not REAL:
        monkeypatch.setattr(verify, "verify_rollout", lambda host, v, soak_s: calls.append(("verify", soak_s)) or found)
    monkeypatch.setattr(
        verify,
        "commit_pending",
        lambda host, v, ready_at, speed: (
            calls.append(("commit", ready_at) if speed is None else ("commit", ready_at, speed)) or True
        ),
    )
    monkeypatch.setattr(
        verify,
        "roll_back",
        lambda host, v, ledger, failed, check=None, mark=True: (
            calls.append(("roll back", (failed, check) if mark else (failed, check, "not marked"))) or False
        ),
    )
    state.is_executing = True
    state.activated_hosts.add(target)
    if other_host:  # another host in the run: the commit waited for it
        state.activated_hosts.add(Host("gpu2", state.inventory, []))  # type: ignore[arg-type]
    host_run(target).ledger = ledger
    order = state.get_op_order()
    at = [op_name(state, op_hash) for op_hash in order].index(VERIFY)
    for op_hash in order[:at]:
        meta = state.get_op_data_for_host(target, op_hash).operation_meta
        meta.set_complete(True, ["as planned"] if meta.will_change else [], CommandOutput([]))
    results = {}
    with ctx_state.use(state), ctx_host.use(target):  # as pyinfra's run_ops does for each host
        for op_hash in order[at:]:
            results[op_name(state, op_hash)] = run_host_op(state, target, op_hash)
    return state, target, results, calls


def changed(state: State, target: Host) -> list[str]:
    return [
        op_name(state, op_hash)
        for op_hash in state.get_op_order()[-2:]
        if state.get_op_data_for_host(target, op_hash).operation_meta.did_change()
    ]


def test_a_passed_verify_commits_and_does_not_roll_back(monkeypatch):
    state, target, results, calls = execute_from_verify(
        monkeypatch, VerifyOutcome(passed=True, ready_at="t2"), pending_over_committed()
    )
    assert results == {VERIFY: True, COMMIT: True}
    assert calls == [("verify", 20.0), ("commit", "t2")]
    assert changed(state, target) == [VERIFY, COMMIT]


def test_the_figures_a_passed_speed_check_measured_go_to_the_commit(monkeypatch):
    figures = SpeedFigures((3e4,), (0.05,), (200.0,), (380.0,), prompt_tokens=20480, decode_tokens=64, concurrency=2)
    _, _, results, calls = execute_from_verify(
        monkeypatch, VerifyOutcome(passed=True, ready_at="t2", speed=figures), pending_over_committed()
    )
    assert results == {VERIFY: True, COMMIT: True} and calls[-1] == ("commit", "t2", figures)


def test_a_failed_verify_rolls_back_commits_nothing_and_fails_the_host(monkeypatch):
    found = VerifyOutcome(passed=False, failed="dead: docker run exited with status 1", check=None)
    _state, target, results, calls = execute_from_verify(monkeypatch, found, pending_over_committed())
    # The verify operation rolls back at once and fails the host (pyinfra then runs nothing more on it): no commit.
    assert results[VERIFY] is False
    assert calls == [("verify", 20.0), ("roll back", ("dead: docker run exited with status 1", None))]
    assert verify.outcome(target) == found


def test_a_verify_that_could_not_finish_fails_the_host_with_neither_commit_nor_rollback(monkeypatch):
    _state, target, results, calls = execute_from_verify(monkeypatch, None, pending_over_committed())
    assert results[VERIFY] is False  # pyinfra runs nothing more on the host; neither would run anyway
    assert calls == [("verify", 20.0)] and verify.outcome(target) is None
    with ctx_host.use(target):
        assert not verify.verify_passed()


def test_a_verified_restart_of_the_committed_version_commits_nothing(monkeypatch):
    committed = Ledger(committed=pending_over_committed().committed)  # drift or secrets: nothing pending
    state, target, results, calls = execute_from_verify(
        monkeypatch, VerifyOutcome(passed=True, ready_at="t2"), committed
    )
    assert results == {VERIFY: True, COMMIT: True}
    assert calls == [("verify", 20.0)] and changed(state, target) == [VERIFY]


@pytest.mark.parametrize("found", [None, VerifyOutcome(passed=False, failed="dead: x")])
def test_the_commit_refuses_without_a_passed_verdict_whatever_calls_it(monkeypatch, found):
    _, state, target = planned(bare_but_installed(), monkeypatch)
    if found is not None:
        verify._outcomes(target)[target.name] = found
    spec = plan_for("gpu1", DATA).spec
    v = verify.Verification(spec, 5.0, None, "/var/lib/gpufleet/x.json", spec.served_model_name)
    monkeypatch.setattr(verify, "commit_pending", lambda *_: pytest.fail("committed"))
    assert v.commit(state, target) is False


class NoAnswer:
    """The way to a server whose requests all run out of time: what SshTransport raises when nothing answers
    before the request's deadline."""

    name = "gpu1"

    def __init__(self) -> None:
        self.requests: list[int] = []

    def http(self, port: int, timeout: float, max_bytes: int = 0, address: str = LOOPBACK) -> Any:
        self.requests.append(port)
        raise DeadlineExceeded(f"gpu1: no complete answer within {timeout:g} s")


def verified_against(monkeypatch: pytest.MonkeyPatch, transport: NoAnswer, ledger: Ledger, **replaced: Any):
    """execute_from_verify with the real verify_rollout: the new container reads ready (/health, /v1/models, its
    image and label the pending version's), the soak passes, and every request a check sends goes to `transport`;
    `replaced`: more of verify's names set (the answer or serving checks)."""
    version = ledger.pending.version
    ready = HealthReport(
        HealthState.READY,
        "/health 200, serving qwen35",
        host="gpu1",
        container=ContainerInfo("new", "running", image=version.ref, spec_hash=version.spec_hash),
    )
    monkeypatch.setattr(verify.Verification, "check_once", lambda self, host, expected: lambda: ready)
    monkeypatch.setattr(verify, "service_exited", lambda host, service: lambda: None)
    monkeypatch.setattr(verify, "soak", lambda look, report, soak_s, exited=None: report)
    monkeypatch.setattr(verify, "transport_from_pyinfra_host", lambda host: transport)
    monkeypatch.setattr(verify, "failed_logs", lambda host, transport, service: ["engine core: ValueError"])
    for name, value in replaced.items():
        monkeypatch.setattr(verify, name, value)
    return execute_from_verify(monkeypatch, REAL, ledger)


def passing_answers(*_: Any, **__: Any) -> tuple[AnswerCheck, ...]:
    return AnswerCheck("completion", True, "2 tokens (length)"), AnswerCheck("stream", True, "3 chunks")


@pytest.mark.parametrize(("replaced", "line"), [
    ({}, "(answer check completion: could not run: DeadlineExceeded: "),
    ({"check_answers": passing_answers}, "(serving check cached-cold: could not run: DeadlineExceeded: "),
])  # fmt: skip
def test_a_check_whose_request_gets_no_answer_leaves_the_version_pending_with_no_failure_mark(
    monkeypatch, replaced, line
):
    ledger = pending_over_committed()
    transport = NoAnswer()
    state, target, results, calls = verified_against(monkeypatch, transport, ledger, **replaced)
    # Neither committed nor rolled back nor marked failed: the next run finds it pending and verifies it again.
    assert results[VERIFY] is False and calls == [] and verify.outcome(target) is None
    assert host_run(target).ledger == ledger and not ledger.failed
    assert len(transport.requests) == 2  # the request, and once more: then no other check waits its deadline out
    (problem,) = reported(state)["gpu1"]
    assert line in problem and problem.endswith(
        "nothing was committed or rolled back, the new version stays pending "
        "(fix: converge again: the next run verifies it)"
    ), problem


def test_a_check_that_answers_wrong_still_fails_the_verify_and_marks_the_version(monkeypatch):
    wrong = AnswerCheck("tools", False, 'tool_choice "required": POST /v1/chat/completions answered 500: engine dead')
    _state, target, results, calls = verified_against(
        monkeypatch,
        NoAnswer(),
        pending_over_committed(),
        check_answers=passing_answers,
        run_checks=lambda *_, **__: (wrong,),
    )
    assert results[VERIFY] is False and verify.outcome(target).check == "tools"
    assert calls == [("roll back", (f"misconfigured: check {wrong.line()}", "tools"))]


def test_the_rollouts_line_names_the_check_that_could_not_run_and_the_version_left_pending(monkeypatch):
    """The verify's line as a rollout reads it: from the deploy run's result file, beside the host's ledger after."""
    ledger = pending_over_committed()
    state, *_ = verified_against(monkeypatch, NoAnswer(), ledger, check_answers=passing_answers)
    run = DeployRun(("gpu1",), 1, "", 1.0, {"gpu1": RunResult("gpu1", False, True, tuple(reported(state)["gpu1"]))})
    new = ledger.pending.version

    def read(lg: Ledger) -> Any:
        return parse_read("gpu1", new.service, new.port, 0, reading(render(lg)), "")

    before = read(Ledger(committed=ledger.committed))
    found = judge("gpu1", new.ref, before, read(ledger), run, 31.5, None, held=("completion", "stream", "cached-cold"))
    assert found.outcome is Outcome.FAILED and found.checks == (), found  # neither passed nor failed
    assert found.phase.startswith(
        f"failed (31.5 s down): gpu1: could not finish verifying {new.service} (serving "
        "check cached-cold: could not run: DeadlineExceeded: "
    ), found.phase
    assert "the new version stays pending" in found.phase and f"pending {short(new.ref)})" in found.phase
    (problem,) = found.as_dict()["problems"]
    assert problem["id"] == "failed" and "run the rollout again" in problem["fix"], problem


def test_a_port_another_process_took_rolls_back_without_a_failure_mark(monkeypatch):
    found = VerifyOutcome(
        passed=False,
        failed="dead: exited 125; port 5000 is taken on the host (listen tcp4 "
        "0.0.0.0:5000: bind: address already in use)",
        port_taken=True,
    )
    _, _, results, calls = execute_from_verify(monkeypatch, found, pending_over_committed())
    assert results[VERIFY] is False
    assert calls == [("verify", 20.0), ("roll back", (found.failed, None, "not marked"))]


def test_a_first_install_whose_port_another_process_took_is_not_marked_failed(monkeypatch):
    found = VerifyOutcome(passed=False, failed="dead: exited 125; port 5000 is taken", port_taken=True)
    first = Ledger(pending=pending_over_committed().pending)
    written: list[Ledger] = []
    monkeypatch.setattr(verify, "save_ledger", lambda host, path, ledger: written.append(ledger) or True)
    _, _target, results, calls = execute_from_verify(monkeypatch, found, first)
    assert results[VERIFY] is False and calls == [("verify", 20.0)]
    assert written == []  # still pending, nothing marked: the next run finishes it


@pytest.mark.parametrize(
    ("look", "rolled_back"),
    [
        (HealthReport(HealthState.DEAD, "docker run exited with status 1"), True),
        (HealthReport(HealthState.SSH_UNREACHABLE, "gpu1: SSH failed"), False),
    ],
    ids=["died", "unreachable"],
)
def test_a_run_with_other_hosts_looks_again_before_the_commit(monkeypatch, look, rolled_back):
    # The commit runs once every host's verify ended: a version that died meanwhile is not committed.
    monkeypatch.setattr(verify.Verification, "check_once", lambda self, host, expected: lambda: look)
    _, _, results, calls = execute_from_verify(
        monkeypatch, VerifyOutcome(passed=True, ready_at="t2"), pending_over_committed()
    )
    assert results[COMMIT] is True and calls[-1] == ("commit", "t2")  # alone in its run: no second look
    _, _, results, calls = execute_from_verify(
        monkeypatch, VerifyOutcome(passed=True, ready_at="t2"), pending_over_committed(), other_host=True
    )
    assert results[COMMIT] is False
    assert calls[1:] == (
        [
            (
                "roll back",
                (
                    "dead: docker run exited with status 1 (after its verify, while the run "
                    "waited for the other hosts)",
                    None,
                ),
            )
        ]
        if rolled_back
        else []
    )
