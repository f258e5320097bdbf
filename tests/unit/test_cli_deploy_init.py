"""`gpufleet deploy` (pyinfra on the deploy files shipped in the package) and `gpufleet init` (a starter inventory
that renders and lints clean), offline: pyinfra itself is replaced by a recorder here; the real run from an
installed wheel is tests/integration/test_installed_wheel.py."""

from __future__ import annotations

import ast
import itertools
import os
import stat
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

import gpufleet.rollout.deploy_run as rollout_deploy
from gpufleet.cli import deploy as deploy_cli
from gpufleet.cli import main
from gpufleet.cli.init import parallel_sizes
from gpufleet.harness import packaged_deploy_file

REPO = Path(__file__).resolve().parents[2]


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


# --- the deploy files shipped in the package ------------------------------------------------------------------
def statements(path: Path) -> list[str]:
    """The file's statements without its docstring: what pyinfra executes."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [ast.dump(node) for node in body]


@pytest.mark.parametrize("name", ["qwen35", "router"])
def test_the_checkouts_deploy_files_are_the_packaged_ones(name):
    packaged = packaged_deploy_file(name)
    assert packaged.is_file() and statements(packaged)
    # One file, two paths: `pyinfra INV deploys/<name>.py` from a checkout runs exactly what the package ships.
    assert (REPO / "deploys" / f"{name}.py").resolve() == packaged.resolve()


def test_default_deploy_file_falls_back_to_the_packaged_one_without_a_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert rollout_deploy.default_deploy_file() == REPO / "deploys" / "qwen35.py"  # the checkout it runs from
    # Installed from a wheel: site-packages/gpufleet/rollout/deploy_run.py has no deploys/ three levels up.
    fake = tmp_path / "venv" / "lib" / "site-packages" / "gpufleet" / "rollout" / "deploy_run.py"
    monkeypatch.setattr(rollout_deploy, "__file__", str(fake))
    assert rollout_deploy.default_deploy_file() == packaged_deploy_file("qwen35")
    (tmp_path / "deploys").mkdir()
    (tmp_path / "deploys" / "qwen35.py").write_text("")
    assert rollout_deploy.default_deploy_file() == Path("deploys/qwen35.py")  # a checkout in the working directory


# --- gpufleet deploy ------------------------------------------------------------------------------------------
@pytest.fixture
def pyinfra_runs(monkeypatch):
    """Record each pyinfra command instead of running it; the exit status of each run is taken from `codes`."""
    runs: list[list[str]] = []
    codes: list[int] = []

    def fake_run(argv, *args, **kwargs):
        runs.append(list(argv))
        return subprocess.CompletedProcess(argv, codes.pop(0) if codes else 0)

    monkeypatch.setattr(deploy_cli.subprocess, "run", fake_run)
    return runs, codes


def write_fleet(tmp_path: Path, router: bool) -> str:
    args = ["init", str(tmp_path / "fleet"), "--host", "gpu-1=10.0.0.1", "--host", "gpu-2=10.0.0.2"]
    code, out = invoke(*args, *(["--router", "10.0.0.9"] if router else []))
    assert code == 0, out
    return str(tmp_path / "fleet" / "inventory.py")


def test_deploy_runs_pyinfra_of_the_venv_on_the_packaged_deploy_with_pyinfras_options(tmp_path, pyinfra_runs):
    runs, _ = pyinfra_runs
    inventory = write_fleet(tmp_path, router=False)
    code, out = invoke("deploy", inventory, "--dry", "--limit", "gpu-1", "-y", "--data", "vllm_ready_timeout=60")
    assert code == 0, out
    assert runs == [
        [
            rollout_deploy.pyinfra_command(),
            inventory,
            str(packaged_deploy_file("qwen35")),
            "--dry",
            "--limit",
            "gpu-1",
            "-y",
            "--data",
            "vllm_ready_timeout=60",
        ]
    ]
    assert "$ " in out  # the command it runs is shown


def test_deploy_runs_the_routers_after_the_vllm_hosts(tmp_path, pyinfra_runs):
    runs, _ = pyinfra_runs
    inventory = write_fleet(tmp_path, router=True)
    code, out = invoke("deploy", inventory, "-y")
    assert code == 0, out
    assert [Path(run[2]).name for run in runs] == ["qwen35.py", "router.py"]
    assert all(run[1] == inventory and run[3:] == ["-y"] for run in runs)


@pytest.mark.parametrize(
    ("args", "deploys"),
    [
        (["--limit", "gpu-1"], ["qwen35.py"]),  # a replica only: the router run would change nothing
        (["--limit=gpu-*"], ["qwen35.py"]),
        (["--limit", "router-1"], ["qwen35.py", "router.py"]),
        (["--limit", "routers"], ["qwen35.py", "router.py"]),  # a group name
        (["--only", "router"], ["router.py"]),
        (["--only", "vllm"], ["qwen35.py"]),
    ],
)
def test_deploy_runs_the_router_deploy_only_where_limit_reaches_a_router(tmp_path, pyinfra_runs, args, deploys):
    runs, _ = pyinfra_runs
    code, out = invoke("deploy", write_fleet(tmp_path, router=True), *args)
    assert code == 0, out
    assert [Path(run[2]).name for run in runs] == deploys
    assert "--only" not in runs[0]  # gpufleet's own option is not pyinfra's


def test_deploy_exits_with_pyinfras_status_and_skips_the_router_after_a_failure(tmp_path, pyinfra_runs):
    runs, codes = pyinfra_runs
    inventory = write_fleet(tmp_path, router=True)
    codes.append(3)
    code, out = invoke("deploy", inventory, "-y")
    assert code == 3
    assert len(runs) == 1 and "routers inventory group was not deployed" in out and "fix:" in out
    runs.clear()
    codes.extend([0, 1])
    assert invoke("deploy", inventory, "-y")[0] == 1  # the router run's status


def test_deploy_refuses_a_deploy_file_of_its_own(tmp_path, pyinfra_runs):
    runs, _ = pyinfra_runs
    code, out = invoke("deploy", write_fleet(tmp_path, router=False), "deploys/qwen35.py")
    assert code == 2 and "deploys/qwen35.py" in out and "fix:" in out
    assert runs == []


def test_deploy_passes_a_non_file_inventory_to_pyinfra(pyinfra_runs):
    runs, _ = pyinfra_runs
    code, _ = invoke("deploy", "@local", "--dry")
    assert code == 0 and [run[1] for run in runs] == ["@local"]


def test_help_says_how_to_deploy():
    code, out = invoke("--help")
    assert code == 0 and "gpufleet deploy" in out and "gpufleet init" in out


# --- gpufleet init --------------------------------------------------------------------------------------------
OPTION_SETS = {
    "one host, the profile's GPUs": ["--host", "gpu-box-1=192.168.1.50"],
    "mixed boxes and a router": [
        "--host",
        "gpu-box-1=192.168.1.50",
        "--host",
        "gpu-box-2=192.168.1.51",
        "--host",
        "big=box.example.lan",
        "--gpus",
        "gpu-box-2=0,1",
        "--gpus",
        "big=4,5,6,7",
        "--router",
        "192.168.1.40",
        "--ssh-user",
        "ops",
    ],
    "every box on 6 GPUs": ["--host", "a=10.1.0.1", "--host", "b=10.1.0.2", "--gpus", "0,1,2,3,4,5"],
    "8 and 1 GPUs": ["--host", "a=10.1.0.1", "--host", "b=10.1.0.2", "--gpus", "0,1,2,3,4,5,6,7", "--gpus", "b=3"],
    "one-GPU profile": [
        "--host",
        "solo=10.1.0.7",
        "--profile",
        "qwen35-1gpu",
        "--router",
        "10.1.0.8",
        "--router",
        "10.1.0.9",
    ],
    "one-GPU profile on GPU 1": ["--host", "solo=10.1.0.7", "--profile", "qwen35-1gpu", "--gpus", "1"],
}


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_init_writes_an_inventory_that_renders_and_lints_clean(tmp_path, options):
    target = tmp_path / "fleet"
    code, out = invoke("init", str(target), *options)
    assert code == 0, out
    inventory = target / "inventory.py"
    assert inventory.is_file() and (target / "group_data" / "all.py").is_file()
    code, rendered = invoke("render", str(inventory))
    assert code == 0, rendered
    hosts = [v.split("=")[0] for o, v in itertools.pairwise(options) if o == "--host"]
    assert [line.removeprefix("# host: ") for line in rendered.splitlines() if line.startswith("# host: ")] == hosts
    code, linted = invoke("lint", str(inventory), "--strict")
    assert code == 0, linted
    assert " 0 error(s), 0 warning(s), 0 info" in linted, linted
    code, as_json = invoke("lint", str(inventory), "--strict", "--json")
    assert code == 0 and '"findings": []' in as_json


def test_init_comments_each_setting_and_keeps_the_api_key_private(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # DIR as a user gives it: the files' comments name it
    target = tmp_path / "fleet"
    assert invoke("init", "fleet", *OPTION_SETS["mixed boxes and a router"])[0] == 0
    group_data = target / "group_data" / "all.py"
    assert stat.S_IMODE(group_data.stat().st_mode) == 0o600
    for path in (target / "inventory.py", group_data):
        lines = path.read_text().splitlines()
        settings = [node.lineno for node in ast.parse(path.read_text()).body if isinstance(node, ast.Assign)]
        assert len(settings) >= 4
        for n in settings:  # a comment on the setting's line or just above it
            assert "#" in lines[n - 1] or lines[n - 2].startswith("#"), f"{path.name}:{n}: {lines[n - 1]}"
        assert max(len(line) for line in lines) <= 120
        assert ".md" in path.read_text()
    text = group_data.read_text()
    assert 'ssh_user = "ops"' in text and 'vllm_api_key = "sk-' in text
    other = tmp_path / "other"
    assert invoke("init", str(other), "--host", "a=10.0.0.1")[0] == 0
    assert (other / "group_data" / "all.py").read_text().split("vllm_api_key")[1] != text.split("vllm_api_key")[1]


def test_init_refuses_to_overwrite(tmp_path):
    target = tmp_path / "fleet"
    assert invoke("init", str(target), "--host", "a=10.0.0.1")[0] == 0
    before = (target / "inventory.py").read_text()
    code, out = invoke("init", str(target), "--host", "b=10.0.0.2")
    assert code == 2
    assert len(out.strip().splitlines()) == 1, out
    assert "already exists" in out and "another DIR" in out and "--force" in out
    assert (target / "inventory.py").read_text() == before
    code, out = invoke("init", str(target), "--host", "b=10.0.0.2", "--force")
    assert code == 0, out
    assert "10.0.0.2" in (target / "inventory.py").read_text()


def test_init_force_never_writes_the_key_into_a_wider_file_or_through_a_link(tmp_path, monkeypatch):
    target = tmp_path / "fleet"
    assert invoke("init", str(target), "--host", "a=10.0.0.1")[0] == 0
    group_data = target / "group_data" / "all.py"
    group_data.chmod(0o644)  # an old file, opened up since
    modes: list[int] = []
    real_fdopen = os.fdopen

    def watched(fd, *args, **kwargs):  # the mode of every file init writes, when it writes its first byte
        f = real_fdopen(fd, *args, **kwargs)
        write = f.write
        f.write = lambda text: modes.append(stat.S_IMODE(os.fstat(f.fileno()).st_mode)) or write(text)
        return f

    monkeypatch.setattr(os, "fdopen", watched)
    assert invoke("init", str(target), "--host", "b=10.0.0.2", "--force")[0] == 0
    assert modes == [0o644, 0o600], modes  # inventory.py, then all.py: 0600 before the key's first byte
    # A link planted at all.py (to a file its owner can read) is replaced, not written through.
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    group_data.unlink()
    group_data.symlink_to(victim)
    assert invoke("init", str(target), "--host", "c=10.0.0.3", "--force")[0] == 0
    assert victim.read_text() == "mine\n"
    assert not group_data.is_symlink() and stat.S_IMODE(group_data.stat().st_mode) == 0o600
    assert sorted(p.name for p in group_data.parent.iterdir()) == ["all.py"]  # no temp file left


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (["--host", "gpu-box-1"], "--host gpu-box-1: no address"),
        (["--host", "gpu-box-1="], "--host gpu-box-1=: no address"),
        (["--host", "=10.0.0.1"], "--host =10.0.0.1"),
        (["--host", "a=10.0.0.1", "--host", "a=10.0.0.2"], "given twice"),
        ([], "--host: no host given"),
        (["--host", "a=10.0.0.1", "--profile", "qwen99"], "--profile qwen99: no such profile"),
        (["--host", "a=10.0.0.1", "--gpus", "b=0,1"], "--gpus b=0,1: no host 'b'"),
        (["--host", "a=10.0.0.1", "--gpus", "0,x"], "--gpus 0,x"),
        (["--host", "a=10.0.0.1", "--gpus", "0,0"], "listed twice"),
        (["--host", "a=10.0.0.1", "--gpus", "0,1,2,3,4"], "--gpus: a has 5 GPUs"),
        (["--host", "a=10.0.0.1", "--router", "bad address"], "--router bad address"),
        (["--host", "a=10.0.0.1", "--ssh-user", "Bad User"], "--ssh-user Bad User"),
    ],
)
def test_init_bad_input_is_one_line_naming_the_option_and_the_fix(tmp_path, options, names):
    code, out = invoke("init", str(tmp_path / "fleet"), *options)
    assert code == 2
    assert len(out.strip().splitlines()) == 1, out
    assert names in out and "(fix: " in out, out
    assert not (tmp_path / "fleet").exists()  # nothing written


def test_parallel_sizes_keep_pipeline_parallel_to_three_stages():
    assert {n: parallel_sizes(n) for n in (1, 2, 3, 4, 5, 6, 8)} == {
        1: (1, 1),
        2: (1, 2),
        3: (1, 3),
        4: (2, 2),
        5: None,
        6: (2, 3),
        8: (4, 2),
    }


def test_deploy_under_verbose_passes_v_to_pyinfra_and_under_quiet_shows_no_command_line(tmp_path, pyinfra_runs):
    from gpufleet.cli.logs import NORMAL, set_verbosity

    runs, _ = pyinfra_runs
    inventory = write_fleet(tmp_path, router=False)
    try:
        code, _ = invoke("-v", "deploy", inventory, "-y")
        assert code == 0 and runs[-1][3:] == ["-v", "-y"]
        code, _ = invoke("-v", "deploy", inventory, "-vv")
        assert code == 0 and runs[-1][3:] == ["-vv"]  # the user's own verbosity stands
        code, out = invoke("-q", "deploy", inventory, "-y")
        assert code == 0 and runs[-1][3:] == ["-y"] and "$ " not in out
    finally:
        set_verbosity(NORMAL)
