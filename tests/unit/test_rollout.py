"""gpufleet.rollout's decisions without test hosts: batches, outcomes from ledgers, the JSON document, the target
from --image / vllm_image, the ledger read's parsing, and drain/downtime against a real stand-in vLLM process on
loopback."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from gpufleet.cli import main
from gpufleet.cli.rollout import ledger_rows
from gpufleet.errors import GpufleetError
from gpufleet.facts.gpu_health import GpuHealth, GpuReading
from gpufleet.facts.gpu_verdict import HostGpus
from gpufleet.facts.gpu_verdict import judge as judge_gpus
from gpufleet.facts.pull import PullStats
from gpufleet.harness.result import HostResult
from gpufleet.health.check import HealthReport, HealthState
from gpufleet.hostlock import process_ended
from gpufleet.hoststate import ledger
from gpufleet.remote.transport import ContainerInfo
from gpufleet.rollout import deploy_run as rollout_deploy
from gpufleet.rollout.carry import CarryResult
from gpufleet.rollout.commands import interrupted_first, previous_targets
from gpufleet.rollout.deploy_run import DeployRun, RunSettings
from gpufleet.rollout.downtime import DowntimeWatch
from gpufleet.rollout.drain import drain, running_requests
from gpufleet.rollout.hosts import FleetHost, Sessions
from gpufleet.rollout.ledgers import parse_read
from gpufleet.rollout.membership import belongs, runs_committed
from gpufleet.rollout.prepare import failures, prepare
from gpufleet.rollout.report import HostOutcome, Outcome, SpeedResult, succeeded, table
from gpufleet.rollout.routers import Routers
from gpufleet.rollout.swap import SwapOptions, batches, judge
from gpufleet.rollout.target import digest_from_inspect, requested_image
from gpufleet.router.api import Router, RouterError
from gpufleet.sandbox.image import write_tiny_model
from gpufleet.vllm.settings import build_spec
from gpufleet.wire.gpu_verdicts import GpuSettings
from gpufleet.wire.speed import SpeedFigures
from tests.loopback import LoopbackTransport
from tests.ports import free_port
from tests.unit.test_ledger_reader import output as reading

REPO = "reg:5000/vllm/vllm-openai"
OLD, NEW, OLDER = (f"{REPO}@sha256:" + c * 64 for c in "abc")
SERVE = Path(__file__).resolve().parents[2] / "src" / "gpufleet" / "sandbox" / "standin" / "vllm_serve.py"


def version(ref: str) -> ledger.Version:
    return ledger.Version(
        image=f"{REPO}:nightly", ref=ref, unit_sha256="u" * 64, spec_hash="s" * 16, service="vllm-qwen35", port=5000
    )


def committed_on(*refs: str) -> ledger.Ledger:
    """A ledger whose versions were committed in this order (the last one runs)."""
    lg = ledger.Ledger()
    for i, ref in enumerate(refs):
        lg = ledger.commit(
            ledger.begin(lg, version(ref), "ops@ctl pid 1", f"2026-12-01T0{i}:00:00Z"),
            f"2026-12-01T0{i}:01:00Z",
            ready_at=f"2026-12-01T0{i}:00:30Z",
        )
    return lg


def read(lg: ledger.Ledger | None, host: str = "h1"):
    return parse_read(host, "vllm-qwen35", 5000, 0, reading(None if lg is None else ledger.render(lg)), "")


def run_of(rc: int, output: str = "", hosts=("h1",), results=None) -> DeployRun:
    return DeployRun(tuple(hosts), rc, output, 1.0, results or {})


# --- plan -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("canary", "batch", "expected"),
    [
        (1, 1, [["a"], ["b"], ["c"], ["d"]]),
        (1, 2, [["a"], ["b", "c"], ["d"]]),
        (2, 1, [["a"], ["b"], ["c"], ["d"]]),
        (3, 2, [["a", "b"], ["c"], ["d"]]),  # never more than --batch at once, the canary included
        (0, 3, [["a", "b", "c"], ["d"]]),
    ],
)
def test_batches_put_the_canary_first_and_never_exceed_batch(canary, batch, expected):
    assert batches(["a", "b", "c", "d"], canary, batch) == expected


def test_rollout_settings_name_the_digest_and_only_the_asked_extras():
    options = SwapOptions(Path("deploys/qwen35.py"))
    assert options.run_settings(NEW).data_args() == [
        "--data",
        f"gpufleet_image_ref={NEW}",
        "--data",
        "gpufleet_verify_checks=none",
    ]
    probing = SwapOptions(Path("d.py"), probe=True, retry_failed=True)
    assert probing.run_settings(NEW).data_args()[4:] == [
        "--data",
        "gpufleet_verify_probe=true",
        "--data",
        "gpufleet_retry_failed=true",
    ]


def test_the_canary_is_held_to_every_serving_check_and_the_batches_to_the_answers():
    from pyinfra_cli.util import parse_cli_arg

    from gpufleet.rollout.swap import held_to
    from gpufleet.wire.checks import parse_checks

    options = SwapOptions(Path("deploys/qwen35.py"))
    data = dict(arg.partition("=")[::2] for arg in options.run_settings(NEW, canary=True).data_args()[1::2])
    checks = parse_checks(parse_cli_arg(data["gpufleet_verify_checks"]))  # as pyinfra hands it to the settings
    assert checks == ("speed", "prefix-cache", "cached-cold", "sessions", "tools", "reasoning")
    spec = build_spec("gpu1", {})  # the qwen35 profile: tool and reasoning parsers, prefix caching
    assert held_to(spec, options, canary=True) == ("completion", "stream", *checks)
    assert held_to(spec, options, canary=False) == ("completion", "stream")
    skipping = SwapOptions(Path("d.py"), canary_checks=("cached-cold", "reasoning"))
    assert held_to(spec, skipping, canary=True) == ("completion", "stream", "cached-cold", "reasoning")
    assert held_to(spec, SwapOptions(Path("d.py"), probe=True), canary=False) == (
        "completion",
        "stream",
        "prefix-cache",
    )


def test_each_checks_result_comes_from_the_outcome_and_the_failure_mark():
    from gpufleet.rollout.swap import check_results

    held = ("completion", "stream", "cached-cold", "tools")
    assert check_results(held, Outcome.UPDATED, None) == tuple((name, True) for name in held)
    assert check_results(held, Outcome.ROLLED_BACK, "cached-cold") == (
        ("completion", True),
        ("stream", True),
        ("cached-cold", False),
    )
    assert check_results(held, Outcome.ROLLED_BACK, None) == ()  # its engine died: no check said anything
    assert (
        HostOutcome(
            "h", OLD, NEW, Outcome.ROLLED_BACK, checks=check_results(held, Outcome.ROLLED_BACK, "tools")
        ).checks_cell
        == "3 passed, tools failed"
    )


def test_a_swap_run_names_each_hosts_committed_digest_as_the_deploy_reads_it():
    from pyinfra_cli.util import parse_cli_arg

    from gpufleet.hoststate.rules import changed_since_read

    read = {"gpu1": OLD, "gpu2": None}
    args = SwapOptions(Path("deploys/qwen35.py")).run_settings(NEW, committed=read).data_args()
    key, _, value = args[args.index("--data", 4) + 1].partition("=")
    expected = parse_cli_arg(value)  # what pyinfra's --data hands the deploy
    assert (key, expected) == ("gpufleet_expect_committed", read)
    assert build_spec("gpu1", {"gpufleet_expect_committed": expected}) is not None  # a valid setting

    on_old = committed_on(OLD)
    assert changed_since_read("gpu1", on_old, expected) is None
    assert changed_since_read("gpu3", ledger.Ledger(), expected) is None  # not swapped by this run: no check
    assert changed_since_read("gpu2", ledger.Ledger(), expected) is None  # nothing committed, as read
    line = changed_since_read("gpu1", committed_on(OLD, OLDER), expected)  # another run committed OLDER meanwhile
    assert line == (
        f"gpu1: its ledger has {OLDER} committed, the rollout read {OLD} when it started: another run "
        "changed the host since (fix: run the rollout again: it reads every host anew)"
    )
    assert str(changed_since_read("gpu2", on_old, expected)).startswith(
        f"gpu2: its ledger has {OLD} committed, the rollout read none"
    )


# --- outcomes from the ledger -----------------------------------------------------------------------------------
def test_committed_on_the_target_is_updated():
    outcome = judge("h1", NEW, read(committed_on(OLD)), read(committed_on(OLD, NEW)), run_of(0), 4.2, None)
    assert (outcome.outcome, outcome.from_ref, outcome.to_ref, outcome.downtime_s) == (Outcome.UPDATED, OLD, NEW, 4.2)


def test_a_failed_mark_with_the_old_version_committed_is_rolled_back():
    failed = ledger.roll_back(ledger.begin(committed_on(OLD), version(NEW), "x", "t1"), "dead: engine died", "t2")
    outcome = judge("h1", NEW, read(committed_on(OLD)), read(failed), run_of(1), 9.0, None)
    assert outcome.outcome is Outcome.ROLLED_BACK and "engine died" in outcome.detail


def answering(ref: str | None, state: HealthState = HealthState.READY) -> HealthReport:
    """A look at a host whose container runs `ref` (None: no container)."""
    return HealthReport(state, "seen", container=ContainerInfo("c1", "running", image=ref) if ref else None)


def test_a_rollback_is_judged_by_what_answers_afterwards_not_by_its_mark():
    marked = ledger.roll_back(ledger.begin(committed_on(OLD), version(NEW), "x", "t1"), "dead: engine died", "t2")

    def outcome(serving):
        return judge("h1", NEW, read(committed_on(OLD)), read(marked), run_of(1), 9.0, None, serving=serving)

    assert outcome(answering(OLD)).outcome is Outcome.ROLLED_BACK
    # The mark is written before the restore: a restore that failed leaves the failed digest, or nothing, running.
    still_new = outcome(answering(NEW))
    assert still_new.outcome is Outcome.FAILED
    assert still_new.detail.startswith(f"rolled-back in its ledger, but what answers runs {NEW}, not ")
    assert outcome(answering(None, HealthState.DEAD)).outcome is Outcome.FAILED
    assert "it is not ready (dead: seen)" in outcome(answering(None, HealthState.DEAD)).detail
    assert outcome("h1: SSH failed").detail.startswith("rolled-back in its ledger, but it could not be looked at")


def test_an_update_is_judged_by_what_answers_afterwards_too():
    updated = read(committed_on(OLD, NEW))
    assert (
        judge("h1", NEW, read(committed_on(OLD)), updated, run_of(0), 4.2, None, serving=answering(NEW)).outcome
        is Outcome.UPDATED
    )
    assert (
        judge("h1", NEW, read(committed_on(OLD)), updated, run_of(0), 4.2, None, serving=answering(OLD)).outcome
        is Outcome.FAILED
    )


def test_anything_else_is_failed_with_what_the_ledger_and_the_run_say():
    cut = ledger.begin(committed_on(OLD), version(NEW), "x", "t1")  # pending left: the run did not settle it
    lost = {"h1": HostResult("h1", False, True, ("h1: 'Restart vllm' failed: lost the SSH connection",))}
    outcome = judge("h1", NEW, read(committed_on(OLD)), read(cut), run_of(1, results=lost), None, None)
    assert outcome.outcome is Outcome.FAILED
    assert "lost the SSH connection" in outcome.detail and "pending sha256:bbbbbbbbbbbb" in outcome.detail
    unreadable = parse_read("h1", "vllm-qwen35", 5000, 255, "", "Connection reset")
    assert judge("h1", NEW, read(committed_on(OLD)), unreadable, run_of(1), None, None).outcome is Outcome.FAILED


def test_a_hosts_json_row_has_ok_problems_and_the_rollouts_fields():
    pull = PullStats(ref=NEW, site_bytes=104_889_802, upstream_bytes=0, fell_back=False, cache="10.0.0.11:5001")
    start = CarryResult(carried_bytes=92_160, warm=True, time_to_ready_s=2.2)
    outcomes = [
        HostOutcome("h1", OLD, NEW, Outcome.UPDATED, 3.14159, "", pull=pull, start=start),
        HostOutcome("h2", OLD, NEW, Outcome.NOT_STARTED, None, "not touched"),
    ]
    rows = json.loads(json.dumps([o.as_dict() for o in outcomes]))
    assert rows[0] == {
        "host": "h1",
        "ok": True,
        "problems": [],
        "from": OLD,
        "to": NEW,
        "outcome": "updated",
        "downtime_s": 3.14,
        "detail": "",
        "checks": [],
        "speed": None,
        "site_bytes": 104_889_802,
        "upstream_bytes": 0,
        "fell_back": False,
        "warm": True,
        "time_to_ready_s": 2.2,
        "carried_bytes": 92_160,
        "carry_skipped": None,
    }
    (problem,) = rows[1].pop("problems")
    # Not pulled, not started: every per-host measurement is null, never a table's placeholder.
    assert rows[1] == {
        "host": "h2",
        "ok": False,
        "from": OLD,
        "to": NEW,
        "outcome": "not-started",
        "downtime_s": None,
        "detail": "not touched",
        "checks": [],
        "speed": None,
        "site_bytes": None,
        "upstream_bytes": None,
        "fell_back": None,
        "warm": None,
        "time_to_ready_s": None,
        "carried_bytes": None,
        "carry_skipped": None,
    }
    assert (problem["id"], problem["message"]) == ("not-started", "not touched")
    assert problem["fix"].startswith("nothing changed on h2: ")
    assert not succeeded(outcomes) and succeeded(outcomes[:1])


def test_the_table_shows_what_each_host_pulled_and_how_it_started():
    pull = PullStats(ref=NEW, site_bytes=104_889_802, upstream_bytes=0, fell_back=False, cache="10.0.0.11:5001")
    missed = PullStats(ref=NEW, site_bytes=0, upstream_bytes=None, fell_back=True)
    outcomes = [
        HostOutcome(
            "h1",
            OLD,
            NEW,
            Outcome.UPDATED,
            17.0,
            "",
            pull=pull,
            start=CarryResult(warm=False, time_to_ready_s=17.2, canary=True),
        ),
        HostOutcome(
            "h2",
            OLD,
            NEW,
            Outcome.UPDATED,
            3.0,
            "",
            pull=missed,
            start=CarryResult(carried_bytes=92_160, warm=True, time_to_ready_s=2.2),
        ),
        HostOutcome("h3", OLD, NEW, Outcome.NOT_STARTED, None, "not touched"),
    ]
    console = Console(width=300, record=True)
    console.print(table(outcomes))
    lines = {line.split()[1]: line for line in console.export_text().splitlines() if line.startswith("│ h")}
    assert "104.9 MB site, 0 bytes upstream" in lines["h1"] and "cold, 17.2 s (canary)" in lines["h1"]
    assert "0 bytes site, site cache missed" in lines["h2"] and "warm, 2.2 s (90 KiB carried)" in lines["h2"]
    assert lines["h3"].count(" - ") >= 3  # nothing pulled, not started, no downtime


def test_prepare_failures_are_the_hosts_the_runs_result_names():
    rejected = "h2: image x rejects --performance-mode of vllm_args: unrecognized arguments (fix: ...)"
    results = {"h1": HostResult("h1", True, True, ()), "h2": HostResult("h2", False, True, (rejected,))}
    # What the output prints is not what decides: it blames h1, the result names h2.
    output = "[h1] h1: image x rejects --performance-mode: Error\n"
    assert failures(run_of(1, output, hosts=("h1", "h2"), results=results)) == {"h2": rejected}
    assert failures(run_of(0, "", hosts=("h1", "h2"))) == {}
    # A run that fails as a whole and says nothing of any host (it wrote no result) fails every host on one line.
    whole = failures(run_of(1, "DeployError: preflight refused\n", hosts=("h1", "h2")))
    assert set(whole) == {"h1", "h2"} and all("exited 1 without a result" in why for why in whole.values())
    # A host stopped only because another was refused is not failed: it is "not started".
    stopped = {"h1": HostResult("h1", False, True, ()), "h2": HostResult("h2", False, True, (rejected,))}
    assert failures(run_of(1, hosts=("h1", "h2"), results=stopped)) == {"h2": rejected}


# --- ledgers ----------------------------------------------------------------------------------------------------
def test_ledger_read_distinguishes_none_corrupt_and_unreachable():
    assert read(None).ledger is None and read(None).error is None
    assert read(committed_on(OLDER, OLD)).previous_ref() == OLDER
    corrupt = parse_read("h1", "v", 5000, 0, reading("{not json"), "")
    assert corrupt.ledger is None and corrupt.error.startswith("h1: /var/lib/gpufleet/v.json is corrupt: not JSON")
    assert "Permission denied" in parse_read("h1", "v", 5000, 1, "", "sudo: Permission denied").error


def test_rollback_targets_are_each_hosts_previous_committed_digest_or_to():
    ledgers = {"h1": read(committed_on(OLDER, OLD)), "h2": read(committed_on(OLD, NEW), "h2")}
    assert previous_targets(ledgers, None) == {"h1": OLDER, "h2": OLD}
    assert previous_targets(ledgers, NEW) == {"h1": NEW, "h2": NEW}
    with pytest.raises(GpufleetError, match=r"^h3: no earlier committed version .*--to"):
        previous_targets({"h3": read(committed_on(OLD), "h3")}, None)


def test_history_rows_newest_first_with_failures_and_their_reasons():
    lg = ledger.roll_back(ledger.begin(committed_on(OLDER, OLD), version(NEW), "x", "t1"), "dead: exited 1", "t2")
    rows = ledger_rows(lg)
    assert [r[0] for r in rows] == ["committed", "failed", "earlier"]
    assert rows[0][1] == OLD and rows[0][4] == "ready 2026-12-01T01:00:30Z"
    assert rows[1][1] == NEW and rows[1][4] == "dead: exited 1"


# --- target -----------------------------------------------------------------------------------------------------
def fleet(*images: str) -> list[FleetHost]:
    return [FleetHost(f"h{i}", build_spec(f"h{i}", {"vllm_image": image}), {}) for i, image in enumerate(images, 1)]


def test_target_is_the_inventory_image_or_image_of_the_same_repository():
    hosts = fleet(f"{REPO}:nightly", f"{REPO}:nightly")
    assert requested_image(hosts, None) == f"{REPO}:nightly"
    assert requested_image(hosts, NEW) == NEW
    with pytest.raises(GpufleetError, match="is not of the fleet's repository reg:5000/vllm/vllm-openai"):
        requested_image(hosts, "docker.io/vllm/vllm-openai:nightly")
    with pytest.raises(GpufleetError, match="vllm_image names 2 repositories"):
        requested_image(fleet(f"{REPO}:nightly", "other:5000/vllm:nightly"), None)


def test_a_pulled_tag_resolves_to_the_repo_digest_of_its_repository():
    out = json.dumps([f"mirror:5000/vllm/vllm-openai@sha256:{'d' * 64}", NEW]) + "\n"
    assert digest_from_inspect(f"{REPO}:nightly", 0, out, "", "h1") == NEW
    with pytest.raises(GpufleetError, match=r"^h1: docker pull .* failed: .*manifest unknown \(fix: "):
        digest_from_inspect(f"{REPO}:nope", 1, "", "Error response from daemon: manifest unknown", "h1")


# --- drain and downtime, against a real stand-in vLLM ------------------------------------------------------------
@pytest.fixture
def server(tmp_path):
    model = tmp_path / "tiny"
    write_tiny_model(model)
    port = free_port()
    env = {**os.environ, "STANDIN_LOAD_SECONDS": "0", "STANDIN_PREFILL_SECONDS_PER_TOKEN": "0.01"}
    proc = subprocess.Popen(
        [sys.executable, str(SERVE), "serve", str(model), "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    transport = LoopbackTransport(proc)
    deadline = time.monotonic() + 10
    while running_requests(transport, port) is None:
        assert time.monotonic() < deadline, "stand-in never served /metrics"
        time.sleep(0.05)
    yield proc, transport, port, str(model)
    proc.terminate()
    proc.wait(10)


def chat(port: int, model: str, prompt: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    )
    urllib.request.urlopen(req, timeout=30).read()


def one_running(transport, port) -> None:
    deadline = time.monotonic() + 5
    while running_requests(transport, port) != 1:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)


def test_drain_waits_for_the_running_request_to_finish(server):
    _, transport, port, model = server
    request = threading.Thread(target=chat, args=(port, model, "x" * 150))  # ~1.9 s of "prefill"
    request.start()
    one_running(transport, port)
    seen = []
    result = drain(transport, port, timeout_s=20, poll_s=0.1, on_wait=seen.append)
    request.join()
    assert result.drained and result.running == 0 and seen and set(seen) == {1}
    assert 0.5 < result.waited_s < 10


def test_drain_gives_up_at_its_timeout_and_says_how_many_still_run(server):
    _, transport, port, model = server
    request = threading.Thread(target=chat, args=(port, model, "y" * 400))  # ~4.5 s
    request.start()
    one_running(transport, port)
    result = drain(transport, port, timeout_s=0.5, poll_s=0.1)
    request.join()
    assert not result.drained and result.running == 1 and "1 request(s) still running" in result.detail


def test_a_stopped_server_has_nothing_to_drain_and_its_outage_is_downtime(server):
    proc, transport, port, _ = server
    watch = DowntimeWatch(transport, port, poll_s=0.05).start()
    time.sleep(0.3)
    proc.terminate()
    proc.wait(10)
    time.sleep(1.0)
    assert drain(transport, port, timeout_s=5).drained
    down = watch.stop()
    assert down is not None and 0.8 < down < 3.0


# --- CLI --------------------------------------------------------------------------------------------------------
def test_cli_refuses_bad_input_with_one_line_before_anything(tmp_path):
    inventory = tmp_path / "inv.py"
    inventory.write_text(f"gpuhosts = [('h1', {{'vllm_image': '{REPO}:nightly', 'ssh_hostname': '127.0.0.1'}})]\n")
    result = CliRunner().invoke(main, ["rollout", str(inventory), "--image", "other/repo:tag", "--yes"])
    assert result.exit_code == 2 and "is not of the fleet's repository" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(main, ["rollback", str(inventory), "--to", f"{REPO}:nightly", "--yes"])
    assert result.exit_code == 2 and "not a digest" in result.output


# --- the deploy run, through the real pyinfra CLI (hosts @local: nothing leaves this machine) --------------------
def test_deploy_run_limits_to_each_named_host_and_a_limit_matching_nothing_fails(tmp_path):
    from gpufleet.rollout.deploy_run import run_deploy

    inventory = tmp_path / "inv.py"
    inventory.write_text("hosts = [('@local', {'marker': 'one'})]\n")
    deploy = tmp_path / "noop.py"
    deploy.write_text(
        "from pyinfra import host, logger\nfrom gpufleet.harness import register_deploy_file\n"
        "register_deploy_file(__file__)\nlogger.warning(f'ran on {host.name} "
        'ref={host.data.get("gpufleet_image_ref")}\')\n'
    )
    log = tmp_path / "deploy.log"
    ran = run_deploy(str(inventory), ["@local"], RunSettings(image_ref=NEW), deploy, log=log)
    assert ran.ok and f"ran on @local ref={NEW}" in ran.output, ran.output[-2000:]
    # A host the run was meant for and pyinfra did not find: never read as done, even if the others ran.
    missed = run_deploy(str(inventory), ["@local", "gpu9"], RunSettings(), deploy, log=log)
    assert not missed.ok and "the inventory names no such host" in missed.summary("gpu9")
    nothing = run_deploy(str(inventory), ["gpu9"], RunSettings(), deploy, log=log)
    assert not nothing.ok
    assert log.read_text().count("[exit ") == 3 and "; started " in log.read_text()


def test_the_fleet_is_the_vllm_hosts_router_hosts_are_left_out(tmp_path):
    from gpufleet.rollout.hosts import load_fleet

    inventory = tmp_path / "inv.py"
    inventory.write_text(
        f"gpuhosts = [('h1', {{'vllm_image': '{REPO}:nightly'}}), ('h2', {{}})]\n"
        "routers = [('r1', {'router_port': 8000})]\n"
    )
    assert [h.name for h in load_fleet(str(inventory))] == ["h1", "h2"]
    assert [h.name for h in load_fleet(str(inventory), "h2")] == ["h2"]


# --- routers ------------------------------------------------------------------------------------------------
def test_an_unreachable_router_is_one_line_naming_it_before_any_swap():
    from gpufleet.rollout.routers import Routers

    port = free_port()  # nothing listens: the SSH connection is refused
    router = ("r1", {"ssh_hostname": "127.0.0.1", "ssh_port": port, "ssh_user": "root"})
    with pytest.raises(GpufleetError) as caught:
        Routers.connect([router], [("h1", {"ssh_hostname": "10.0.0.1"})])
    message = str(caught.value)
    assert message.startswith("router r1: ") and "\n" not in message
    assert "fix: bring the router back, or take it out of the routers inventory group" in message


def test_without_routers_nothing_is_reached_and_a_loopback_replica_is_fine():
    from gpufleet.rollout.routers import Routers

    with Routers.connect([], [("h1", {"vllm_publish_address": "127.0.0.1"})]) as routers:
        assert routers.routers == [] and routers.urls == {}


def test_a_replica_a_router_cannot_address_is_refused_when_there_is_a_router():
    from gpufleet.errors import SettingError
    from gpufleet.rollout.routers import Routers

    with pytest.raises(SettingError, match=r"h1: vllm_publish_address: 127\.0\.0\.1 keeps vLLM off the network"):
        Routers.connect([("r1", {})], [("h1", {"vllm_publish_address": "127.0.0.1"})])


class FakeRouter(Router):
    """A router's worker API in memory: what gpufleet asks of it, and a failure to raise where told."""

    def __init__(self, name: str, workers=(), fail: dict[str, BaseException] | None = None):
        super().__init__(name, None, 8000, 29000)  # type: ignore[arg-type]
        object.__setattr__(self, "workers", set(workers))
        object.__setattr__(self, "fail", fail or {})

    def _maybe_fail(self, what: str) -> None:
        if what in self.fail:
            raise self.fail[what]

    def list_workers(self) -> list[str]:
        self._maybe_fail("list")
        return sorted(self.workers)

    def add_worker(self, url: str, timeout: float) -> None:
        self._maybe_fail("add")
        self.workers.add(url)

    def remove_worker(self, url: str) -> None:
        self._maybe_fail("remove")
        self.workers.discard(url)

    def metrics(self):
        return []


