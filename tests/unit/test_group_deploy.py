"""A replica group's deploy, prepared offline by pyinfra's own API on given snapshots (as tests/unit/test_vllm_deploy.py
prepares one host's): a converged group gets no command; a rank that restarts restarts every rank, and the head is
verified for them; one digest for the group; the checks across the ranks; the rank's probe of its head."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State, StringCommand
from pyinfra.api.deploy import add_deploy
from pyinfra.context import ctx_host, ctx_state

from gpufleet.harness import preflight
from gpufleet.hoststate.ledger import Committed, Ledger, Version, render
from gpufleet.units import unit_name
from gpufleet.vllm.deploy import Plan, check_fleet, deploy_qwen35, plan_for
from gpufleet.vllm.facts import HostSnapshot, group_probe
from gpufleet.vllm.group_deploy import check_groups, probe_problem
from gpufleet.vllm.operations import group as group_ops
from gpufleet.vllm.unit import render_unit
from gpufleet.wire.identity import Expected
from tests.unit.test_vllm_deploy import DATA, bare_but_installed, sick, writes

HOSTS = {"box-a": "10.0.0.1", "box-b": "10.0.0.2"}
GROUP = {
    "vllm_group": "pair",
    "vllm_profile": "qwen35-1gpu",
    "vllm_group_interface": "eth0",
    "vllm_group_link": "25GbE",
    "vllm_args": {"pipeline-parallel-size": 2},
}
REF = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64
OTHER = "reg:5000/vllm/vllm-openai@sha256:" + "2" * 64
COMMIT, OTHER_COMMIT = "c" * 40, "d" * 40
START = "Enable and start the vLLM service"
VERIFY = "Verify vLLM is ready (/health, /v1/models), else roll back"
UNIT = "Install the vLLM systemd unit"


def inventory(group: dict[str, Any] | None = None) -> Inventory:
    return Inventory(
        ([(name, {**DATA, "ssh_hostname": ip}) for name, ip in HOSTS.items()], {}),
        pair=(list(HOSTS), {**GROUP, **(group or {})}),
    )


def prepare(
    snaps: dict[str, HostSnapshot],
    monkeypatch: pytest.MonkeyPatch,
    group: dict[str, Any] | None = None,
    state: list[State] | None = None,
) -> tuple[dict[str, Plan], dict[str, dict[str, list[Any]]]]:
    """Plan every rank, then every operation's commands per host: ({host: plan}, {host: {op name: commands}}).
    state: given a list, the run's State is appended to it."""
    inv = inventory(group)
    state_ = State(inv, Config())
    if state is not None:
        state.append(state_)
    for name in HOSTS:
        state_.activate_host(inv.get_host(name))
    plans: dict[str, Plan] = {}
    with ctx_state.use(state_):
        for name in HOSTS:
            with ctx_host.use(inv.get_host(name)):
                plans[name] = plan_for(name, inv.get_host(name).data.dict())
    readings = {name: preflight.Reading(plans[name], snaps[name], []) for name in HOSTS}
    monkeypatch.setattr(preflight, "read_fleet", lambda *_, **__: dict(readings))
    add_deploy(state_, deploy_qwen35)
    ops: dict[str, dict[str, list[Any]]] = {}
    with ctx_state.use(state_):
        for name in HOSTS:
            target = inv.get_host(name)
            with ctx_host.use(target):
                ops[name] = {}
                for op_hash in state_.get_op_order():
                    op_data = state_.get_op_data_for_host(target, op_hash)
                    if op_data.global_arguments.get("_if"):
                        continue
                    op = next(iter(state_.get_op_meta(op_hash).names)).rsplit(" | ", 1)[-1]
                    ops[name][op] = list(op_data.command_generator())
    return plans, ops


def converged(
    monkeypatch: pytest.MonkeyPatch, pins: dict[str, str] | None = None, models: dict[str, str] | None = None
) -> dict[str, HostSnapshot]:
    """What each rank's snapshot shows once the group converged on REF and the model's commit COMMIT (a rank's pins
    can be others): its files, its ledger naming the group's version, its model checked, its unit active; the head
    serving, the rank reaching its head."""
    pins = pins or dict.fromkeys(HOSTS, REF)
    models = models or dict.fromkeys(HOSTS, COMMIT)
    plans, ops = prepare({name: bare_but_installed() for name in HOSTS}, monkeypatch)
    snaps = {}
    for name, plan in plans.items():
        files, dirs = writes(list(ops[name].items()))
        spec = plan.spec
        assert spec.group is not None
        model = f"{plan.settings.model_repo}@{models[name]}"
        snap = bare_but_installed()
        snap.file_sha256 = {path: hashlib.sha256(content).hexdigest() for path, content in files.items()}
        snap.dirs = dict.fromkeys(dirs, ("root", "root", "755"))
        snap.ledger_text = render(
            Ledger(
                committed=Committed(
                    Version(
                        spec.image,
                        pins[name],
                        None,
                        spec.spec_hash,
                        spec.service,
                        spec.port,
                        model=model,
                        model_revision=plan.settings.model_revision,
                        group=spec.group.version(pins[name], model),
                    ),
                    "t0",
                )
            )
        )
        snap.images = [(ref.split("@")[0], "<none>", ref.split("@")[1]) for ref in set(pins.values())]
        snap.model_files = {"config.json": 1, "tokenizer.json": 1, "model.safetensors": 5}
        snap.model_checked = model
        snap.units[unit_name(spec.service)] = ("active", "enabled")
        snap.group_probe = None if spec.group.is_head else "open"
        if spec.group.is_head:
            snap.health_code, snap.served_models = "200", [(spec.served_model_name, spec.max_model_len)]
            snap.cache_config = dict(Expected.from_spec(spec).cache_config)
        # The unit's text depends on the pin: the one rendered for it.
        snap.file_sha256[plan.layout.unit_file] = hashlib.sha256(
            render_unit(spec, pins[name], model).encode()
        ).hexdigest()
        snaps[name] = snap
    return snaps


