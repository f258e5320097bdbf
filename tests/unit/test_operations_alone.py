"""Each operation on its own: its inputs as arguments, a snapshot set for the host, its commands read back."""

from __future__ import annotations

import hashlib
from typing import Any

from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State
from pyinfra.context import ctx_host, ctx_state

from gpufleet.facts.host import HostSnapshot
from gpufleet.facts.nvidia import NvidiaVersion
from gpufleet.ledger import Committed, Ledger, Version
from gpufleet.operations import image, nvidia, service
from gpufleet.operations.layout import state_file
from gpufleet.operations.secret import Hidden
from gpufleet.operations.service import env_content
from gpufleet.operations.snapshot import memo, remember
from gpufleet.settings import build_spec
from gpufleet.unit import render_unit, unit_path

TAG = "reg:5000/vllm/vllm-openai:nightly"
PINNED = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64
RESOLVED = "reg:5000/vllm/vllm-openai@sha256:" + "2" * 64


def run_alone(operation: Any, snap: HostSnapshot, resolved: str | None = None, ledger: Ledger | None = None,
              **arguments: Any) -> list[Any]:
    inventory = Inventory(([("gpu1", {})], {}))
    target = inventory.get_host("gpu1")
    state = State(inventory, Config())
    remember(target, snap)
    memo(target).resolved_image_ref = resolved
    memo(target).ledger = ledger or Ledger()
    with ctx_state.use(state), ctx_host.use(target):
        return list(operation._inner(**arguments))


def test_env_file_takes_hidden_secrets_and_never_shows_them():
    secrets = {"VLLM_API_KEY": Hidden("sk-s3cret"), "HF_TOKEN": None}
    (command,) = run_alone(service.env_file, HostSnapshot(), path="/etc/gpufleet/v.env", secrets=secrets)
    assert isinstance(command, FunctionCommand) and "s3cret" not in repr(command)
    written = hashlib.sha256(env_content({"VLLM_API_KEY": "sk-s3cret"}).encode()).hexdigest()
    assert run_alone(service.env_file, HostSnapshot(file_sha256={"/etc/gpufleet/v.env": written}),
                     path="/etc/gpufleet/v.env", secrets=secrets) == []


def recorded(ref: str = PINNED) -> Ledger:
    return Ledger(committed=Committed(Version(TAG, ref, None, None, "v", 5000), "t0"))


def test_pinned_reuses_the_recorded_digest_and_pulls_a_missing_one_by_digest():
    present = HostSnapshot(images=[("reg:5000/vllm/vllm-openai", "<none>", "sha256:" + "1" * 64)])
    assert run_alone(image.pinned, present, image=TAG, ref=PINNED) == []
    (pull,) = run_alone(image.pinned, HostSnapshot(), image=TAG, ref=PINNED)
    assert pull.args == (TAG, PINNED)
    (pull,) = run_alone(image.pinned, HostSnapshot(), image=TAG, ref=None)  # a tag never resolved on the host
    assert pull.args == (TAG, TAG)


def test_unit_renders_the_digest_resolved_while_executing_over_the_recorded_one():
    spec = build_spec("gpu1", {"vllm_image": TAG})
    path = unit_path(spec.service)
    snap = HostSnapshot(file_sha256={path: hashlib.sha256(render_unit(spec, PINNED).encode()).hexdigest()})
    # the recorded pin is what runs
    assert run_alone(service.unit, snap, ledger=recorded(), spec=spec, path=path, state_file=state_file("v")) == []
    commands = run_alone(service.unit, snap, resolved=RESOLVED, ledger=recorded(), spec=spec, path=path,
                         state_file=state_file("v"))
    (upload,) = [c for c in commands if isinstance(c, FileUploadCommand)]
    assert upload.src.getvalue().decode() == render_unit(spec, RESOLVED)


VERSION = "NVIDIA-SMI version  : 580.159.04\nDRIVER version      : 580.159.04\nCUDA Version        : 13.0\n"


def test_version_file_records_what_nvidia_smi_answered_live_when_the_file_differs():
    live = HostSnapshot(nvidia_smi=True, driver=NvidiaVersion("580.159.04", "13.0"), driver_output=VERSION)
    mkdir, upload = run_alone(nvidia.version_file, live)
    assert mkdir.get_raw_value() == "install -d -m 755 /var/lib/gpufleet"  # a host gpufleet never converged
    assert isinstance(upload, FileUploadCommand) and upload.dest == nvidia.VERSION_FILE == "/var/lib/gpufleet/nvidia-version"
    assert upload.src.getvalue() == VERSION.encode() and upload.mode == "644"
    live.file_sha256[nvidia.VERSION_FILE] = hashlib.sha256(b"DRIVER version : 535.104.05\n").hexdigest()
    assert len(run_alone(nvidia.version_file, live)) == 2  # another driver's answer is replaced
    live.file_sha256[nvidia.VERSION_FILE] = hashlib.sha256(VERSION.encode()).hexdigest()
    assert run_alone(nvidia.version_file, live) == []


def test_version_file_writes_nothing_when_read_from_it_or_without_a_usable_answer():
    from_file = HostSnapshot(nvidia_smi=True, driver=NvidiaVersion("580.159.04", "13.0"), driver_from_file=True)
    broken = HostSnapshot(nvidia_smi=True, nvidia_error="nvidia-smi failed: NVIDIA-SMI has failed")
    for snap in (from_file, broken, HostSnapshot()):  # HostSnapshot(): no nvidia-smi
        assert run_alone(nvidia.version_file, snap) == []