URLS = {"h1": "http://10.0.0.1:5000", "h2": "http://10.0.0.2:5000", "h3": "http://10.0.0.3:5000"}


def test_a_replica_belongs_in_the_routers_when_committed_with_nothing_pending_and_ready():
    cut = ledger.begin(committed_on(OLD), version(NEW), "x", "t1")
    assert belongs(read(committed_on(OLD)), HealthState.READY) is True
    assert belongs(read(committed_on(OLD)), HealthState.DEAD) is False
    assert belongs(read(committed_on(OLD)), HealthState.MISCONFIGURED) is False
    assert belongs(read(cut), HealthState.READY) is False  # a swap that ended neither committed nor rolled back
    assert belongs(read(None), HealthState.READY) is False  # never committed
    # What says nothing either way leaves the replica as it is: a blip, a start under way, an unreadable ledger.
    assert belongs(read(committed_on(OLD)), HealthState.SSH_UNREACHABLE) is None
    assert belongs(read(committed_on(OLD)), HealthState.STARTING) is None
    assert belongs(read(committed_on(OLD)), None) is None
    assert belongs(parse_read("h1", "vllm-qwen35", 5000, 255, "", "Connection reset"), HealthState.READY) is None
    # Ready, but what answers is not the committed digest (a rollback whose restore failed): out.
    assert (
        belongs(read(committed_on(OLD)), HealthState.READY, runs_committed(read(committed_on(OLD)), answering(NEW)))
        is False
    )
    assert runs_committed(read(committed_on(OLD)), answering(OLD)) is True
    assert runs_committed(read(committed_on(OLD)), answering(None)) is False


