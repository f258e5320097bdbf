"""RunSettings: what the rollout passes to one deploy run, as the exact `--data` pairs, under names gpufleet.defaults
owns, and read back by pyinfra's own parser into values the deploy's settings accept."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet import defaults
from gpufleet.rollout.deploy_run import RunSettings
from gpufleet.rollout.swap import SwapOptions
from gpufleet.wire.checks import SERVING_CHECKS
from gpufleet.wire.speed import SpeedFigures

REF = "reg:5000/vllm/vllm-openai@sha256:" + "a" * 64
OLD = "reg:5000/vllm/vllm-openai@sha256:" + "b" * 64
EVERY = RunSettings(
    image_ref=REF,
    stage="prepare",
    verify_checks=("cached-cold", "tools"),
    expect_committed={"gpu1": OLD, "gpu2": None},
    verify_probe=True,
    retry_failed=True,
)


def as_pyinfra_reads(args: list[str]) -> dict[str, object]:
    """`--data k=v ...` as pyinfra hands them to the deploy's host data."""
    from pyinfra_cli.util import parse_cli_arg

    assert args[::2] == ["--data"] * (len(args) // 2)
    return {key: parse_cli_arg(value) for key, _, value in (arg.partition("=") for arg in args[1::2])}


def test_every_field_becomes_its_exact_data_pair():
    assert EVERY.data_args() == [
        "--data",
        f"gpufleet_image_ref={REF}",
        "--data",
        "gpufleet_stage=prepare",
        "--data",
        "gpufleet_verify_checks=cached-cold,tools",
        "--data",
        f'gpufleet_expect_committed={{"gpu1":"{OLD}","gpu2":null}}',
        "--data",
        "gpufleet_verify_probe=true",
        "--data",
        "gpufleet_retry_failed=true",
    ]


def test_the_names_are_the_ones_defaults_owns_and_each_is_a_setting():
    names = [arg.partition("=")[0] for arg in EVERY.data_args()[1::2]]
    assert names == [
        defaults.IMAGE_REF_SETTING,
        defaults.STAGE_SETTING,
        defaults.VERIFY_CHECKS_SETTING,
        defaults.EXPECT_COMMITTED_SETTING,
        defaults.VERIFY_PROBE_SETTING,
        defaults.RETRY_SETTING,
    ]
    owned = [value for name, value in vars(defaults).items() if name.endswith("_SETTING")]
    assert owned and all(name in defaults.DEFAULTS for name in owned)
    assert len(set(owned)) == len(owned)


def test_an_unset_field_is_not_passed_so_the_hosts_own_value_stands():
    assert RunSettings().data_args() == []
    assert RunSettings(verify_probe=False, retry_failed=False).data_args() == []
    # No serving check is still a value (the hosts after the canary): "none", not the host's list.
    assert RunSettings(verify_checks=()).data_args() == ["--data", "gpufleet_verify_checks=none"]
    assert RunSettings(expect_committed={}).data_args() == ["--data", "gpufleet_expect_committed={}"]


def test_pyinfra_reads_back_each_value_and_the_deploys_settings_accept_them():
    from gpufleet.vllm.settings import build_spec, merged_settings

    data = as_pyinfra_reads(EVERY.data_args())
    assert data == {
        "gpufleet_image_ref": REF,
        "gpufleet_stage": "prepare",
        "gpufleet_verify_checks": "cached-cold,tools",
        "gpufleet_expect_committed": {"gpu1": OLD, "gpu2": None},
        "gpufleet_verify_probe": True,
        "gpufleet_retry_failed": True,
    }
    host = {"vllm_image": "reg:5000/vllm/vllm-openai:nightly", **data}
    assert build_spec("gpu1", host) is not None  # raises SettingErrors on any value it refuses
    assert merged_settings(host)[defaults.STAGE_SETTING] == "prepare"


def test_a_stage_the_deploy_does_not_know_is_refused_when_built():
    with pytest.raises(ValueError, match="not one of converge, prepare"):
        RunSettings(stage="swap")  # type: ignore[arg-type]


def test_a_check_the_deploy_does_not_know_is_refused_when_built():
    with pytest.raises(ValueError, match="unknown check warmup"):
        RunSettings(verify_checks=("tools", "warmup"))
    assert RunSettings(verify_checks=SERVING_CHECKS).data_args()[1] == "gpufleet_verify_checks=" + ",".join(
        SERVING_CHECKS
    )


def test_a_swap_and_a_prepare_build_their_run_settings():
    options = SwapOptions(Path("deploys/qwen35.py"), probe=True, canary_checks=("sessions",))
    committed = {"gpu1": OLD}
    assert options.run_settings(REF, committed=committed, canary=True) == RunSettings(
        image_ref=REF, verify_checks=("sessions",), expect_committed=committed, verify_probe=True
    )
    assert options.run_settings(REF, canary=False).verify_checks == ()


def test_prepare_runs_the_prepare_stage_on_the_target(monkeypatch, tmp_path):
    from gpufleet.rollout import prepare as rollout_prepare
    from gpufleet.rollout.deploy_run import DeployRun

    seen: list[RunSettings] = []

    def run_deploy(inventory, hosts, settings, deploy_file, log=None, timeout_s=None):
        seen.append(settings)
        return DeployRun(tuple(hosts), 0, "", 0.1)

    monkeypatch.setattr(rollout_prepare, "run_deploy", run_deploy)
    monkeypatch.setattr(rollout_prepare, "pull_order", lambda inventory, hosts: [list(hosts)])
    assert rollout_prepare.prepare("inv.py", ["gpu1"], REF, tmp_path / "deploy.py")[1] == {}
    assert seen == [RunSettings(image_ref=REF, stage="prepare")]


def test_a_model_move_is_passed_to_every_run_of_the_rollout():
    commit = "c" * 40
    assert RunSettings(image_ref="r@sha256:ab", model_sha=commit, stage="prepare").data_args() == [
        "--data",
        "gpufleet_image_ref=r@sha256:ab",
        "--data",
        f"gpufleet_model_sha={commit}",
        "--data",
        "gpufleet_stage=prepare",
    ]
    swap = SwapOptions(deploy_file=Path("d.py"), model_sha=commit).run_settings("r@sha256:ab")
    assert swap.model_sha == commit and "--data" in swap.data_args()
    assert "gpufleet_model_sha" not in " ".join(RunSettings(image_ref="r@sha256:ab").data_args())


# --- the speed check: the old version's figures reach the deploy run ---------------------------------------------------
FIGURES = SpeedFigures(
    (30000.0, 31000.0, 29000.0),
    (0.05, 0.06, 0.04),
    (200.0, 201.0, 199.0),
    (380.0, 390.0, 370.0),
    prompt_tokens=20480,
    decode_tokens=64,
    concurrency=2,
)


def test_the_old_versions_speed_figures_reach_the_deploys_settings_as_measured():
    from gpufleet.vllm.settings import resolve_host

    settings = RunSettings(image_ref=REF, verify_checks=("speed",), speed_baseline={"gpu1": FIGURES})
    data = as_pyinfra_reads(settings.data_args())
    assert list(data) == ["gpufleet_image_ref", "gpufleet_verify_checks", "gpufleet_speed_baseline"]
    _, s = resolve_host("gpu1", {"vllm_image": "reg:5000/vllm/vllm-openai:nightly", **data})
    assert s.speed_baseline == {"gpu1": FIGURES} and s.verify_checks == ("speed",)
    assert RunSettings(speed_baseline={}).data_args() == []  # nothing measured: the check records only


@pytest.mark.parametrize(("name", "value", "words"), [
    ("gpufleet_speed_baseline", {"gpu1": {"prompt_tokens": 5}}, "speed figures need exactly"),
    ("gpufleet_speed_baseline", [1], "not a map of host name to figures"),
    ("gpufleet_speed_tolerance", 1.5, "is not a fraction between 0 and 1"),
    ("gpufleet_speed_tolerance", 0, "is not a fraction between 0 and 1"),
    ("gpufleet_speed_tolerance", True, "is not a fraction between 0 and 1"),
    ("gpufleet_speed_batches", "yes", "is not true/false"),
])  # fmt: skip
def test_a_speed_setting_the_check_cannot_use_is_refused_naming_it(name, value, words):
    from gpufleet.errors import SettingErrors
    from gpufleet.vllm.settings import build_spec

    with pytest.raises(SettingErrors) as err:
        build_spec("gpu1", {name: value})
    (line,) = [str(e) for e in err.value.errors]
    assert line.startswith(f"gpu1: {name}: ") and words in line, line


def test_the_canary_runs_speed_and_a_batch_only_when_its_hosts_ask_for_it():
    options = SwapOptions(Path("deploys/qwen35.py"))
    assert options.batch_checks(canary=True)[0] == "speed"
    assert options.batch_checks(canary=False) == ()
    assert options.batch_checks(canary=False, speed_batch=True) == ("speed",)
    skipped = SwapOptions(Path("d.py"), canary_checks=("tools",))  # --no-check speed: no batch measures either
    assert skipped.batch_checks(canary=False, speed_batch=True) == ()
    settings = options.run_settings(REF, canary=False, speed_batch=True, speed_baseline={"gpu2": FIGURES})
    assert (settings.verify_checks, settings.speed_baseline) == (("speed",), {"gpu2": FIGURES})