def test_a_converged_group_gets_no_command_on_any_rank(monkeypatch):
    _, ops = prepare(converged(monkeypatch), monkeypatch)
    for name in HOSTS:
        assert {op: cmds for op, cmds in ops[name].items() if cmds} == {}, name


def test_a_rank_whose_service_stopped_restarts_every_rank_and_the_head_verifies_for_them(monkeypatch):
    snaps = converged(monkeypatch)
    snaps["box-b"].units[unit_name("vllm-qwen35-1gpu")] = ("failed", "enabled")
    _, ops = prepare(snaps, monkeypatch)
    for name in HOSTS:
        shell = [c.get_raw_value() for c in ops[name][START] if isinstance(c, StringCommand)]
        assert any(re.search(r"systemctl (re)?start vllm-qwen35-1gpu\.service", line) for line in shell), (name, shell)
        assert [c.function.__name__ for c in ops[name][VERIFY]] == ["verify", "roll_back_if_failed"], name
        assert ops[name][UNIT] == [], name  # nothing of either unit changes: only the group's state did


def test_the_group_installs_its_heads_digest_on_every_rank(monkeypatch):
    # A rank whose ledger names another digest (a cut run left it there) is brought to the head's, not the reverse.
    snaps = converged(monkeypatch, pins={"box-a": REF, "box-b": OTHER})
    _, ops = prepare(snaps, monkeypatch)
    uploads = [c.src.getvalue().decode() for c in ops["box-b"][UNIT] if isinstance(c, FileUploadCommand)]
    assert uploads and f"image pinned to {REF}." in uploads[0]
    assert ops["box-a"][UNIT] == []
    assert any(isinstance(c, FunctionCommand) for c in ops["box-a"][START])  # the head restarts with it


def test_the_group_installs_its_heads_model_commit_on_every_rank(monkeypatch):
    # A rank whose ledger keeps another commit of the model's branch is brought to the head's, and the head
    # restarts with it: one engine, one set of weights.
    snaps = converged(monkeypatch, models={"box-a": COMMIT, "box-b": OTHER_COMMIT})
    plans, ops = prepare(snaps, monkeypatch)
    repo = plans["box-a"].settings.model_repo
    uploads = [c.src.getvalue().decode() for c in ops["box-b"][UNIT] if isinstance(c, FileUploadCommand)]
    assert uploads and f"# Model {repo}@{COMMIT}." in uploads[0]
    assert ops["box-a"][UNIT] == []
    assert any(isinstance(c, FunctionCommand) for c in ops["box-a"][START])


def test_ranks_that_resolved_different_digests_or_model_commits_fail_before_any_unit_changes(monkeypatch):
    # No rank's ledger pins anything (a first deploy): each resolves the tag and the branch, checked across ranks.
    from gpufleet.operations.run import host_run

    states: list[State] = []
    _, ops = prepare({name: bare_but_installed() for name in HOSTS}, monkeypatch, state=states)
    state = states[0]
    (check,) = ops["box-b"]["Check every rank of the group has one digest and one model commit"]
    repo = "Qwen/Qwen3.5-35B-A3B-FP8"
    for name in HOSTS:
        host_run(state.inventory.get_host(name)).resolved_ref = REF
        host_run(state.inventory.get_host(name)).resolved_model = f"{repo}@{COMMIT}"
    said: list[str] = []
    monkeypatch.setattr(group_ops, "fail", lambda host, line: said.append(line) or False)
    box_b = state.inventory.get_host("box-b")
    assert check.function(state, box_b, *check.args) is True and said == []
    host_run(state.inventory.get_host("box-a")).resolved_model = f"{repo}@{OTHER_COMMIT}"
    assert check.function(state, box_b, *check.args) is False
    assert said[-1] == (
        f"box-b: the ranks of group pair got different model commits (box-a {repo}@{OTHER_COMMIT}, "
        f"box-b {repo}@{COMMIT}): the branch moved between their downloads (fix: converge again, or "
        "set vllm_model_revision to a commit)"
    )
    host_run(state.inventory.get_host("box-a")).resolved_ref = OTHER
    assert check.function(state, box_b, *check.args) is False
    assert said[-1].startswith(f"box-b: the ranks of group pair got different digests (box-a {OTHER}, box-b {REF})")