def test_reconcile_puts_back_what_belongs_takes_out_what_does_not_and_leaves_the_unknown():
    router = FakeRouter("r1", [URLS["h1"], "http://10.9.9.9:5000"])  # h2 stranded by a killed controller
    routers = Routers([(router, 30.0)], URLS)
    lines = routers.reconcile({"h1": False, "h2": True, "h3": None})
    assert router.workers == {URLS["h2"]}
    assert lines == {
        "h1": "taken out of router r1",
        "h2": "put back in router r1",
        "r1": "removed http://10.9.9.9:5000: no replica of the inventory",
    }
    assert routers.reconcile({"h1": False, "h2": True, "h3": None}) == {}  # settled: a second pass changes nothing


def test_reconcile_never_raises_a_router_error_is_its_line():
    nan = FakeRouter("r1", [], fail={"list": ValueError("cannot convert float NaN to integer")})
    cut = FakeRouter("r2", [], fail={"add": EOFError()})
    lines = Routers([(nan, 30.0), (cut, 30.0)], URLS).reconcile({"h1": True})
    assert lines == {"r1": "router r1: worker list: cannot convert float NaN to integer", "h1": "router r2: EOFError"}


def test_a_router_that_does_not_let_a_replica_go_is_one_line_and_the_ones_taken_come_back():
    import paramiko

    first = FakeRouter("r1", [URLS["h1"]])
    second = FakeRouter("r2", [URLS["h1"]], fail={"remove": paramiko.SSHException("SSH session not active")})
    routers = Routers([(first, 30.0), (second, 30.0)], URLS)
    with pytest.raises(RouterError) as caught, routers.out(["h1"], drain_timeout_s=5):
        raise AssertionError("the block must not run")
    assert str(caught.value) == "taking h1 out of the routers: SSH session not active"
    assert first.workers == {URLS["h1"]}  # not swapped: back where it was


