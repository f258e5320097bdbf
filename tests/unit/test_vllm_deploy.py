"""The qwen35 playbook, prepared offline by pyinfra's own API on a given snapshot (no host, no SSH).

Proves two contracts of the operations: every path an operation writes is a path the snapshot reads (else
put_content would rewrite it on every run, silently), and a host whose snapshot shows the converged state gets no
command at all (the second converge changes nothing).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import replace
from typing import Any

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Host, Inventory, State, StringCommand
from pyinfra.api.deploy import add_deploy
from pyinfra.context import ctx_host, ctx_state

from gpufleet.facts.nvidia import Gpu, NvidiaVersion
from gpufleet.harness import preflight
from gpufleet.hoststate.ledger import Committed, Ledger, Version, begin, parse, render, roll_back
from gpufleet.units import unit_name
from gpufleet.vllm.deploy import Plan, check_host, deploy_qwen35, plan_for
from gpufleet.vllm.facts import HostSnapshot, RunningService
from gpufleet.vllm.operations.docker import CE_PACKAGES
from gpufleet.vllm.operations.nvidia import PACKAGE, VERSION_FILE
from gpufleet.wire.identity import Expected

KEY = (
    "-----BEGIN PGP PUBLIC KEY BLOCK-----\n\n"
    + base64.b64encode(b"key" * 40).decode()
    + "\n-----END PGP PUBLIC KEY BLOCK-----\n"
)
DATA = {
    "docker_install": "docker-ce",
    "vllm_api_key": "sk-test",
    "vllm_hf_token": "hf_test",
    "vllm_image": "reg:5000/vllm/vllm-openai:nightly",
}
REF = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64
VERSION = "NVIDIA-SMI version  : 580.159.04\nDRIVER version      : 580.159.04\nCUDA Version        : 13.0\n"


def bare_but_installed() -> HostSnapshot:
    """Packages in place (so pyinfra's apt operations, which read their own facts, are not reached), nothing of
    gpufleet's written yet."""
    gpus = [
        Gpu(
            i,
            f"GPU-{i}",
            "NVIDIA H200",
            143771,
            0,
            143156,
            "580.159.04",
            f"0:{i}",
            "9.0",
            "Enabled",
            30,
            0,
            80.0,
            700.0,
        )
        for i in range(3)
    ]
    installed = [*CE_PACKAGES, PACKAGE, "curl", "ca-certificates"]
    return HostSnapshot(
        os={"ID": "debian", "VERSION_CODENAME": "bookworm"},
        arch="amd64",
        nvidia_smi=True,
        gpus=gpus,
        driver=NvidiaVersion("580.159.04", "13.0"),
        driver_output=VERSION,
        packages=dict.fromkeys(installed, "1"),
        nvidia_key=KEY,
        docker_key=KEY,
        daemon_json={"runtimes": {"nvidia": {}}},
        units={"docker.service": ("active", "enabled")},
    )


def planned(snapshot: HostSnapshot, monkeypatch: pytest.MonkeyPatch) -> tuple[Plan, State, Host]:
    """The playbook as pyinfra prepares it (what `--dry` prints is read from this state)."""
    inventory = Inventory(([("gpu1", DATA)], {}))
    state = State(inventory, Config())
    target = inventory.get_host("gpu1")
    state.activate_host(target)
    plan = plan_for("gpu1", target.data.dict())
    # Preflight's SSH read is the one thing replaced: this snapshot is what it would have read.
    monkeypatch.setattr(preflight, "read_fleet", lambda *_, **__: {"gpu1": preflight.Reading(plan, snapshot, [])})
    add_deploy(state, deploy_qwen35)
    return plan, state, target


def prepare(snapshot: HostSnapshot, monkeypatch: pytest.MonkeyPatch) -> tuple[Plan, list[tuple[str, list[Any]]]]:
    """Run the playbook as pyinfra prepares it, then every operation's commands in full: [(op name, commands)]."""
    plan, state, target = planned(snapshot, monkeypatch)
    ops = []
    with ctx_state.use(state), ctx_host.use(target):
        for op_hash in state.get_op_order():
            name = next(iter(state.get_op_meta(op_hash).names)).rsplit(" | ", 1)[-1]
            op_data = state.get_op_data_for_host(target, op_hash)
            if op_data.global_arguments.get("_if"):
                continue  # pyinfra evaluates _if only while executing: its condition op is checked instead
            ops.append((name, list(op_data.command_generator())))
    return plan, ops


def writes(ops: list[tuple[str, list[Any]]]) -> tuple[dict[str, bytes], list[str]]:
    """What the commands write: file path -> content, and the directories they create with an owner and mode."""
    files: dict[str, bytes] = {}
    dirs: list[str] = []
    for _, commands in ops:
        for command in commands:
            if isinstance(command, FileUploadCommand):
                files[command.dest] = command.src.getvalue()
            elif isinstance(command, FunctionCommand) and command.function.__name__ == "_install_secret":
                path, secret = command.args
                files[path] = secret.reveal().encode()
            elif isinstance(command, StringCommand) and command.get_raw_value().startswith("install -d -o "):
                dirs += command.get_raw_value().split()[8:]
    return files, dirs


def test_every_path_an_operation_writes_is_read_by_the_snapshot(monkeypatch):
    plan, ops = prepare(bare_but_installed(), monkeypatch)
    files, dirs = writes(ops)
    assert {plan.layout.unit_file, plan.layout.env_file, "/etc/apt/keyrings/docker.asc", VERSION_FILE} <= set(files)
    assert plan.paths.nvidia_version_file == VERSION_FILE and files[VERSION_FILE] == VERSION.encode()
    assert set(files) <= set(plan.paths.files), set(files) - set(plan.paths.files)
    assert plan.layout.models_dir in dirs and plan.layout.hf_cache in dirs
    assert set(dirs) <= set(plan.paths.dirs), set(dirs) - set(plan.paths.dirs)


def converged_host(monkeypatch: pytest.MonkeyPatch) -> HostSnapshot:
    """The snapshot of a host where the playbook has converged: what it writes is there, the service serves."""
    plan, ops = prepare(bare_but_installed(), monkeypatch)
    files, dirs = writes(ops)
    spec = plan.spec
    expected = Expected.from_spec(spec)
    converged = bare_but_installed()
    converged.file_sha256 = {path: hashlib.sha256(content).hexdigest() for path, content in files.items()}
    converged.dirs = dict.fromkeys(dirs, ("root", "root", "755"))
    model = f"{plan.settings.model_repo}@{'c' * 40}"  # the commit its ledger keeps, checked on disk
    converged.ledger_text = render(
        Ledger(
            committed=Committed(
                Version(
                    spec.image,
                    REF,
                    unit_sha256=None,
                    spec_hash=spec.spec_hash,
                    service=spec.service,
                    port=spec.port,
                    model=model,
                    model_revision=plan.settings.model_revision,
                ),
                "t0",
            )
        )
    )
    converged.images = [(REF.split("@")[0], "<none>", REF.split("@")[1])]
    converged.model_files = {"config.json": 1, "tokenizer.json": 1, "model.safetensors": 5}
    converged.model_checked = model
    converged.units[unit_name(spec.service)] = ("active", "enabled")
    converged.health_code = "200"
    converged.served_models = [(spec.served_model_name, spec.max_model_len)]
    converged.cache_config = dict(expected.cache_config)
    # The unit text depends on the pin: render it again for the recorded digest.
    _, ops = prepare(converged, monkeypatch)
    unit_upload = next(cmds for name, cmds in ops if name == "Install the vLLM systemd unit")
    converged.file_sha256.update(
        {c.dest: hashlib.sha256(c.src.getvalue()).hexdigest() for c in unit_upload if isinstance(c, FileUploadCommand)}
    )
    return converged


def test_a_converged_host_gets_no_command_from_any_operation(monkeypatch):
    _, ops = prepare(converged_host(monkeypatch), monkeypatch)
    assert len(ops) >= 13 and {name: cmds for name, cmds in ops if cmds} == {}


@pytest.mark.parametrize("setting", ["gpufleet_model_sha", "gpufleet_model_ref"])  # the old name, with a warning
def test_asking_for_another_model_commit_downloads_it_and_changes_the_unit(monkeypatch, caplog, setting):
    """gpufleet_model_sha (a rollout's ask) on a converged host: the model is fetched and checked at that commit,
    and the unit, which names the commit, changes (so the service restarts on it). A moved branch alone does not."""
    converged = converged_host(monkeypatch)
    moved = "d" * 40
    monkeypatch.setitem(globals(), "DATA", {**DATA, setting: moved})
    _, ops = prepare(converged, monkeypatch)
    changed = {name: cmds for name, cmds in ops if cmds}
    [fetch] = changed["Download the model's commit unless it is here and checked"]
    assert isinstance(fetch, FunctionCommand) and fetch.function.__name__ == "_fetch"
    assert fetch.args[1].pin.endswith("@" + moved)
    [upload] = [c for c in changed["Install the vLLM systemd unit"] if isinstance(c, FileUploadCommand)]
    assert f"@{moved}.".encode() in upload.src.getvalue()
    deprecated = "gpu1: gpufleet_model_ref is deprecated (fix: rename it gpufleet_model_sha; it means the same)"
    assert (deprecated in caplog.text) == (setting == "gpufleet_model_ref")


def test_a_server_with_another_max_model_len_is_verified_not_taken_as_ready(monkeypatch):
    # "Ready" means what `gpufleet verify` means: the snapshot's /v1/models is held to the spec's max_model_len.
    snap = bare_but_installed()
    plan = plan_for("gpu1", DATA)
    snap.units[unit_name(plan.spec.service)] = ("active", "enabled")
    snap.health_code = "200"
    snap.served_models = [(plan.spec.served_model_name, 1024)]
    _, ops = prepare(snap, monkeypatch)
    verify = next(cmds for name, cmds in ops if name == "Verify vLLM is ready (/health, /v1/models), else roll back")
    assert [c.function.__name__ for c in verify] == ["verify", "roll_back_if_failed"]


def op_names(snap: HostSnapshot, monkeypatch: pytest.MonkeyPatch, **data: Any) -> list[str]:
    monkeypatch.setitem(globals(), "DATA", {**DATA, **data})
    return [name for name, _ in prepare(snap, monkeypatch)[1]]


def test_prepare_stops_before_the_unit_and_settles_no_ledger(monkeypatch):
    names = op_names(bare_but_installed(), monkeypatch, gpufleet_stage="prepare")
    assert names[-3:] == [
        "Pull the vLLM image and pin its digest",
        "Check the image accepts the serve flags",
        "Download the model's commit unless it is here and checked",
    ]


def pending_on(snap: HostSnapshot, plan: Plan, restarts: int, unit_is_pending: bool = True) -> HostSnapshot:
    """The snapshot of a host whose last run was cut after it began `NEW` over a committed version."""
    old = Version(plan.spec.image, REF, "a" * 64, "0" * 16, plan.spec.service, plan.spec.port)
    new = Version(plan.spec.image, REF[:-1] + "2", "b" * 64, plan.spec.spec_hash, plan.spec.service, plan.spec.port)
    ledger = begin(Ledger(committed=Committed(old, "t0")), new, "ops@laptop pid 7", "t1")
    snap.ledger_text = render(ledger)
    snap.file_sha256[plan.layout.unit_file] = (new if unit_is_pending else old).unit_sha256 or ""
    snap.running = RunningService(
        active_state="active", containers=((new.spec_hash or "", new.ref),), restarts=restarts
    )
    return snap


def test_a_cut_runs_failing_version_is_rolled_back_first_and_nothing_else_runs(monkeypatch):
    plan = plan_for("gpu1", DATA)
    _, ops = prepare(pending_on(bare_but_installed(), plan, restarts=2), monkeypatch)
    assert [(name, [c.function.__name__ for c in cmds]) for name, cmds in ops] == [
        ("Settle the change a cut run left pending", ["roll_back_cut"])
    ]


def test_a_cut_runs_version_that_never_reached_the_unit_is_dropped_and_the_deploy_goes_on(monkeypatch):
    plan = plan_for("gpu1", DATA)
    _, ops = prepare(pending_on(bare_but_installed(), plan, restarts=0, unit_is_pending=False), monkeypatch)
    assert ops[0][0] == "Settle the change a cut run left pending"
    assert [c.function.__name__ for c in ops[0][1]] == ["_drop"] and len(ops) > 10


def test_router_hosts_are_neither_read_nor_deployed(monkeypatch):
    inventory = Inventory(([("gpu1", DATA), ("router1", {"router_port": 8080})], {}), routers=(["router1"], {}))
    state = State(inventory, Config())
    gpu, router = inventory.get_host("gpu1"), inventory.get_host("router1")
    state.activate_host(gpu)
    state.activate_host(router)
    plan = plan_for("gpu1", gpu.data.dict())
    applies: list[Any] = []

    def read_fleet(*args: Any, **kwargs: Any) -> dict[str, Any]:
        applies.append(kwargs["applies"])
        return {"gpu1": preflight.Reading(plan, bare_but_installed(), [])}

    monkeypatch.setattr(preflight, "read_fleet", read_fleet)
    add_deploy(state, deploy_qwen35)
    # One operation for the router, with no command (outside pyinfra's CLI, op hashes count per host: its one op
    # shares the gpu host's first hash, so its name is among that op's names).
    (op_hash,) = router.op_hash_order
    assert "Deploy Qwen 3.5 on vLLM | Skip the vLLM deploy on a router host" in state.get_op_meta(op_hash).names
    with ctx_state.use(state), ctx_host.use(router):
        assert list(state.get_op_data_for_host(router, op_hash).command_generator()) == []
    (only,) = applies  # one preflight, which leaves the router out
    assert only(gpu) and not only(router)


def test_a_corrupt_ledger_is_one_refusal_line_and_nothing_else_is_decided():
    plan = plan_for("gpu1", DATA)
    snap = bare_but_installed()
    snap.ledger_text = '{"schema": 2, "committed": {"image": "x"'
    (line,) = check_host("gpu1", snap, plan)
    assert line.startswith(f"gpu1: {plan.layout.ledger_path} is corrupt: not JSON: ") and "(fix: repair it" in line


def test_a_version_that_failed_is_refused_unless_retried_on_purpose():
    plan = plan_for("gpu1", {**DATA, "gpufleet_image_ref": REF})
    spec = plan.spec
    target = Version(spec.image, REF, None, spec.spec_hash, spec.service, spec.port)
    snap = bare_but_installed()
    snap.free_kib.update(docker=10**9, models=10**9)
    snap.model_files = {"config.json": 1, "tokenizer.json": 1, "model.safetensors": 5}
    snap.ledger_text = render(roll_back(begin(Ledger(), target, "ops@laptop pid 7", "t1"), "dead: exited 1", "t2"))
    (line,) = check_host("gpu1", snap, plan)
    assert line.startswith(f"gpu1: {REF} with spec {spec.spec_hash} failed at t2: dead: exited 1 (fix: ")
    assert (
        check_host("gpu1", snap, plan_for("gpu1", {**DATA, "gpufleet_image_ref": REF, "gpufleet_retry_failed": "true"}))
        == []
    )
    # Another setting is another version: not refused.
    assert (
        check_host(
            "gpu1", snap, plan_for("gpu1", {**DATA, "gpufleet_image_ref": REF, "vllm_args": {"max-num-seqs": 3}})
        )
        == []
    )


def test_a_rename_disables_the_replaced_service_before_the_new_one_starts(monkeypatch):
    # Stopped only, the old unit stayed enabled: a reboot during the new one's soak started both on one GPU set.
    old = Version(DATA["vllm_image"], REF, "a" * 64, "0" * 16, "vllm-qwen35", 5000)
    snap = bare_but_installed()
    snap.other_ledgers = {"/var/lib/gpufleet/vllm-qwen35.json": render(Ledger(committed=Committed(old, "t0")))}
    snap.units["vllm-qwen35.service"] = ("active", "enabled")
    monkeypatch.setitem(globals(), "DATA", {**DATA, "vllm_service": "renamed"})
    _, ops = prepare(snap, monkeypatch)
    started = next(cmds for name, cmds in ops if name == "Enable and start the vLLM service")
    shell = [c.get_raw_value() for c in started if isinstance(c, StringCommand)]
    assert (
        "sh -c '{ systemctl disable --now vllm-qwen35.service || true; } && systemctl start renamed.service'" in shell
    )


def test_a_rename_away_that_was_cut_is_refused_for_the_old_name_and_settled_by_the_new():
    plan = plan_for("gpu1", DATA)  # the old name, vllm-qwen35
    old = Version(plan.spec.image, REF, "a" * 64, "0" * 16, "vllm-qwen35", plan.spec.port)
    new = Version(plan.spec.image, REF, "b" * 64, "1" * 16, "renamed", plan.spec.port)
    snap = bare_but_installed()
    snap.free_kib.update(docker=10**9, models=10**9)
    snap.model_files = {"config.json": 1, "tokenizer.json": 1, "model.safetensors": 5}
    snap.ledger_text = render(Ledger(committed=Committed(old, "t0")))
    # What the cut run left: the new service took the old ledger over and wrote its version pending there.
    cut = render(begin(Ledger(committed=Committed(old, "t0")), new, "ops@laptop pid 7", "t1"))
    snap.other_ledgers = {"/var/lib/gpufleet/renamed.json": cut, "/var/lib/gpufleet/broken.json": "{"}
    (line,) = check_host("gpu1", snap, plan)
    assert line == (
        "gpu1: a run renaming vllm_service 'vllm-qwen35' to 'renamed' was cut before it finished (renamed "
        f"has {REF} pending): converging 'vllm-qwen35' now would start a second vLLM on the same GPUs "
        "(fix: converge once with vllm_service='renamed': it finishes the rename, or rolls it back to "
        "'vllm-qwen35'; then converge with the name you want)"
    )
    # The new name settles it (its own ledger, the pending record): not refused.
    renamed = plan_for("gpu1", {**DATA, "vllm_service": "renamed"})
    snap.ledger_text = cut
    snap.other_ledgers = {"/var/lib/gpufleet/vllm-qwen35.json": render(Ledger(committed=Committed(old, "t0")))}
    assert check_host("gpu1", snap, renamed) == []
    # Another service with its own run cut (not a rename of this one) is its own deploy's business.
    elsewhere = Version(plan.spec.image, REF, "c" * 64, "2" * 16, "elsewhere", plan.spec.port + 1)
    snap.ledger_text = render(Ledger(committed=Committed(old, "t0")))
    snap.other_ledgers = {
        "/var/lib/gpufleet/elsewhere.json": render(
            begin(Ledger(committed=Committed(elsewhere, "t0")), elsewhere, "ops@laptop pid 8", "t1")
        )
    }
    assert check_host("gpu1", snap, plan) == []


def test_the_driver_version_is_recorded_right_after_the_nvidia_steps_and_only_when_read_live(monkeypatch):
    names = [name for name, _ in prepare(bare_but_installed(), monkeypatch)[1]]
    at = names.index("Record the NVIDIA driver's CUDA version")
    assert names[at - 1] == "Register the nvidia runtime with Docker"
    from_file = bare_but_installed()
    from_file.driver_output, from_file.driver_from_file = None, True
    ops = dict(prepare(from_file, monkeypatch)[1])
    assert ops["Record the NVIDIA driver's CUDA version"] == []


def test_preflight_holds_the_driver_to_the_cuda_version_wherever_it_was_read():
    plan = plan_for("gpu1", DATA)
    for from_file in (False, True):
        snap = bare_but_installed()
        snap.free_kib.update(docker=10**9, models=10**9)
        snap.model_files = {"config.json": 1, "tokenizer.json": 1, "model.safetensors": 5}
        snap.driver, snap.driver_from_file = NvidiaVersion("535.104.05", "12.2"), from_file
        snap.driver_output = None if from_file else VERSION.replace("580.159.04", "535.104.05").replace("13.0", "12.2")
        (line,) = check_host("gpu1", snap, plan)
        assert "driver 535.104.05 supports CUDA 12.2, the image needs CUDA >= 13.0" in line


# --- GPU health: a converge that would (re)start the service on a GPU that needs a reset is refused ---------------
def sick(snap: HostSnapshot, faults: dict[int, dict[str, Any]]) -> HostSnapshot:
    """The snapshot with each GPU of `faults` reading its fields (gpufleet.facts.gpu_health.GpuReading), the others
    healthy."""
    from gpufleet.facts.gpu_health import GpuHealth, GpuReading

    snap.gpu_health = GpuHealth(
        gpus=tuple(GpuReading(i, f"00000000:00:0{6 + i}.0", **faults.get(i, {})) for i in range(3))
    )
    return snap


def test_what_a_converge_would_restart_is_read_as_the_operations_decide(monkeypatch):
    from gpufleet.hoststate.ledger import parse
    from gpufleet.vllm.deploy import restart_reason

    plan = plan_for("gpu1", DATA)
    converged = converged_host(monkeypatch)
    ledger = parse(converged.ledger_text)
    assert restart_reason(converged, plan, ledger, REF) is None  # ...and no operation yields a command (above)
    assert restart_reason(bare_but_installed(), plan, Ledger(), None) == "start vllm-qwen35.service (it is not running)"
    other = "reg:5000/vllm/vllm-openai@sha256:" + "2" * 64
    converged.images.append((other.split("@")[0], "<none>", other.split("@")[1]))
    assert restart_reason(converged, plan, ledger, other) == "restart vllm-qwen35.service (its unit changes)"
    secrets = plan_for("gpu1", {**DATA, "vllm_api_key": "sk-other"})
    assert restart_reason(converged, secrets, ledger, REF) == "restart vllm-qwen35.service (its secrets file changes)"
    assert restart_reason(converged, plan_for("gpu1", {**DATA, "gpufleet_stage": "prepare"}), ledger, other) is None


def test_a_restart_onto_a_gpu_pending_a_remap_is_refused_one_line_per_gpu_and_a_no_op_converge_is_not(monkeypatch):
    converged = sick(converged_host(monkeypatch), {0: {"remap_pending": True}})
    assert check_host("gpu1", converged, plan_for("gpu1", DATA)) == []  # nothing restarts: it goes on serving
    other = "reg:5000/vllm/vllm-openai@sha256:" + "2" * 64
    converged.free_kib = {"docker": 10**9, "models": 10**9}  # the new image has room
    (line,) = check_host("gpu1", converged, plan_for("gpu1", {**DATA, "gpufleet_image_ref": other}))
    assert line == (
        "gpu1: GPU 0 (00000000:00:06.0) needs GPU reset: remapped_rows.pending=Yes: this converge would "
        "restart vllm-qwen35.service (its image is still to be pulled) (fix: stop the service and reset the "
        "GPU (`nvidia-smi -r -i 0`), or reboot the host (NVIDIA: RESET_GPU), then converge again "
        "(docs/gpu-health.md: how a verdict clears))"
    )
    both = sick(bare_but_installed(), {0: {"recovery_action": "Reboot"}, 2: {"remap_failure": True}})
    lines = check_host("gpu1", both, plan_for("gpu1", DATA))
    assert [line.split(":", 1)[1].split("(")[0].strip() for line in lines if "GPU" in line] == ["GPU 0", "GPU 2"]
    assert "needs reboot: gpu_recovery_action=Reboot: this converge would start" in lines[-2]
    assert "needs service: remapped_rows.failure=Yes" in lines[-1] and "CONTACT_SUPPORT" in lines[-1]


def test_a_degraded_gpu_or_one_the_service_does_not_use_refuses_nothing():
    from gpufleet.facts.gpu_verdict import judge
    from gpufleet.vllm.checks import gpu_refusals
    from gpufleet.wire.gpu_verdicts import GpuSettings

    degraded = judge(sick(bare_but_installed(), {1: {"clocks_event_reasons": 0x40}}).gpu_health, GpuSettings())
    assert gpu_refusals("gpu1", degraded, (0, 1, 2), "start x (it is not running)") == []
    unused = judge(sick(bare_but_installed(), {2: {"remap_pending": True}}).gpu_health, GpuSettings())
    assert gpu_refusals("gpu1", unused, (0, 1), "start x (it is not running)") == []
    assert len(gpu_refusals("gpu1", unused, (0, 1, 2), "start x (it is not running)")) == 1


def test_the_hosts_verdict_table_setting_decides_what_preflight_refuses():
    def refusals(faults: dict[int, dict[str, Any]], verdicts: dict[str, str] | None = None) -> list[str]:
        data = DATA if verdicts is None else {**DATA, "gpufleet_gpu_verdicts": verdicts}
        return [
            line
            for line in check_host("gpu1", sick(bare_but_installed(), faults), plan_for("gpu1", data))
            if "GPU" in line
        ]

    pending, hot = {0: {"remap_pending": True}}, {1: {"clocks_event_reasons": 0x40}}
    assert len(refusals(pending)) == 1 and refusals(pending, {"remapped_rows.pending=Yes": "degraded"}) == []
    assert refusals(hot) == []
    (line,) = refusals(hot, {"clocks_event_reasons.hw_thermal_slowdown": "service"})
    assert "GPU 1 (00000000:00:07.0) needs service: clocks_event_reasons.hw_thermal_slowdown (0x40)" in line


def test_a_failed_model_move_leaves_the_version_rolled_back_to_convergeable(monkeypatch):
    """A new commit of the model failed its gate on the same digest and settings: a plain converge of the version
    rolled back to is not refused; asking for that commit again is."""
    converged = converged_host(monkeypatch)
    committed = parse(converged.ledger_text).committed
    assert committed is not None and committed.version.model is not None
    bad = "e" * 40
    moved = replace(committed.version, model=f"{committed.version.model.rpartition('@')[0]}@{bad}")
    converged.ledger_text = render(roll_back(begin(Ledger(committed=committed), moved, "ops", "t1"), "dead", "t2"))
    assert check_host("gpu1", converged, plan_for("gpu1", DATA)) == []
    asked = check_host("gpu1", converged, plan_for("gpu1", {**DATA, "gpufleet_model_sha": bad}))
    assert [line for line in asked if "failed at" in line] == [
        f"gpu1: {REF} with spec {committed.version.spec_hash} and model {moved.model} failed at t2: dead (fix: change "
        "vllm_image or a setting, or pass --data gpufleet_retry_failed=true to one converge to try it again on "
        "purpose)"
    ]
