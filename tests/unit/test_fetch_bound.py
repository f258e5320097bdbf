"""`docker pull` from the registry and the model download are ended after vllm_fetch_timeout_s, with one line for the
host, outside a rollout too (a rollout also bounds each deploy run): a registry or hub that stops answering must not
hold the host's lock forever. The commands run here for real, against a `docker` that hangs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpufleet.operations.run import remember
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.operations import image, model
from gpufleet.vllm.operations.image import TIMED_OUT
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.weights import HUB, HubRevision, ModelTarget
from tests.unit.test_operations_alone import run_alone

TAG = "reg:5000/vllm/vllm-openai:good"
PINNED = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64


class RunState:
    """Stands for pyinfra's State: the host memos are kept per state (weakly)."""


class HangingDockerHost:
    """Runs each command here, with a `docker` on PATH that never answers; keeps what the run logged."""

    name, data, connector = "gpu1", {"ssh_user": "root"}, None

    def __init__(self, bin_dir: Path) -> None:
        self.state = RunState()
        self.bin_dir, self.logged = bin_dir, []

    def run_shell_command(self, command: str, **_: Any):
        proc = subprocess.run(
            ["sh", "-c", f"PATH={self.bin_dir}:$PATH; {command}"], capture_output=True, text=True, timeout=60
        )
        out = (proc.stdout + proc.stderr).splitlines()
        return proc.returncode == 0, SimpleNamespace(
            output_lines=out, stdout_lines=proc.stdout.splitlines(), stderr_lines=proc.stderr.splitlines()
        )

    def log_styled(self, message: str, **_: Any) -> None:
        self.logged.append(message)


@pytest.fixture
def hanging(tmp_path, monkeypatch):
    (tmp_path / "docker").write_text("#!/bin/sh\nexec sleep 600\n")
    (tmp_path / "docker").chmod(0o755)
    monkeypatch.setattr(image, "use_sudo", lambda host: False)
    target = HangingDockerHost(tmp_path)
    remember(target, HostSnapshot())
    return target


def test_a_pull_that_hangs_is_ended_at_the_bound_with_one_line(hanging):
    started = time.monotonic()
    assert image._pull(None, hanging, TAG, PINNED, timeout_s=1) is False  # type: ignore[arg-type]
    assert time.monotonic() - started < 30
    assert hanging.logged[-1] == (
        f"gpu1: docker pull {PINNED} did not finish within vllm_fetch_timeout_s = 1 s and "
        "was ended (fix: check that gpu1 reaches the registry; a slow line needs a larger "
        "vllm_fetch_timeout_s)"
    )


def test_a_model_download_that_hangs_is_ended_at_the_bound_with_one_line(hanging):
    spec = build_spec("gpu1", {"vllm_image": TAG})
    started = time.monotonic()
    revision = HubRevision("Qwen/Qwen3.5-27B-FP8", "c" * 40, ())
    assert (
        model._download(
            hanging,
            spec,
            PINNED,
            revision,
            endpoint=HUB,
            env_file=None,
            hf_cache="/srv/hf",
            where="/srv/m",
            refused=[],  # type: ignore[arg-type]
            timeout_s=1,
        )
        == TIMED_OUT
    )
    assert time.monotonic() - started < 30
    assert model._timed_out(hanging, revision.repo, 1) is False  # type: ignore[arg-type]
    assert hanging.logged[-1].startswith(
        "gpu1: the model download of Qwen/Qwen3.5-27B-FP8 did not finish within "
        "vllm_fetch_timeout_s = 1 s and was ended (fix: "
    )


def test_the_deploy_gives_both_the_setting(monkeypatch):
    (pull,) = run_alone(image.pinned, HostSnapshot(), image=TAG, ref=PINNED, timeout_s=14400.0)
    assert pull.kwargs["timeout_s"] == 14400.0
    spec = build_spec("gpu1", {"vllm_image": TAG})
    (download,) = run_alone(
        model.present,
        HostSnapshot(),
        spec=spec,
        where="/srv/m",
        model=ModelTarget("Qwen/x", None),
        env_file=None,
        hf_cache="/srv/hf",
        pin=PINNED,
        timeout_s=14400.0,
    )
    assert download.kwargs["timeout_s"] == 14400.0