def test_after_the_block_a_replica_stays_out_until_rejoin_and_a_refused_rejoin_is_a_line():
    router = FakeRouter("r1", [URLS["h1"], URLS["h2"]])
    routers = Routers([(router, 30.0)], URLS)
    with routers.out(["h1"], drain_timeout_s=5):
        assert router.workers == {URLS["h2"]}
    assert router.workers == {URLS["h2"]}  # its outcome decides: committed or rolled back rejoin, others stay out
    assert routers.rejoin("h1") is None and router.workers == {URLS["h1"], URLS["h2"]}
    refusing = FakeRouter("r2", [], fail={"add": RouterError("r2: POST /add_worker: HTTP 400: Timeout")})
    assert (
        Routers([(refusing, 30.0)], URLS).rejoin("h1")
        == "did not rejoin router r2: r2: POST /add_worker: HTTP 400: Timeout"
    )


def test_a_deploy_run_past_its_time_limit_is_ended_by_its_pid_and_fails_its_hosts(tmp_path, monkeypatch):
    # A hung prepare (a stalled pull, a host that stopped answering) held every host's lock for as long as it hung.
    pid_file = tmp_path / "pid"
    hung = tmp_path / "pyinfra"
    hung.write_text(f"#!/bin/sh\necho $$ > {pid_file}\necho '--> Preparing operations...'\nexec sleep 600\n")
    hung.chmod(0o755)
    monkeypatch.setattr(rollout_deploy, "pyinfra_command", lambda: str(hung))
    started = time.monotonic()
    run, failures = prepare(
        "inv.py", ["gpu1", "gpu2"], "repo@sha256:" + "a" * 64, tmp_path / "deploy.py", log=tmp_path / "log", timeout_s=1
    )
    assert time.monotonic() - started < 10
    assert run.returncode == 124 and "Preparing operations" in run.output
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert set(failures) == {"gpu1", "gpu2"}
    assert all("passed its time limit of 1 s and was ended" in why for why in failures.values()), failures


