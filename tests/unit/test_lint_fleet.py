"""`gpufleet lint` over a fleet: severities, one line per finding for the hosts it fires on alike, --json, --strict,
findings accepted on purpose (gpufleet_accept), the routers inventory group, exit statuses, and the shipped example."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from gpufleet.cli import main
from gpufleet.vllm.lint import ALL_RULES, ROUTER_RULES, RULES, SEVERITIES, acceptable_rule_ids, lint_spec
from gpufleet.vllm.lint_report import INVALID_SETTING, fleet_report
from gpufleet.vllm.settings import build_spec, merged_settings
from tests.conftest import REPO
from tests.unit.test_cli_render import inventory  # noqa: F401 - the fixture

# Host data that leaves the seed with warnings only (no error): the seed itself has none either.
QUIET = '{"vllm_api_key": "sk-test", "vllm_args": {"shutdown-timeout": 60}}'


def run(*args: str):
    return CliRunner().invoke(main, ["lint", *args])


def as_json(*args: str) -> tuple[int, dict]:
    result = run(*args, "--json")
    return result.exit_code, json.loads(result.stdout)


def lines(result) -> list[str]:
    return result.stdout.splitlines()


# --- severities ------------------------------------------------------------------------------------------------
def test_every_rule_has_a_severity_and_a_unique_id():
    assert all(rule.severity in SEVERITIES for rule in ALL_RULES)
    assert len({rule.id for rule in ALL_RULES}) == len(ALL_RULES)
    assert {rule.severity for rule in ALL_RULES} == set(SEVERITIES)  # every severity is used


@pytest.mark.parametrize(
    "rule_id",
    [
        "hybrid-prefix-caching-without-chunked-prefill",
        "align-block-above-batch",
        "prefix-match-unit-not-dividing-block",
        "host-unreachable-behind-published-port",
    ],
)
def test_settings_vllm_refuses_or_that_never_answer_are_errors(rule_id):
    assert next(rule for rule in RULES if rule.id == rule_id).severity == "error"


def test_advice_is_info_and_lost_prefix_hits_a_warning():
    severity = {rule.id: rule.severity for rule in ALL_RULES}
    assert severity["trust-remote-code-unneeded"] == severity["flashinfer-moe-fp16-deprecated"] == "info"
    assert severity["hybrid-align-chunk-alignment"] == severity["router-policy-ignores-prefix-cache"] == "warning"


# --- one line per finding for the fleet ----------------------------------------------------------------------
def test_a_finding_alike_on_every_host_is_one_line_naming_all_of_them(inventory):
    result = run(inventory('boxes = [("a", {}), ("b", {}), ("c", {})]\n'))
    assert result.exit_code == 0, result.output
    shutdown = [line for line in lines(result) if "[no-shutdown-timeout]" in line]
    assert shutdown == [
        next(line for line in shutdown if line.startswith("all 3 hosts: warning [no-shutdown-timeout] "))
    ]
    # The privileged fix lists each host's own GPUs: the same rule is then one line per host.
    assert len([line for line in lines(result) if "[privileged-exposes-all-gpus]" in line]) == 1  # same GPUs here
    different = run(inventory('boxes = [("a", {}), ("b", {"vllm_gpus": [3, 4, 5]})]\n'))
    privileged = [line for line in lines(different) if "[privileged-exposes-all-gpus]" in line]
    assert [line.split(":")[0] for line in privileged] == ["a", "b"]
    assert '"/dev/nvidia3"' in privileged[1] and '"/dev/nvidia3"' not in privileged[0]


def test_a_finding_on_some_hosts_names_them_and_the_summary_counts_lines(inventory):
    result = run(inventory(f'boxes = [("a", {{}}), ("b", {{}}), ("c", {QUIET})]\n'))
    assert "a, b: warning [no-shutdown-timeout] " in result.stdout
    assert "a, b: warning [open-without-api-key] " in result.stdout
    assert "[no-shutdown-timeout]" not in result.stdout.replace("a, b: warning [no-shutdown-timeout]", "", 1)
    warnings = sum(1 for line in lines(result) if ": warning [" in line)
    assert f"3 host(s): 0 error(s), {warnings} warning(s)" in result.output


def test_the_report_lists_the_most_severe_first(inventory):
    result = run(inventory('boxes = [("a", {"vllm_args": {"enable-chunked-prefill": False}})]\n'))
    severities = [re.match(r"a: (\w+) \[", line)[1] for line in lines(result)]
    assert severities == sorted(severities, key=SEVERITIES.index) and severities[0] == "error"
    assert result.exit_code == 1


# --- --json and --strict ---------------------------------------------------------------------------------------
def test_json_is_one_document_with_every_host_named(inventory):
    code, doc = as_json(inventory('boxes = [("a", {}), ("b", {})]\n'))
    assert code == 0 and set(doc) == {"command", "ok", "error", "findings", "accepted", "hosts", "routers"}
    assert doc["ok"] is True and doc["error"] is None
    assert doc["command"] == "lint" and [(r["host"], r["ok"], r["problems"]) for r in doc["hosts"]] == [
        ("a", True, []),
        ("b", True, []),
    ]  # warnings do not count without --strict
    assert doc["findings"] and doc["accepted"] == []
    for finding in doc["findings"]:
        assert set(finding) == {"id", "severity", "message", "fix", "hosts"}
        assert finding["severity"] in SEVERITIES and finding["hosts"] in (["a"], ["b"], ["a", "b"])
        assert finding["message"] and finding["fix"] and "all 2 hosts" not in json.dumps(finding)
    shutdown = next(f for f in doc["findings"] if f["id"] == "no-shutdown-timeout")
    assert shutdown["hosts"] == ["a", "b"] and shutdown["severity"] == "warning"


def test_warnings_pass_by_default_and_fail_under_strict(inventory):
    inv = inventory('boxes = [("a", {})]\n')
    assert run(inv).exit_code == 0
    assert run(inv, "--strict").exit_code == 1
    code, doc = as_json(inv, "--strict")
    assert code == 1 and doc["ok"] is False
    (host,) = doc["hosts"]
    assert host["ok"] is False and {"id", "message", "fix"} == set(host["problems"][0])


def test_an_error_fails_without_strict(inventory):
    code, doc = as_json(inventory('boxes = [("a", {"vllm_args": {"host": "127.0.0.1"}})]\n'))
    assert code == 1 and doc["ok"] is False
    assert {"id": "host-unreachable-behind-published-port", "severity": "error"}.items() <= next(
        f for f in doc["findings"] if f["id"] == "host-unreachable-behind-published-port"
    ).items()


# --- accepted on purpose ---------------------------------------------------------------------------------------
def everything_on(data: dict) -> list[str]:
    return sorted({f.rule.id for f in lint_spec(build_spec("a", data), merged_settings(data))})


def test_accepted_findings_are_listed_apart_and_do_not_count(inventory):
    accept = everything_on({})
    inv = inventory(f'boxes = [("a", {{"gpufleet_accept": {accept!r}}}), ("b", {{}})]\n')
    result = run(inv, "--strict")
    assert result.exit_code == 1  # b accepts nothing
    assert "a: accepted warning [no-shutdown-timeout] " in result.stdout
    assert "b: warning [no-shutdown-timeout] " in result.stdout
    inv = inventory('boxes = [("a", {}), ("b", {})]\n', f"gpufleet_accept = {accept!r}\n")
    result = run(inv, "--strict")
    assert result.exit_code == 0, result.output
    assert all(": accepted " in line for line in lines(result))
    assert "all 2 hosts: accepted warning [no-shutdown-timeout] " in result.stdout and "(fix: " not in result.stdout
    assert f"{len(accept)} accepted" in result.output
    code, doc = as_json(inv, "--strict")
    assert code == 0 and doc["ok"] is True and doc["findings"] == []
    assert {f["id"] for f in doc["accepted"]} == set(accept) and all(f["hosts"] == ["a", "b"] for f in doc["accepted"])


def test_an_unknown_accepted_id_is_a_finding_naming_the_closest(inventory):
    inv = inventory('boxes = [("a", {"gpufleet_accept": ["no-shutdown-timout", "open-without-api-key"]})]\n')
    _code, doc = as_json(inv)
    unknown = next(f for f in doc["findings"] if f["id"] == "unknown-accepted-rule")
    assert unknown["severity"] == "warning" and unknown["hosts"] == ["a"]
    assert unknown["fix"] == "'no-shutdown-timout': did you mean 'no-shutdown-timeout'?"
    # The typo accepted nothing; the id spelt right did.
    assert "no-shutdown-timeout" in {f["id"] for f in doc["findings"]}
    assert [f["id"] for f in doc["accepted"]] == ["open-without-api-key"]
    far = inventory('boxes = [("a", {"gpufleet_accept": ["everything"]})]\n')
    fix = next(f["fix"] for f in as_json(far)[1]["findings"] if f["id"] == "unknown-accepted-rule")
    assert fix.startswith("'everything' is none of the rule ids: ") and all(i in fix for i in acceptable_rule_ids())


def test_accepting_the_unknown_id_finding_itself_accepts_nothing(inventory):
    _, doc = as_json(inventory('boxes = [("a", {"gpufleet_accept": ["unknown-accepted-rule", "typo"]})]\n'))
    assert doc["accepted"] == []
    assert {f["fix"] for f in doc["findings"] if f["id"] == "unknown-accepted-rule"} == {
        "'typo' is none of the rule ids: " + ", ".join(acceptable_rule_ids()),
        "'unknown-accepted-rule' is none of the rule ids: " + ", ".join(acceptable_rule_ids()),
    }


def test_accept_must_be_a_list_of_ids(inventory):
    result = run(inventory('boxes = [("a", {"gpufleet_accept": "no-shutdown-timeout"})]\n'))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.splitlines() == [
        "Error: a: gpufleet_accept: 'no-shutdown-timeout' is not a list of lint rule ids (fix: e.g. "
        'gpufleet_accept = ["open-without-api-key"], with a comment saying why)'
    ]


# --- routers ---------------------------------------------------------------------------------------------------
ROUTED = 'boxes = [("a", {}), ("b", {})]\nrouters = [("front", %s)]\n'


def test_an_unknown_router_setting_and_a_misspelt_policy_are_errors_one_line_each(inventory):
    inv = inventory(ROUTED % '{"router_prot": 8001, "router_policy": "cache-aware"}')
    result = run(inv)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.removeprefix("Error: ").splitlines() == [
        "front: router_prot: unknown setting (fix: did you mean router_port?)",
        "front: router_policy: 'cache-aware' is not a policy gpufleet runs (fix: use one of cache_aware, "
        "sticky_least_loaded, consistent_hash, round_robin, power_of_two, random)",
    ]
    code, doc = as_json(inv)
    assert code == 1 and doc["ok"] is False
    assert [(f["id"], f["severity"], f["hosts"]) for f in doc["findings"]] == [
        (INVALID_SETTING, "error", ["front"])
    ] * 2
    assert doc["findings"][0]["message"] == "router_prot: unknown setting"


def test_a_router_that_cannot_reach_a_replica_is_an_error(inventory):
    result = run(inventory('boxes = [("a", {"vllm_publish_address": "127.0.0.1"})]\nrouters = [("front", {})]\n'))
    assert result.exit_code == 1
    assert result.output.startswith("Error: a: vllm_publish_address: 127.0.0.1 keeps vLLM off the network")


def test_a_policy_that_spreads_turns_is_a_warning_a_router_may_accept(inventory):
    inv = inventory(ROUTED % '{"router_policy": "round_robin"}')
    result = run(inv)
    assert result.exit_code == 0
    assert "front: warning [router-policy-ignores-prefix-cache] " in result.stdout
    assert "all 2 vLLM hosts: warning [no-shutdown-timeout] " in result.stdout
    assert "2 host(s), 1 router(s): " in result.output
    accepted = inventory(
        ROUTED % '{"router_policy": "round_robin", "gpufleet_accept": ["router-policy-ignores-prefix-cache"]}'
    )
    assert "front: accepted warning [router-policy-ignores-prefix-cache] " in run(accepted).stdout
    one_replica = inventory('boxes = [("a", {})]\nrouters = [("front", {"router_policy": "round_robin"})]\n')
    assert "router-policy" not in run(one_replica).stdout  # one replica holds every conversation's prefix anyway


def test_replicas_keep_the_vllm_rules_and_routers_get_none_of_them(inventory):
    _, doc = as_json(inventory(ROUTED % "{}"))
    assert doc["findings"] and all("front" not in f["hosts"] for f in doc["findings"])


# --- exit statuses for input lint cannot read --------------------------------------------------------------------
def test_an_inventory_that_cannot_be_read_exits_2_with_one_line(inventory, tmp_path):
    for path, says in (
        (str(tmp_path / "nope.py"), "inventory file not found"),
        (inventory("boxes = [(\n"), "cannot load inventory: SyntaxError"),
        (inventory("boxes = []\n"), "no hosts in the inventory"),
    ):
        for args in ((), ("--json",)):
            result = run(path, *args)
            assert result.exit_code == 2 and "Traceback" not in result.output
            assert len(result.output.splitlines()) == 1 and says in result.output


def test_invalid_settings_are_errors_folded_over_the_fleet(inventory):
    # A bad value in group data is one line for the fleet, not one per host.
    result = run(inventory('boxes = [("a", {}), ("b", {}), ("c", {})]\n', "vllm_port = 0\n"))
    assert result.exit_code == 1
    (line,) = result.output.splitlines()
    assert line.startswith("Error: all 3 hosts: vllm_port: 0 ") and "(fix: " in line
    result = run(inventory('boxes = [("a", {}), ("b", {}), ("c", {"vllm_port": 5001})]\n', "vllm_port = 0\n"))
    assert result.output.splitlines() == [line.replace("all 3 hosts", "a, b")]


# --- the report on its own ------------------------------------------------------------------------------------------
def test_a_finding_accepted_on_some_hosts_counts_on_the_others():
    findings = [f for host in ("a", "b") for f in lint_spec(build_spec(host, {}), merged_settings({}))]
    report = fleet_report(findings, {"a": frozenset({"no-shutdown-timeout"})}, ["a", "b"])
    assert [f.hosts for f in report.accepted] == [("a",)]
    assert next(f for f in report.findings if f.id == "no-shutdown-timeout").hosts == ("b",)
    assert report.exit_code() == 0 and report.exit_code(strict=True) == 1


# --- the docs -------------------------------------------------------------------------------------------------------
def test_the_docs_give_each_rule_its_severity():
    traps = (REPO / "docs" / "vllm-traps.md").read_text()
    rows = dict(re.findall(r"^\| ([a-z0-9-]+) \| (error|warning|info) \|", traps, flags=re.M))
    assert rows == {rule.id: rule.severity for rule in RULES}
    lint_doc = (REPO / "docs" / "lint.md").read_text()
    assert all(f"| {rule.id} | {rule.severity} |" in lint_doc for rule in ROUTER_RULES)


# --- the shipped example -----------------------------------------------------------------------------------------
def test_the_example_inventory_lints_clean_but_for_what_it_accepts_on_purpose():
    lab = str(REPO / "inventories" / "lab.py")
    result = run(lab, "--strict")
    assert result.exit_code == 0, result.output
    assert lines(result) and all(": accepted " in line for line in lines(result))
    code, doc = as_json(lab, "--strict")
    assert code == 0 and doc["findings"] == []
    # Each id it accepts comes with a comment saying why.
    text = (REPO / "inventories" / "lab.py").read_text().splitlines()
    for finding in doc["accepted"]:
        at = next(i for i, line in enumerate(text) if line.strip() == f'"{finding["id"]}",')
        assert text[at - 1].strip().startswith("#"), finding["id"]
