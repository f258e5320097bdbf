"""Profiles: found by module, their model defaults resolved host > group > profile, their renders golden."""

from __future__ import annotations

import ast
import re
import sys
import textwrap

import pytest

from gpufleet.errors import SettingErrors
from gpufleet.inventory import load_vllm_hosts
from gpufleet.vllm.lint import lint_spec
from gpufleet.vllm.profiles import PROFILES, discover
from gpufleet.vllm.settings import build_spec, merged_settings, resolve_host
from tests.conftest import FIXTURES, REPO
from tests.unit import test_cli_render
from tests.unit.systemd_words import split_exec
from tests.unit.test_cli_render import run
from tests.unit.test_spec import sh_argv

GOLDEN = FIXTURES / "profiles"
inventory = test_cli_render.inventory  # the fixture: inventory(hosts, group_all) -> path of a fresh inventory


def render(inventory_path: str, *args: str) -> str:
    result = run("render", inventory_path, *args)
    assert result.exit_code == 0, result.output
    return result.output


def exec_start(unit_text: str) -> list[str]:
    return split_exec(
        next(line for line in unit_text.splitlines() if line.startswith("ExecStart=")).removeprefix("ExecStart=")
    )


# --- golden renders: what a host with default settings runs, per profile ------------------------------------
@pytest.mark.parametrize("name", sorted(PROFILES))
def test_render_equals_the_golden_docker_run_token_for_token(name, inventory):
    golden = GOLDEN / f"{name}.docker-run.sh"
    assert golden.is_file(), f"profile {name} has no golden render: see docs/profiles.md, 'Adding a profile'"
    out = render(inventory(f'boxes = [("gpu-box-1", {{"vllm_profile": "{name}"}})]\n'))
    assert sh_argv(out) == sh_argv(golden.read_text())
    assert out == golden.read_text()


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_unit_equals_the_golden_unit(name, inventory):
    golden = GOLDEN / f"{name}.service"
    assert golden.is_file(), f"profile {name} has no golden unit: see docs/profiles.md, 'Adding a profile'"
    out = render(inventory(f'boxes = [("gpu-box-1", {{"vllm_profile": "{name}"}})]\n'), "--unit")
    assert exec_start(out) == exec_start(golden.read_text())
    assert out == golden.read_text()  # byte for byte: any difference restarts every host that runs the profile


def test_the_default_profile_is_the_seed_golden_profile():
    # The seed golden test (test_spec.py) renders a host without vllm_profile: that is the qwen35 fixture.
    spec = build_spec("gpu-box-1", {})
    assert spec.docker_run_argv() == sh_argv((GOLDEN / "qwen35.docker-run.sh").read_text())


def test_every_golden_fixture_belongs_to_a_profile():
    names = {re.sub(r"\.(docker-run\.sh|service)$", "", p.name) for p in GOLDEN.iterdir()}
    assert names == set(PROFILES)


# --- discovery: one module is one profile -------------------------------------------------------------------
def package(tmp_path, monkeypatch, name: str, modules: dict[str, str]):
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    for module, text in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    return sys.modules[name]


LLAMA = """
    from dataclasses import replace
    from gpufleet.vllm.profiles import qwen35
    PROFILE = replace(qwen35.PROFILE, name="llama", service="vllm-llama")
"""


def test_a_new_module_is_a_new_profile_without_a_list_to_edit(tmp_path, monkeypatch):
    found = discover(package(tmp_path, monkeypatch, "profiles_one", {"llama": LLAMA, "_helpers": "X = 1\n"}))
    assert list(found) == ["llama"] and found["llama"].service == "vllm-llama"


def test_a_module_without_a_profile_or_with_a_taken_name_is_refused(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match=r"profiles_two\.notes defines no PROFILE"):
        discover(package(tmp_path, monkeypatch, "profiles_two", {"notes": "TEXT = 'x'\n"}))
    with pytest.raises(ValueError, match="'llama' is taken"):
        discover(package(tmp_path, monkeypatch, "profiles_three", {"a": LLAMA, "b": LLAMA}))


def test_the_shipped_profiles():
    assert set(PROFILES) >= {"qwen35", "qwen35-1gpu"}


# --- resolution: host data > group data > the profile's default ---------------------------------------------
def test_profile_defaults_follow_the_profile():
    one = merged_settings({"vllm_profile": "qwen35-1gpu"})
    assert (one["vllm_gpus"], one["vllm_service"], one["vllm_cache_dir"]) == (
        [0],
        "vllm-qwen35-1gpu",
        "/var/cache/vllm/qwen35-1gpu",
    )
    assert one["vllm_model_repo"] == "Qwen/Qwen3.5-35B-A3B-FP8" and one["vllm_model"] == "qwen3.5-35b-a3b-fp8"
    assert merged_settings({})["vllm_service"] == "vllm-qwen35"


def test_host_data_wins_over_group_data_which_wins_over_the_profile(inventory):
    inv = inventory(
        'boxes = [("a", {}), ("b", {"vllm_service": "vllm-b", "vllm_profile": "qwen35"})]\n',
        'vllm_profile = "qwen35-1gpu"\nvllm_model = "fp8-staged"\n',
    )
    a, b = (merged_settings(data) for _, data in load_vllm_hosts(inv))
    assert (a["vllm_profile"], a["vllm_model"], a["vllm_service"], a["vllm_gpus"]) == (
        "qwen35-1gpu",
        "fp8-staged",
        "vllm-qwen35-1gpu",
        [0],
    )
    assert (b["vllm_model"], b["vllm_service"], b["vllm_gpus"], b["vllm_cache_dir"]) == (
        "fp8-staged",
        "vllm-b",
        [0, 1, 2],
        "/var/cache/vllm/qwen35",
    )