def test_a_batch_that_would_leave_a_router_no_replica_is_refused_counting_those_already_out():
    router = FakeRouter("r1", URLS.values())
    routers = Routers([(router, 30.0)], URLS)
    assert routers.capacity_problem(batches(["h1", "h2", "h3"], canary=1, batch=1)) is None
    assert routers.capacity_problem(batches(["h1", "h2", "h3"], canary=1, batch=2)) is None
    problem = routers.capacity_problem(batches(["h1", "h2", "h3"], canary=0, batch=3))
    assert problem == (
        "router r1: swapping h1, h2, h3 at once would leave it no replica in service (it routes to 3: "
        "h1, h2, h3); nothing was changed (fix: a smaller --batch, or --canary 1, so that one replica "
        "always serves)"
    )
    # h3 already out of the router (stopped, or left out at its deploy): a batch of the other two takes the last.
    router.workers.discard(URLS["h3"])
    assert "swapping h1, h2 at once" in routers.capacity_problem(batches(["h1", "h2", "h3"], canary=0, batch=2))
    assert Routers([], URLS).capacity_problem([["h1", "h2", "h3"]]) is None  # no router: the batch is the user's call
    cut = FakeRouter("r2", fail={"list": EOFError()})
    assert Routers([(cut, 30.0)], URLS).capacity_problem([["h1"]]) == (
        "router r2: its worker list does not answer: EOFError; nothing was changed (fix: `gpufleet status` shows the "
        "router; run again once it answers)"
    )