def reading(plan: Plan, gpu: str = "NVIDIA H200", driver: str = "580.159.04") -> preflight.Reading[Any, Any]:
    snap = bare_but_installed()
    snap.gpus = [g.__class__(**{**g.__dict__, "name": gpu}) for g in snap.gpus]
    snap.driver = snap.driver.__class__(driver, "13.0") if snap.driver else None
    return preflight.Reading(plan, snap, [])


def plans(group: dict[str, Any] | None = None) -> dict[str, Plan]:
    inv = inventory(group)
    state = State(inv, Config())
    with ctx_state.use(state):
        return {name: plan_for(name, inv.get_host(name).data.dict()) for name in HOSTS}


def test_ranks_with_another_gpu_model_or_driver_are_refused_on_the_head_unless_accepted():
    p = plans()
    assert check_groups({name: reading(plan) for name, plan in p.items()}) == {}
    mixed = {"box-a": reading(p["box-a"]), "box-b": reading(p["box-b"], gpu="NVIDIA H100 80GB HBM3", driver="575.57")}
    (gpus, drivers) = check_groups(mixed)["box-a"]
    assert gpus.startswith("box-a: error [group-mixed-gpu-models] ") and "box-b NVIDIA H100 80GB HBM3" in gpus
    assert drivers.startswith("box-a: error [group-mixed-drivers] ") and "box-b 575.57" in drivers
    accepting = plans({"gpufleet_accept": ["group-mixed-gpu-models", "group-mixed-drivers"]})
    assert (
        check_groups(
            {
                name: reading(accepting[name], **({} if name == "box-a" else {"gpu": "X", "driver": "1"}))
                for name in HOSTS
            }
        )
        == {}
    )


def test_a_rank_restarted_by_its_group_onto_a_gpu_that_needs_a_reset_is_refused(monkeypatch):
    snaps = converged(monkeypatch)
    sick(snaps["box-b"], {0: {"remap_pending": True}})
    p = plans()
    readings = {name: preflight.Reading(p[name], snaps[name], []) for name in HOSTS}
    assert check_fleet(readings) == {}  # nothing restarts: the group goes on serving
    snaps["box-a"].units[unit_name("vllm-qwen35-1gpu")] = ("failed", "enabled")
    (line,) = check_fleet(readings)["box-b"]
    assert line.startswith(
        "box-b: GPU 0 (00000000:00:06.0) needs GPU reset: remapped_rows.pending=Yes: this converge "
        "would restart with its group (box-a would start vllm-qwen35-1gpu.service (it is not "
        "running)) (fix: stop the service and reset the GPU"
    )


def test_a_group_deploys_as_one_a_rank_left_out_of_the_run_is_refused():
    p = plans()
    assert check_groups({"box-a": reading(p["box-a"])}) == {
        "box-a": [
            "box-a: group pair deploys as one, and box-b is not in this run (fix: run on every host of the group: "
            "--limit box-a,box-b, or no --limit)"
        ]
    }


@pytest.mark.parametrize(("lines", "said"), [
    (["rc 0"], "open"),
    (["bash: connect: Connection refused", "bash: line 1: /dev/tcp/10.0.0.1/29501: Connection refused", "rc 1"],
     "refused"),
    (["rc 124"], "no answer within 5 s"),
    (["bash: connect: No route to host", "bash: line 1: /dev/tcp/10.0.0.1/29501: No route to host", "rc 1"],
     "No route to host No route to host"),
])  # fmt: skip
def test_the_ranks_probe_of_its_head_reads_as_it_answered(lines, said):
    assert group_probe(lines) == said


def test_a_rank_that_cannot_reach_its_heads_master_port_is_refused_and_the_head_is_not_probed():
    p = plans()
    snap = bare_but_installed()
    snap.group_probe = "no answer within 5 s"
    assert probe_problem("box-b", snap, p["box-b"].spec) == (
        "box-b: cannot reach the head box-a's master port 10.0.0.1:29501 (vllm_group_port) from here: no answer "
        "within 5 s (fix: open TCP from 10.0.0.2 to 10.0.0.1 on every port between the group's hosts, or correct "
        "vllm_group_address)"
    )
    snap.group_probe = "refused"  # the head's host answered: nothing listens there yet
    assert probe_problem("box-b", snap, p["box-b"].spec) is None
    assert p["box-a"].paths.group_head is None and p["box-b"].paths.group_head == ("10.0.0.1", 29501)