def test_resolve_host_returns_the_spec_and_the_settings_it_was_built_from():
    data = {"vllm_profile": "qwen35-1gpu", "vllm_port": 5001}
    spec, settings = resolve_host("box", data)
    merged = merged_settings(data)
    assert spec == build_spec("box", data)
    assert spec.service == settings.service == merged["vllm_service"] == "vllm-qwen35-1gpu"
    assert (settings.port, settings.gpus, settings.cache_dir) == (
        5001,
        tuple(merged["vllm_gpus"]),
        merged["vllm_cache_dir"],
    )


def test_the_example_inventory_leaves_each_hosts_model_to_its_profile(tmp_path):
    # The shipped group data set vllm_model, vllm_model_repo and vllm_cache_dir for the whole fleet: a host the
    # README told to use "qwen35-1gpu" then rendered the 3-GPU AWQ model and shared the other service's caches.
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "all.py").write_text((REPO / "inventories" / "group_data" / "all.py").read_text())
    lab = (REPO / "inventories" / "lab.py").read_text()
    (tmp_path / "lab.py").write_text(lab + '\ngpu_boxes.append(("one-gpu", {"vllm_profile": "qwen35-1gpu"}))\n')
    hosts = dict(load_vllm_hosts(str(tmp_path / "lab.py")))
    one, three = merged_settings(hosts["one-gpu"]), merged_settings(hosts["gpu-box-1"])
    assert one == merged_settings({**hosts["one-gpu"], **PROFILES["qwen35-1gpu"].settings}), "a group value won"
    assert (one["vllm_model"], one["vllm_cache_dir"]) == ("qwen3.5-35b-a3b-fp8", "/var/cache/vllm/qwen35-1gpu")
    assert (three["vllm_model"], three["vllm_cache_dir"]) == ("qwen3.5-awq", "/var/cache/vllm/qwen35")


def test_an_unknown_profile_is_one_line_naming_the_profiles():
    with pytest.raises(SettingErrors) as raised:
        build_spec("box", {"vllm_profile": "qwen35-2gpu", "vllm_model": "x"})
    (error,) = raised.value.errors
    assert str(error) == "box: vllm_profile: unknown profile 'qwen35-2gpu' (fix: use one of: qwen35, qwen35-1gpu)"


# --- the single-GPU profile ---------------------------------------------------------------------------------
def test_single_gpu_profile_has_no_pipeline_and_keeps_the_prefix_caching_settings():
    spec = build_spec("box", {"vllm_profile": "qwen35-1gpu"})
    assert spec.gpus == (0,) and spec.arg("pipeline-parallel-size") is None
    assert spec.prefix_caching and spec.mamba_cache_mode == "align" and spec.hybrid
    assert spec.arg("enable-chunked-prefill") is True and spec.arg("performance-mode") == "interactivity"
    assert spec.arg("kv-cache-dtype") == "fp8_e4m3" and spec.max_model_len == 262144
    assert int(spec.arg("max-num-batched-tokens")) >= 2096  # above the aligned block size (docs/vllm-traps.md)


def test_single_gpu_profile_refuses_more_gpus_than_its_layout():
    with pytest.raises(SettingErrors) as raised:
        build_spec("box", {"vllm_profile": "qwen35-1gpu", "vllm_gpus": [0, 1]})
    (error,) = raised.value.errors
    assert error.setting == "vllm_gpus" and "set vllm_args pipeline-parallel-size to 2" in str(error)


def test_single_gpu_profile_can_sit_beside_qwen35_on_one_host():
    seed = build_spec("box", {})
    one = build_spec("box", {"vllm_profile": "qwen35-1gpu", "vllm_port": 5001, "vllm_gpus": [3]})
    assert seed.service != one.service and seed.container_label.split("=")[0] != one.container_label.split("=")[0]
    models = seed.mounts[0].host_path
    assert one.mounts[0].host_path == models and seed.model_path != one.model_path
    assert not {m.host_path for m in seed.mounts[1:]} & {m.host_path for m in one.mounts[1:]}


def test_single_gpu_profile_avoids_the_traps_qwen35_keeps():
    ids = {
        f.rule.id
        for f in lint_spec(
            build_spec("box", {"vllm_profile": "qwen35-1gpu"}), merged_settings({"vllm_profile": "qwen35-1gpu"})
        )
    }
    seed_ids = {f.rule.id for f in lint_spec(build_spec("box", {}), merged_settings({}))}
    avoided = {
        "mamba-block-size-ignored",
        "flashinfer-moe-fp16-deprecated",
        "pytorch-alloc-conf-alone",
        "trust-remote-code-unneeded",
        "no-shutdown-timeout",
        "jit-cache-outside-mounts",
    }
    assert avoided <= seed_ids and not avoided & ids
    assert "privileged-exposes-all-gpus" in ids  # kept on purpose: docs/profiles.md says why


# --- the profile doc's table is the code's ------------------------------------------------------------------
def test_docs_profiles_table_lists_each_profiles_defaults():
    text = (REPO / "docs" / "profiles.md").read_text()
    table = text.split("## The settings a profile supplies", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    header = [cell.strip(" `") for cell in rows[0].strip("|").split("|")][1:]
    documented = {}
    for line in rows[2:]:
        setting, *values = (cell.strip().strip("`") for cell in line.strip("|").split("|"))
        documented[setting] = dict(zip(header, map(ast.literal_eval, values), strict=True))
    assert set(header) == set(PROFILES)
    for name, profile in PROFILES.items():
        assert {setting: by_profile[name] for setting, by_profile in documented.items()} == profile.settings
