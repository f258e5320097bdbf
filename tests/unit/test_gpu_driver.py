"""The GPU evidence run's driver (bench/gpu/driver.py, docs/gpu.md): the server it starts runs the profile's flags and
env, changed only where docs/gpu.md says why."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from gpufleet.vllm.profiles import PROFILES

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_driver", REPO / "bench" / "gpu" / "driver.py")
assert _spec and _spec.loader
driver = importlib.util.module_from_spec(_spec)
sys.modules["gpu_driver"] = driver  # dataclasses look their module up there
_spec.loader.exec_module(driver)


def flags(argv: list[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for i, token in enumerate(argv):
        if token.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            out[token[2:]] = True if following.startswith("--") else following
    return out


def test_the_gpu_server_runs_the_profiles_flags_but_for_the_documented_changes():
    argv = driver.serve_argv("qwen35", "gpu", 18100)
    assert argv[:2] == ["serve", driver.MODEL_IN_CONTAINER]
    got = flags(argv)
    changes = {c.name: c.value for c in driver.GPU if c.kind == "flag"}
    for name, value in PROFILES["qwen35"].vllm_args.items():
        if name in ("model", "port"):
            continue
        expected = changes.get(name, value)
        assert got.get(name) == (None if expected is None else expected if expected is True else str(expected)), name
    assert got["port"] == "18100" and "pipeline-parallel-size" not in got
    assert set(got) - set(PROFILES["qwen35"].vllm_args) == {c for c in changes if c not in PROFILES["qwen35"].vllm_args}


def test_a_fault_leaves_out_only_the_named_flags():
    whole, fault = (
        driver.serve_argv("qwen35", "gpu", 1),
        driver.serve_argv("qwen35", "gpu", 1, without=("tool-call-parser", "enable-auto-tool-choice")),
    )
    assert set(flags(whole)) - set(flags(fault)) == {"tool-call-parser", "enable-auto-tool-choice"}


def test_the_container_env_is_the_profiles_with_the_run_s_own_and_nothing_of_the_caller(monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64")
    monkeypatch.setenv("SECRET_OF_THE_CALLER", "x")
    env = driver.container_env("qwen35", "gpu", "/opt/torch/.venv/bin/python3", "/opt/gpurun/site")
    profile = PROFILES["qwen35"].env
    assert env["LD_LIBRARY_PATH"] == profile["LD_LIBRARY_PATH"] + ":/usr/local/nvidia/lib64"
    assert "VLLM_USE_FLASHINFER_MOE_FP16" not in env and "SECRET_OF_THE_CALLER" not in env
    assert {k: env[k] for k in profile if k not in ("LD_LIBRARY_PATH", "VLLM_USE_FLASHINFER_MOE_FP16")} == {
        k: v for k, v in profile.items() if k not in ("LD_LIBRARY_PATH", "VLLM_USE_FLASHINFER_MOE_FP16")
    }
    assert env["HOME"] == "/root" and env["PYTHONPATH"] == "/opt/gpurun/site"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_docs_gpu_names_every_change_the_gpu_run_makes():
    table = (REPO / "docs" / "gpu.md").read_text().split("### The profile's flags on one GPU", 1)[1].split("\n## ")[0]
    for change in driver.GPU:
        shown = f"`--{change.name}`" if change.kind == "flag" else f"`{change.name}`"
        assert shown in table or f"`--{change.name}`," in table, change.name