def test_a_rerun_after_a_cut_counts_the_hosts_it_settles_first_as_serving_after_them():
    # 2 replicas: the cut run's canary h1 left the router and stayed pending; h2 alone serves. The re-run swaps h1
    # first (it settles the cut swap and rejoins), so h2's turn leaves h1 in service: no refusal, for any order.
    router = FakeRouter("r1", [URLS["h2"]])
    routers = Routers([(router, 30.0)], {h: URLS[h] for h in ("h1", "h2")})
    cut = {
        "h1": read(ledger.begin(committed_on(OLD), version(NEW), "x", "t1"), "h1"),
        "h2": read(committed_on(OLD), "h2"),
    }
    for names in (["h1", "h2"], ["h2", "h1"]):
        order = interrupted_first(names, cut)
        assert order == ["h1", "h2"]
        assert routers.capacity_problem(batches(order, canary=1, batch=1), {"h1": False, "h2": True}) is None
    # Cut after h1 committed, before its rejoin: the reconcile puts it back, so h2 alone may swap.
    assert routers.capacity_problem(batches(["h2"], canary=1, batch=1), {"h1": True, "h2": True}) is None
    # One the reconcile takes out (dead) does not count, and a group that takes the last one is still refused.
    three = Routers([(FakeRouter("r1", URLS.values()), 30.0)], URLS)
    assert "swapping h1, h2 at once" in three.capacity_problem(
        batches(["h1", "h2", "h3"], canary=0, batch=2), {"h3": False}
    )
    assert routers.capacity_problem([["h2"]], {}) is not None  # h1 stays out: h2 is the last one


