"""The qwen35 playbook, prepared offline by pyinfra's own API on a given snapshot (no host, no SSH).

Proves two contracts of the operations: every path an operation writes is a path the snapshot reads (else
put_content would rewrite it on every run, silently), and a host whose snapshot shows the converged state gets no
command at all (the second converge changes nothing).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State, StringCommand
from pyinfra.api.deploy import add_deploy
from pyinfra.context import ctx_host, ctx_state

from gpufleet.deploys import preflight
from gpufleet.deploys.qwen35 import Plan, deploy_qwen35, plan_for
from gpufleet.facts.host import HostSnapshot
from gpufleet.facts.nvidia import Gpu, NvidiaVersion
from gpufleet.health.check import Expected
from gpufleet.operations.docker import CE_PACKAGES
from gpufleet.operations.nvidia import PACKAGE
from gpufleet.unit import unit_name

KEY = ("-----BEGIN PGP PUBLIC KEY BLOCK-----\n\n" + base64.b64encode(b"key" * 40).decode()
       + "\n-----END PGP PUBLIC KEY BLOCK-----\n")
DATA = {"docker_install": "docker-ce", "vllm_api_key": "sk-test", "vllm_hf_token": "hf_test",
        "vllm_image": "reg:5000/vllm/vllm-openai:nightly"}
REF = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64


def bare_but_installed() -> HostSnapshot:
    """Packages in place (so pyinfra's apt operations, which read their own facts, are not reached), nothing of
    gpufleet's written yet."""
    gpus = [Gpu(i, f"GPU-{i}", "NVIDIA H200", 143771, 0, 143156, "580.159.04", f"0:{i}", "9.0", "Enabled", 30, 0,
                80.0, 700.0) for i in range(3)]
    installed = [*CE_PACKAGES, PACKAGE, "curl", "ca-certificates"]
    return HostSnapshot(os={"ID": "debian", "VERSION_CODENAME": "bookworm"}, arch="amd64", nvidia_smi=True,
                        gpus=gpus, driver=NvidiaVersion("580.159.04", "13.0"),
                        packages=dict.fromkeys(installed, "1"), nvidia_key=KEY, docker_key=KEY,
                        daemon_json={"runtimes": {"nvidia": {}}},
                        units={"docker.service": ("active", "enabled")})


def prepare(snapshot: HostSnapshot, monkeypatch: pytest.MonkeyPatch) -> tuple[Plan, list[tuple[str, list[Any]]]]:
    """Run the playbook as pyinfra prepares it, then every operation's commands in full: [(op name, commands)]."""
    inventory = Inventory(([("gpu1", DATA)], {}))
    state = State(inventory, Config())
    target = inventory.get_host("gpu1")
    state.activate_host(target)
    plan = plan_for("gpu1", target.data.dict())
    # Preflight's SSH read is the one thing replaced: this snapshot is what it would have read.
    monkeypatch.setattr(preflight, "read_fleet", lambda *_: {"gpu1": preflight.Reading(plan, snapshot, [])})
    add_deploy(state, deploy_qwen35)
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
    assert {plan.layout.unit_file, plan.layout.env_file, "/etc/apt/keyrings/docker.asc"} <= set(files)
    assert set(files) <= set(plan.paths.files), set(files) - set(plan.paths.files)
    assert plan.layout.models_dir in dirs and plan.layout.hf_cache in dirs
    assert set(dirs) <= set(plan.paths.dirs), set(dirs) - set(plan.paths.dirs)


def test_a_converged_host_gets_no_command_from_any_operation(monkeypatch):
    plan, ops = prepare(bare_but_installed(), monkeypatch)
    files, dirs = writes(ops)
    spec = plan.spec
    expected = Expected.from_spec(spec)
    converged = bare_but_installed()
    converged.file_sha256 = {path: hashlib.sha256(content).hexdigest() for path, content in files.items()}
    converged.dirs = dict.fromkeys(dirs, ("root", "root", "755"))
    converged.state = {"current": {"image": spec.image, "ref": REF}}
    converged.images = [(REF.split("@")[0], "<none>", REF.split("@")[1])]
    converged.model_files = {"config.json": 1, "tokenizer.json": 1, "model.safetensors": 5}
    converged.units[unit_name(spec.service)] = ("active", "enabled")
    converged.health_code = "200"
    converged.served_models = [(spec.served_model_name, spec.max_model_len)]
    converged.cache_config = dict(expected.cache_config)
    # The unit text depends on the pin: render it again for the recorded digest.
    _, ops = prepare(converged, monkeypatch)
    unit_upload = next(cmds for name, cmds in ops if name == "Install the vLLM systemd unit")
    converged.file_sha256.update({c.dest: hashlib.sha256(c.src.getvalue()).hexdigest() for c in unit_upload
                                  if isinstance(c, FileUploadCommand)})
    _, ops = prepare(converged, monkeypatch)
    assert len(ops) >= 13 and {name: cmds for name, cmds in ops if cmds} == {}


def test_a_server_with_another_max_model_len_is_verified_not_taken_as_ready(monkeypatch):
    # "Ready" means what `gpufleet verify` means: the snapshot's /v1/models is held to the spec's max_model_len.
    snap = bare_but_installed()
    plan = plan_for("gpu1", DATA)
    snap.units[unit_name(plan.spec.service)] = ("active", "enabled")
    snap.health_code = "200"
    snap.served_models = [(plan.spec.served_model_name, 1024)]
    _, ops = prepare(snap, monkeypatch)
    verify = next(cmds for name, cmds in ops if name == "Verify vLLM is ready (/health, /v1/models)")
    assert [c.function.__name__ for c in verify] == ["run"]
