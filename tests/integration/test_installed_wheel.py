"""gpufleet works from an installed wheel, without a checkout: the wheel built from this tree and installed into a
fresh venv outside it, run from a directory that is no checkout, on one fresh test host (nspawn, SSH, sudo, dockerd,
the stand-in vLLM image). Steps in file order (pytest keeps it):

1. `gpufleet deploy INV -y` converges the host with the deploy shipped in the package; `gpufleet verify INV` (the
   installed CLI) passes; a second `gpufleet deploy` reports zero changes;
2. the host's image tag moves (a manifest copied through the registry's HTTP API, as a nightly tag moves);
   `gpufleet rollout INV --yes` of the installed CLI, whose deploy file is then the package's own, moves it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.sandbox.image import image_ref
from gpufleet.sandbox.registry import move_tag
from tests.integration.fleets import module_tag
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.test_deploy_qwen35 import committed_ref, write_inventory

REPO = Path(__file__).resolve().parents[2]
PACKAGED_DEPLOY = "site-packages/gpufleet/data/deploys/qwen35.py"
# The stand-in is ready in seconds; a broken one should fail the test quickly.
DATA = {"vllm_ready_timeout": 90, "vllm_ready_soak_s": 10}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with the wheel of this tree installed; its dependencies pinned to the dev
    venv's versions (pip's own sources: the registry, its cache, configured find-links)."""
    root = tmp_path_factory.mktemp("wheel")
    assert REPO not in root.parents
    dist, env_dir = root / "dist", root / "venv"
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)], check=True)
    (wheel,) = dist.glob("gpufleet-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
    ).stdout
    constraints = root / "constraints.txt"
    constraints.write_text(
        "".join(
            f"{line}\n" for line in frozen.splitlines() if "==" in line and not line.lower().startswith("gpufleet==")
        )
    )
    subprocess.run(
        [
            str(env_dir / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-c",
            str(constraints),
            str(wheel),
        ],
        check=True,
    )
    print(f"wheel built and installed in {time.monotonic() - start:.1f} s")
    return env_dir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Where the installed CLI runs: no checkout here (no deploys/, no inventories/)."""
    return tmp_path_factory.mktemp("elsewhere")


def installed(venv: Path, workdir: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """The installed CLI as a user runs it from the activated venv: stdout and stderr together in .stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", VIRTUAL_ENV=str(venv))
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def host(module_host):
    return module_host


@pytest.fixture(scope="module")
def tag() -> str:
    return module_tag("wheel")


@pytest.fixture(scope="module")
def inventory(fleet, host, tag, tmp_path_factory) -> Path:
    """The host alone, vllm_image on the module's own tag (at `good` to begin with)."""
    move_tag(fleet.cfg.registry, tag, "good")
    return write_inventory(
        tmp_path_factory.mktemp("wheel-inv"),
        fleet.write_inventory(),
        [host.name],
        {host.name: {**DATA, "vllm_image": image_ref(fleet.cfg, tag)}},
    )


def test_the_installed_package_is_the_wheels(venv, workdir):
    proc = installed(venv, workdir, "python", "-c", "import gpufleet; print(gpufleet.__file__)")
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.strip().startswith(str(venv)), proc.stdout
    assert not (workdir / "deploys").exists()


def test_deploy_converges_from_the_installed_package_and_again_changes_nothing(venv, workdir, inventory):
    start = time.monotonic()
    first = installed(venv, workdir, "gpufleet", "deploy", str(inventory), "-y")
    assert first.returncode == 0, first.stdout[-4000:]
    assert PACKAGED_DEPLOY in first.stdout  # the command it ran, shown first
    print(f"first deploy: {time.monotonic() - start:.1f} s")
    verify = installed(venv, workdir, "gpufleet", "verify", str(inventory))
    assert verify.returncode == 0, verify.stdout[-4000:]
    again = installed(venv, workdir, "gpufleet", "deploy", str(inventory), "-y")
    assert again.returncode == 0, again.stdout[-4000:]
    assert changes(again.stdout) == 0, changed_ops(again.stdout)


def test_rollout_from_the_installed_cli_uses_the_packaged_deploy(venv, workdir, inventory, fleet, host, tag):
    before = committed_ref(fleet, host)
    target = move_tag(fleet.cfg.registry, tag, "good-next")
    assert target != before
    log = workdir / "rollout.log"
    proc = installed(venv, workdir, "gpufleet", "rollout", str(inventory), "--yes", "--log", str(log))
    assert proc.returncode == 0, proc.stdout[-4000:] + (log.read_text()[-4000:] if log.exists() else "")
    assert PACKAGED_DEPLOY in log.read_text()  # no checkout: default_deploy_file() fell back to the package's
    assert committed_ref(fleet, host) == target
    verify = installed(venv, workdir, "gpufleet", "verify", str(inventory))
    assert verify.returncode == 0, verify.stdout[-4000:]