class Phases:
    """What the rollout's live view was told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def phase(self, host: str, text: str) -> None:
        self.seen.append((host, text))


def test_after_its_swap_a_replica_rejoins_only_when_committed_or_rolled_back():
    from gpufleet.rollout.context import RolloutContext
    from gpufleet.rollout.swap import _out_of_routers

    router = FakeRouter("r1", URLS.values())
    routers = Routers([(router, 30.0)], URLS)
    before = {h: read(committed_on(OLD), h) for h in URLS}
    outcomes = {
        "h1": HostOutcome("h1", OLD, NEW, Outcome.UPDATED, 3.0),
        "h2": HostOutcome("h2", OLD, NEW, Outcome.ROLLED_BACK, 3.0, "rolled back to ...: dead"),
        "h3": HostOutcome("h3", OLD, NEW, Outcome.FAILED, None, "lost the SSH connection (ledger: pending)"),
    }
    ctx = RolloutContext(
        inventory="inv.py",
        hosts={},
        sessions=Sessions([]),
        target_refs=dict.fromkeys(URLS, NEW),
        what=NEW,
        options=SwapOptions(deploy_file=Path("deploys/qwen35.py")),
        progress=Phases(),
    )  # type: ignore[arg-type]
    result = _out_of_routers(ctx, routers, ["h1", "h2", "h3"], NEW, before=before, swap_batch=lambda: dict(outcomes))
    assert router.workers == {URLS["h1"], URLS["h2"]}  # the one that ended neither stays out
    assert result["h1"] == outcomes["h1"] and result["h2"] == outcomes["h2"]
    assert result["h3"].outcome is Outcome.FAILED
    assert result["h3"].detail.endswith("; left out of the routers until it serves its committed version")


@pytest.mark.parametrize(("flags", "carry"), [((), True), (("--no-carry",), False)])
def test_rollout_carries_the_canarys_compile_cache_unless_told_not_to(tmp_path, monkeypatch, flags, carry):
    import importlib

    from gpufleet.rollout.commands import Result

    cli_rollout = importlib.import_module("gpufleet.cli.rollout")  # the module, not the click command it defines

    seen = []

    def roll_out(inventory, image, options, confirm, progress_for, model_revision=None):
        seen.append(options)
        return Result(NEW, [HostOutcome("gpu-a", OLD, NEW, Outcome.UNCHANGED, None, "")])

    monkeypatch.setattr(cli_rollout, "roll_out", roll_out)
    inventory = tmp_path / "inv.py"
    inventory.write_text('gpuhosts = [("gpu-a", {"ssh_hostname": "10.0.0.11"})]\n')
    result = CliRunner().invoke(main, ["rollout", str(inventory), "-y", "--json", *flags])
    assert result.exit_code == 0, result.output
    assert [o.carry for o in seen] == [carry]


def test_a_hosts_last_progress_line_says_why_it_failed_and_nothing_more_when_it_did_not():
    ref = "reg:5000/vllm/vllm-openai@sha256:" + "a" * 64
    why = "gpu1: locked by alice@laptop pid 4242 since 2026-12-01T03:00:00Z (fix: wait for that run to end)"
    assert HostOutcome("gpu1", None, ref, Outcome.FAILED_PREPARE, detail=why).phase == f"failed-prepare: {why}"
    assert HostOutcome("gpu1", None, ref, Outcome.FAILED, 4.25, detail="x").phase == "failed (4.2 s down): x"
    assert HostOutcome("gpu1", ref, ref, Outcome.ROLLED_BACK, 3.0, detail="chat: 500").phase == (
        "rolled-back (3.0 s down): chat: 500"
    )
    assert HostOutcome("gpu1", None, ref, Outcome.UPDATED, 2.0, detail="carried").phase == "updated (2.0 s down)"
    assert HostOutcome("gpu2", None, ref, Outcome.NOT_STARTED, detail="not started: gpu1 failed").phase == "not-started"


KILLED_PARENT = """
import subprocess, sys
from gpufleet.rollout.deploy_run import dies_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=dies_with_parent())
print(child.pid, flush=True)
child.wait()
"""


def gone(pid: int, within_s: float) -> bool:
    """Has process `pid` ended (exited, or a zombie) within `within_s` seconds?"""
    deadline = time.monotonic() + within_s
    while not process_ended(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_deploy_run_dies_with_the_controller_that_started_it():
    # The controller (a process of its own here, ended by its PID) is killed: its deploy run goes with it.
    controller = subprocess.Popen([sys.executable, "-c", KILLED_PARENT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(controller.stdout.readline())  # type: ignore[union-attr]
        assert not gone(child, 0.5)
        controller.kill()
        controller.wait()
        assert gone(child, 10)
    finally:
        if controller.poll() is None:
            controller.kill()
        if child is not None and not gone(child, 0):
            os.kill(child, signal.SIGKILL)  # the test failed: the child it started outlived its controller


def test_a_deploy_run_whose_controller_died_before_it_asked_to_die_with_it_ends_before_it_starts(monkeypatch):
    # The controller killed between the fork and the child's prctl sends no signal: the child finds its parent is
    # no longer the one that started it, and ends itself. Simulated by a preexec made "in" a parent that is not ours.
    with monkeypatch.context() as patched:
        patched.setattr(os, "getpid", lambda: 1)
        preexec = rollout_deploy.dies_with_parent()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=preexec, timeout=20)
    assert proc.returncode == -9 and time.monotonic() - started < 10


# --- the speed check: new against old ---------------------------------------------------------------------------
SPEED_OLD = SpeedFigures(
    (30000.0, 31000.0, 29000.0),
    (0.05, 0.06, 0.04),
    (200.0, 201.0, 199.0),
    (380.0, 390.0, 370.0),
    prompt_tokens=20480,
    decode_tokens=64,
    concurrency=2,
)
SPEED_NEW = replace(SPEED_OLD, decode_tokens_per_s=(180.0, 181.0, 179.0))
HELD = ("completion", "stream", "speed", "cached-cold")


def with_speed(lg: ledger.Ledger, figures: SpeedFigures) -> ledger.Ledger:
    assert lg.committed is not None
    return replace(lg, committed=replace(lg.committed, speed=figures))


def test_an_updated_host_shows_the_figures_measured_before_its_swap_against_the_ones_it_committed():
    outcome = judge(
        "h1",
        NEW,
        read(committed_on(OLD)),
        read(with_speed(committed_on(OLD, NEW), SPEED_NEW)),
        run_of(0),
        4.2,
        None,
        held=HELD,
        speed_before=SPEED_OLD,
    )
    assert outcome.speed == SpeedResult(SPEED_OLD, SPEED_NEW)
    assert outcome.speed.cell() == "prefill 1.00x, cached TTFT 1.00x, decode 0.90x, batch 1.00x"
    row = json.loads(json.dumps(outcome.as_dict()))["speed"]
    assert row["before"] == SPEED_OLD.as_dict() and row["after"] == SPEED_NEW.as_dict() and row["note"] is None
    assert row["ratios"] == {
        "prefill_tokens_per_s": 1.0,
        "cached_ttft_s": 1.0,
        "decode_tokens_per_s": 0.9,
        "batch_tokens_per_s": 1.0,
    }


def test_a_host_whose_old_version_could_not_be_measured_records_the_new_figures_and_says_why():
    why = "the running version could not be measured: DeadlineExceeded: POST /v1/chat/completions: no answer"
    outcome = judge(
        "h1",
        NEW,
        read(committed_on(OLD)),
        read(with_speed(committed_on(OLD, NEW), SPEED_NEW)),
        run_of(0),
        4.2,
        None,
        held=HELD,
        speed_before=why,
    )
    assert outcome.outcome is Outcome.UPDATED and outcome.speed == SpeedResult(None, SPEED_NEW, why)
    assert outcome.speed.cell() == "recorded (no earlier figures)"
    assert outcome.as_dict()["speed"]["note"] == why


def test_a_host_rolled_back_on_speed_names_it_and_has_no_new_figures():
    line = "check speed: prefill 1500 tokens/s, was 30000 (0.05x the speed): every repeat more than 70% slower"
    failed = ledger.roll_back(
        ledger.begin(committed_on(OLD), version(NEW), "x", "t1"), f"misconfigured: {line}", "t2", check="speed"
    )
    outcome = judge(
        "h1", NEW, read(committed_on(OLD)), read(failed), run_of(1), 9.0, None, held=HELD, speed_before=SPEED_OLD
    )
    assert outcome.outcome is Outcome.ROLLED_BACK and line in outcome.detail
    assert outcome.checks == (("completion", True), ("stream", True), ("speed", False))
    assert outcome.speed == SpeedResult(SPEED_OLD, None) and outcome.speed.cell() == "-"
    assert judge("h1", NEW, read(committed_on(OLD)), read(committed_on(OLD, NEW)), run_of(0), 1.0, None).speed is None


def test_a_batch_runs_speed_when_its_hosts_settings_ask_and_the_held_list_says_so():
    from gpufleet.rollout.swap import held_to, speed_batches

    spec = build_spec("gpu1", {})
    options = SwapOptions(Path("deploys/qwen35.py"))
    assert held_to(spec, options, canary=False, speed_batch=True) == ("completion", "stream", "speed")
    assert held_to(spec, options, canary=True)[:3] == ("completion", "stream", "speed")
    assert speed_batches(FleetHost("gpu1", spec, {"gpufleet_speed_batches": True}))
    assert not speed_batches(FleetHost("gpu1", spec, {}))


def test_history_shows_each_committed_versions_speed_figures():
    lg = ledger.commit(
        ledger.begin(with_speed(committed_on(OLD), SPEED_OLD), version(NEW), "x", "t1"), "t2", speed=SPEED_NEW
    )
    rows = ledger_rows(lg)
    assert [(r[0], r[1], r[5]) for r in rows] == [("committed", NEW, SPEED_NEW), ("earlier", OLD, SPEED_OLD)]
    assert SPEED_NEW.brief() == "prefill 30000 tokens/s, cached TTFT 0.050 s, decode 180 tokens/s, batch 380 tokens/s"


# --- GPU health: a sick replica leaves the routers; a sick host is skipped, never the canary -----------------------
class CannedSessions(Sessions):
    """Sessions whose per-host calls answer what each named host's look is canned to (no SSH)."""

    def __init__(self, hosts, answers):
        super().__init__(hosts)
        self.answers = answers

    def each(self, names, fn):
        return {name: self.answers[name] for name in names}


