"""`gpufleet render` / `gpufleet lint` on inventory files, through click's runner."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from gpufleet.cli import main
from tests.unit.systemd_words import split_exec
from tests.unit.test_spec import sh_argv


@pytest.fixture
def inventory(tmp_path):
    def write(hosts: str, group_all: str = "") -> str:
        # A fresh directory per inventory: pyinfra caches compiled inventory files by path within a process.
        directory = tmp_path / f"inv{len(list(tmp_path.iterdir()))}"
        (directory / "group_data").mkdir(parents=True)
        (directory / "group_data" / "all.py").write_text(textwrap.dedent(group_all))
        path = directory / "inventory.py"
        path.write_text(textwrap.dedent(hosts))
        return str(path)

    return write


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_render_prints_each_host_then_its_command(inventory):
    inv = inventory(
        'boxes = [("a", {"vllm_port": 5001}), ("b", {"vllm_gpus": [3, 4, 5]})]\n',
        'vllm_image = "registry.local/vllm/vllm-openai:nightly"\n',
    )
    result = run("render", inv)
    assert result.exit_code == 0, result.output
    blocks = result.output.split("# host: ")[1:]
    assert [b.splitlines()[0] for b in blocks] == ["a", "b"]
    argv_b = sh_argv(blocks[1].split("\n", 1)[1])
    assert argv_b[argv_b.index("--gpus") + 1] == '"device=3,4,5"'
    assert "registry.local/vllm/vllm-openai:nightly" in argv_b


def test_render_unit_for_one_host(inventory):
    inv = inventory('boxes = [("a", {}), ("b", {"vllm_port": 6000})]\n')
    result = run("render", inv, "--host", "b", "--unit")
    assert result.exit_code == 0
    assert result.output.startswith("# host: b\n# Managed by gpufleet")
    exec_line = next(line for line in result.output.splitlines() if line.startswith("ExecStart="))
    assert "6000:6000" in split_exec(exec_line[len("ExecStart=") :])


def test_invalid_data_exits_2_with_one_line_errors_and_no_traceback(inventory):
    inv = inventory('boxes = [("a", {"vllm_port": 0}), ("b", {"vllm_args": {"kv-cache-dtype": "fp7"}})]\n')
    result = run("render", inv)
    assert result.exit_code == 2  # bad input
    lines = [line for line in result.output.splitlines() if line]
    assert lines[0].startswith("Error: a: vllm_port: ") and lines[1].startswith("b: vllm_args['kv-cache-dtype']: ")
    assert "Traceback" not in result.output


def test_lint_warns_with_exit_0_and_errors_with_exit_1(inventory):
    result = run("lint", inventory('boxes = [("a", {})]\n'))
    assert result.exit_code == 0
    assert "a: warning [privileged-exposes-all-gpus]" in result.output
    result = run("lint", inventory('boxes = [("a", {"vllm_gpus": []})]\n'))
    assert result.exit_code == 1 and "a: vllm_gpus:" in result.output


def test_missing_inventory_and_broken_inventory_are_one_liners(inventory, tmp_path):
    result = run("render", str(tmp_path / "nope.py"))
    assert result.exit_code == 2 and "inventory file not found" in result.output
    result = run("render", inventory("boxes = [(\n"))
    assert result.exit_code == 2 and "cannot load inventory: SyntaxError" in result.output


def test_console_script_runs_on_the_shipped_example_inventory():
    out = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli", "render", "inventories/lab.py", "--host", "gpu-box-1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("# host: gpu-box-1\ndocker run")


def test_hostile_settings_are_one_line_each_from_render_and_lint(inventory):
    inv = inventory(
        'boxes = [("a", {"vllm_args": {"served-model-name": "m\\nExecStartPre=/bin/id"}}),\n'
        '         ("b", {"vllm_service": "sshd", "vllm_args": {"override-generation-config": {"x": {1}}}}),\n'
        '         ("c\\rd", {})]\n'
    )
    expected = [
        "a: vllm_args['served-model-name']: holds a control character (U+000A), which would end a line of the systemd "
        "unit (fix: remove it: only printable characters are allowed)",
        "b: vllm_service: 'sshd' names a system unit, which the deploy would replace and restart (fix: use a name of "
        'its own, e.g. "vllm-qwen35")',
        "b: vllm_args['override-generation-config']: is not JSON-serialisable (TypeError: Object of type set is not "
        'JSON serializable) (fix: give a JSON object, e.g. {"temperature": 0.6})',
        "c\\rd: inventory host name: holds a control character (U+000D), which would break the unit's header and "
        "every log line (fix: rename the host in the inventory)",
    ]
    for command, code in (("render", 2), ("lint", 1)):  # lint finds invalid settings: its errors (docs/cli.md)
        result = run(command, inv)
        assert result.exit_code == code and "Traceback" not in result.output
        assert result.output.removeprefix("Error: ").splitlines() == expected


def test_render_shows_secret_env_names_never_values(inventory):
    inv = inventory(
        'boxes = [("a", {"vllm_secret_env": {"WANDB_API_KEY": "wandb-s3cr3t"}, "vllm_api_key": "sk-k3y"})]\n'
    )
    for args in ((), ("--unit",)):
        result = run("render", inv, *args)
        assert result.exit_code == 0 and "WANDB_API_KEY" in result.output
        assert "s3cr3t" not in result.output and "k3y" not in result.output


def test_an_inventory_raising_a_multi_line_error_is_still_one_line(inventory):
    path = inventory('raise ValueError("first line\\nExecStartPre=/bin/id")\n')
    result = run("render", path)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.splitlines() == [
        f"Error: {path}: cannot load inventory: ValueError: first line\\nExecStartPre=/bin/id "
        f"(fix: correct {path}: `python3 {path}` shows the whole error)"
    ]


def test_router_hosts_are_neither_rendered_nor_linted(inventory):
    # A router host carries router_* settings that a vLLM host would refuse as unknown: the vLLM views skip it.
    inv = inventory(
        'boxes = [("a", {}), ("b", {"vllm_port": 5001})]\n'
        'routers = [("front", {"router_policy": "consistent_hash"})]\n',
        'vllm_image = "registry.local/vllm/vllm-openai:nightly"\n',
    )
    rendered = run("render", inv)
    assert rendered.exit_code == 0, rendered.output
    assert [line for line in rendered.output.splitlines() if line.startswith("# host:")] == ["# host: a", "# host: b"]
    linted = run("lint", inv)
    assert linted.exit_code == 0, linted.output
    assert "2 host(s)" in linted.output