def fleet_hosts(*names: str) -> list[FleetHost]:
    spec = build_spec("h", {"vllm_gpus": [0], "vllm_args": {"pipeline-parallel-size": 1}})
    return [FleetHost(name, spec, {}) for name in names]


def gpus(**fields) -> HostGpus:
    return judge_gpus(
        GpuHealth(
            gpus=(GpuReading(0, "00000000:00:06.0", **fields), GpuReading(1, "00000000:00:07.0", remap_failure=True))
        ),
        GpuSettings(),
    )


def test_a_replica_whose_gpu_needs_a_reset_leaves_the_routers_until_it_is_healthy():
    from gpufleet.rollout.membership import gpus_fit, members

    assert gpus_fit(gpus(remap_pending=True), (0,)) is False
    assert gpus_fit(gpus(clocks_event_reasons=0x40), (0,)) is True  # degraded: served; GPU 1 is not its
    assert gpus_fit(None, (0,)) is None and gpus_fit(HostGpus(error="cannot read"), (0,)) is None
    sessions = CannedSessions(
        fleet_hosts("h1", "h2", "h3"),
        {
            "h1": (answering(OLD), gpus(recovery_action="Reset")),  # ready, but its GPU needs a reset: out
            "h2": (answering(OLD), gpus()),
            "h3": (answering(None, HealthState.SSH_UNREACHABLE), gpus(remap_pending=True)),  # its GPU says it
        },
    )
    ledgers = {name: read(committed_on(OLD), name) for name in ("h1", "h2", "h3")}
    assert members(sessions, ["h1", "h2", "h3"], ledgers) == {"h1": False, "h2": True, "h3": False}


def test_a_host_whose_gpu_refuses_a_restart_is_skipped_with_one_line_and_a_degraded_one_is_noted():
    from gpufleet.rollout.gpu import sick_hosts

    sessions = CannedSessions(
        fleet_hosts("h1", "h2", "h3", "h4"),
        {
            "h1": gpus(recovery_action="Reboot"),
            "h2": gpus(clocks_event_reasons=0x40),
            "h3": gpus(),
            "h4": "cannot SSH to h4",  # its deploy's preflight says why
        },
    )
    notes: list[str] = []
    skipped = sick_hosts(sessions, ["h1", "h2", "h3", "h4"], notes.append)
    assert skipped == {
        "h1": "GPU 0 (00000000:00:06.0) needs reboot: gpu_recovery_action=Reboot (fix: reboot the "
        "host (NVIDIA: RESTART_BM), then run the rollout again)"
    }
    assert notes == ["h2: GPUs degraded (GPU 0: clocks_event_reasons.hw_thermal_slowdown): swapped and served"]
    outcome = HostOutcome("h1", OLD, NEW, Outcome.SKIPPED, None, skipped["h1"])
    assert not outcome.ok and not succeeded([outcome]) and outcome.phase == f"skipped: {skipped['h1']}"
    assert outcome.problems()[0]["id"] == "skipped" and "run the rollout again" in outcome.problems()[0]["fix"]


def test_a_batch_is_refused_when_the_replicas_left_serving_are_the_sick_ones():
    router = FakeRouter("r1", list(URLS.values()))
    routers = Routers([(router, 30.0)], URLS)
    assert routers.capacity_problem([["h1"], ["h2"]], {"h3": False}) is None
    assert "would leave it no replica in service" in routers.capacity_problem([["h1", "h2"]], {"h3": False})
    assert routers.capacity_problem([["h1", "h2"]]) is None  # h3 serving


def test_history_shows_the_gpu_verdict_recorded_at_each_swap():
    lg = ledger.commit(ledger.begin(committed_on(OLD), version(NEW), "x", "t1"), "t2", gpu="ok")
    lg = ledger.roll_back(
        ledger.begin(lg, version(OLDER), "x", "t3"),
        "died",
        "t4",
        gpu="needs GPU reset (GPU 0: remapped_rows.pending=Yes)",
    )
    rows = {state: detail for state, _, _, _, detail, _ in ledger_rows(lg)}
    assert rows["committed"] == "GPU ok"
    assert rows["failed"] == "died; GPU needs GPU reset (GPU 0: remapped_rows.pending=Yes)"


def test_the_default_rollout_log_is_a_new_private_file_under_a_name_no_one_can_take_first(monkeypatch, tmp_path):
    import importlib

    cli_rollout = importlib.import_module("gpufleet.cli.rollout")  # the module, not the command of that name
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with cli_rollout._log_file(None) as first, cli_rollout._log_file(None) as second:
        assert first is not None and second is not None and first != second
        assert first.parent == tmp_path and first.name.startswith("gpufleet-rollout-") and first.suffix == ".log"
        assert stat.S_IMODE(first.stat().st_mode) == 0o600 and first.stat().st_uid == os.getuid()
