"""The router's supply chain offline: the committed lock of vllm-router's wheels, the requirements rendered from it
per Python, pip's argv, the venv switch and its facts, and real pip refusing a wheel whose hash is not the lock's."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shlex
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State, StringCommand
from pyinfra.api.exceptions import DeployError
from pyinfra.context import ctx_host, ctx_state

from gpufleet.errors import SettingError, SettingErrors
from gpufleet.hostlock import Holder, LockLost
from gpufleet.operations.run import host_run, still_locked
from gpufleet.router import deploy, facts, operations, wheels
from gpufleet.router.facts import RouterHost
from gpufleet.router.settings import DEFAULTS, build_router_spec
from gpufleet.router.spec import MARKER, RouterSpec
from gpufleet.router.unit import render_unit
from gpufleet.sandbox import rootfs
from gpufleet.sandbox.router_index import PYTHON as SANDBOX_PYTHON
from gpufleet.sandbox.router_index import check_files, write_simple_index

VERSION = DEFAULTS["router_version"]
WORKERS = ("http://10.0.0.11:5000",)
LINE = re.compile(r"([a-z0-9-]+)==([^ ]+) --hash=sha256:([0-9a-f]{64})")


def spec(**data: object) -> RouterSpec:
    return build_router_spec("router1", data, WORKERS)


# --- the committed lock ----------------------------------------------------------------------------------------------
def test_the_committed_lock_is_well_formed_and_covers_the_hosts_pythons():
    data = wheels.load()
    assert wheels.check(data) == []
    release = data["releases"][VERSION]
    # Debian bookworm (3.11, the sandbox's test hosts too), Ubuntu 24.04 (3.12), Debian trixie (3.13).
    for python in ("3.11", "3.12", "3.13", SANDBOX_PYTHON):
        assert set(release[python]) >= {"x86_64", "aarch64"}, python
    assert rootfs.SUITE == "bookworm" and SANDBOX_PYTHON == "3.11"


def test_the_controllers_python_is_covered_too():
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert here in wheels.load()["releases"][VERSION]


@pytest.mark.parametrize("python", ["3.11", "3.13"])
def test_requirements_pin_every_wheel_by_version_and_sha256_for_that_python(python):
    install = wheels.locked_install("router1", VERSION, python, "x86_64")
    text = install.requirements()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    parsed = [LINE.fullmatch(line) for line in lines]
    assert all(parsed), [line for line, m in zip(lines, parsed, strict=True) if not m]
    pinned = {m[1]: (m[2], m[3]) for m in parsed if m}
    assert pinned["vllm-router"][0] == VERSION
    assert len(pinned) == len(lines) >= 10  # vllm-router and its dependencies, each once
    by_name = {w.name: w for w in install.wheels}
    for name, (version, digest) in pinned.items():
        wheel = by_name[name]
        assert (wheel.version, wheel.sha256) == (version, digest)
        tag = wheel.filename.removesuffix(".whl").split("-")[-3:]
        assert tag[0] in ("py3", f"cp{python.replace('.', '')}", "cp38", "cp39") and tag[1] in (
            "none",
            "abi3",
            f"cp{python.replace('.', '')}",
        ), wheel.filename
        assert "x86_64" in tag[2] or tag[2] == "any", wheel.filename


def test_each_python_gets_its_own_compiled_wheels_and_its_own_key():
    a = wheels.locked_install("router1", VERSION, "3.11", "x86_64")
    b = wheels.locked_install("router1", VERSION, "3.13", "x86_64")
    core = {w.name: w for w in a.wheels}["pydantic-core"], {w.name: w for w in b.wheels}["pydantic-core"]
    assert "cp311" in core[0].filename and "cp313" in core[1].filename and core[0].sha256 != core[1].sha256
    assert a.key != b.key and a.key == hashlib.sha256(a.requirements().encode()).hexdigest()
    assert a.requirements() == wheels.locked_install("other", VERSION, "3.11", "x86_64").requirements()


def test_a_python_the_lock_does_not_cover_is_one_line_naming_host_setting_and_fix():
    with pytest.raises(SettingError) as caught:
        wheels.locked_install("router1", VERSION, "3.10", "x86_64")
    text = str(caught.value)
    assert "\n" not in text and text.startswith("router1: router_version: ")
    assert "Python 3.10 on x86_64" in text and "3.11 on aarch64/x86_64" in text
    assert (
        f"(fix: lock them: python -m gpufleet.router.relock --version {VERSION} --python 3.10 --machine x86_64" in text
    )
    with pytest.raises(SettingError, match=r"^router1: router_version: .*riscv64.*\(fix: "):
        wheels.locked_install("router1", VERSION, "3.11", "riscv64")
    with pytest.raises(SettingError, match=r"^router1: router_version: cannot tell which Python.*\(fix: "):
        wheels.locked_install("router1", VERSION, None, "x86_64")


def test_a_router_version_the_lock_does_not_have_is_refused_with_the_settings():
    with pytest.raises(SettingErrors) as caught:
        spec(router_version="0.1.16")
    (line,) = str(caught.value).splitlines()
    assert line.startswith("router1: router_version: 0.1.16 is not in gpufleet's lock of router wheels")
    assert "(fix: choose a locked version, or lock it: python -m gpufleet.router.relock --version 0.1.16" in line


def test_a_host_the_lock_does_not_cover_is_refused_before_any_operation(monkeypatch):
    called: list[str] = []
    for name in ("package", "members", "unit", "running", "ready", "old_venvs", "workers_in_step", "front_door"):
        monkeypatch.setattr(deploy.operations, name, lambda *a, _n=name, **k: called.append(_n))
    monkeypatch.setattr(deploy, "ready_workers", lambda state: deploy.Workers((), ()))
    inventory = Inventory(([("router1", {})], {}), routers=(["router1"], {}))
    target = inventory.get_host("router1")
    # Not connected over SSH: preflight takes no lock and reads the router's fact as a command of its own.
    monkeypatch.setattr(target, "get_fact", lambda *a, **k: RouterHost(python="3.9", machine="x86_64"))
    state = State(inventory, Config())
    state.activate_host(target)
    with ctx_state.use(state), ctx_host.use(target), pytest.raises(DeployError) as caught:
        deploy.deploy_router._inner()  # type: ignore[attr-defined]
    assert called == []
    head, line = str(caught.value).splitlines()
    assert head == "preflight refused 1 of 1 host(s); nothing was changed on any host:"
    assert re.fullmatch(r"  router1: router_version: .*Python 3\.9 on x86_64.*\(fix: .*\)", line)


# --- pip's argv ------------------------------------------------------------------------------------------------------
def test_pip_installs_only_the_locked_wheels_checking_each_hash():
    s = spec()
    argv = s.pip_install_argv("/opt/vllm-router.venvs/abc", "/opt/vllm-router.venvs/abc/reqs.txt")
    assert argv[0] == "/opt/vllm-router.venvs/abc/bin/pip" and argv[1] == "install"
    assert "--require-hashes" in argv and "--no-deps" in argv
    assert argv[argv.index("--only-binary") + 1] == ":all:"
    assert argv[argv.index("--index-url") + 1] == "https://pypi.org/simple"
    assert argv[-2:] == ["-r", "/opt/vllm-router.venvs/abc/reqs.txt"]
    assert not any(a.startswith("vllm-router") for a in argv)  # nothing outside the requirements file


# --- the venv in use: facts and decisions ----------------------------------------------------------------------------
INSTALL = wheels.locked_install("router1", VERSION, "3.11", "x86_64")


def converged(s: RouterSpec, **over: Any) -> RouterHost:
    name = INSTALL.key[:16]
    seen = RouterHost(
        python="3.11",
        machine="x86_64",
        python3_venv=True,
        venv_link=s.venv_dir(INSTALL.key),
        venvs={name: INSTALL.key, "0123456789abcdef": "f" * 64},
        venv_previous=f"{s.venvs_dir}/0123456789abcdef",
        unit_sha256=_sha(render_unit(s)),
        active_state="active",
        enabled=True,
        live_workers=WORKERS,
        nftables=True,
        fenced=True,
    )
    return replace(seen, **over)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def run_alone(operation: Any, **arguments: Any) -> list[Any]:
    inventory = Inventory(([("router1", {})], {}))
    with ctx_state.use(State(inventory, Config())), ctx_host.use(inventory.get_host("router1")):
        return list(operation._inner(**arguments))


def test_the_fact_reads_the_venv_in_use_its_marker_and_the_hosts_python():
    key = INSTALL.key
    seen = facts.parse(
        [
            "python=3.11",
            "machine=x86_64",
            f"venv_link=/opt/vllm-router.venvs/{key[:16]}",
            "venv_previous=/opt/vllm-router.venvs/0123456789abcdef",
            f"venvs {key[:16]} {key}",
            "venvs 0123456789abcdef " + "f" * 64,
            "venvs fedcba9876543210",
        ]
    )
    assert (seen.python, seen.machine, seen.venv_key, seen.venv_legacy) == ("3.11", "x86_64", key, False)
    assert seen.venvs["fedcba9876543210"] == ""  # an install that never finished
    # No python3 yet: apt's candidate tells which Python the venv will get.
    assert facts.parse(["python=", "python_candidate=3.13.5-1", "machine=aarch64"]).python == "3.13"
    legacy = facts.parse(["venv_legacy=yes", "dist=vllm_router-0.1.17.dist-info"])
    assert legacy.venv_legacy and legacy.venv_key is None and legacy.installed_version == "0.1.17"
    # The link points at a venv whose install never finished: nothing is installed.
    assert facts.parse(["venv_link=/opt/vllm-router.venvs/fedcba9876543210", "venvs fedcba9876543210"]).venv_key is None


def test_a_converged_router_host_changes_nothing():
    s = spec()
    seen = converged(s)
    for op in (
        operations.package,
        operations.fence,
        operations.old_venvs,
        operations.running,
        operations.workers_in_step,
    ):
        assert run_alone(op, spec=s, seen=seen, install=INSTALL) == [], op
    assert run_alone(operations.ready, spec=s, seen=seen, install=INSTALL, timeout_s=5) == []


def test_the_fence_is_loaded_at_each_start_and_again_under_a_router_that_lost_it():
    s = spec()
    # A ruleset flushed under the running router: loaded again now, without a restart.
    (load,) = run_alone(operations.fence, spec=s, seen=converged(s, fenced=False), install=INSTALL)
    assert shlex.split(str(load)) == s.fence_argv()
    # A router about to (re)start loads it itself (its unit's ExecStartPre).
    assert (
        run_alone(operations.fence, spec=s, seen=converged(s, fenced=False, active_state="inactive"), install=INSTALL)
        == []
    )
    # No nftables yet: installed first.
    first = run_alone(operations.fence, spec=s, seen=converged(s, nftables=False, fenced=False), install=INSTALL)
    assert "nftables" in str(first[-2]) and shlex.split(str(first[-1])) == s.fence_argv()
    seen = facts.parse(["nftables=install_ok_installed", "fenced=yes"])
    assert seen.nftables and seen.fenced and not facts.parse([]).fenced
    assert "list table inet gpufleet-router-28000" in facts.command(s, ())


def test_a_new_lock_entry_installs_in_a_venv_of_its_own_then_switches_and_restarts():
    s = spec()
    other = wheels.locked_install("router1", VERSION, "3.13", "x86_64")  # e.g. the host upgraded to trixie
    commands = run_alone(operations.package, spec=s, seen=converged(s), install=other)
    made, upload, install, switch = commands
    target = s.venv_dir(other.key)
    assert isinstance(made, StringCommand) and f"rm -rf {target} && python3 -m venv {target}" in str(made)
    assert isinstance(upload, FileUploadCommand) and upload.dest == f"{target}/{operations.REQUIREMENTS}"
    assert upload.src.getvalue().decode() == other.requirements()
    assert "--require-hashes" in str(install) and f"{target}/{MARKER}" in str(install)
    assert "mv -T /opt/vllm-router.gpufleet-tmp /opt/vllm-router" in str(switch)
    restart = run_alone(operations.running, spec=s, seen=converged(s), install=other)
    assert "restart" in " ".join(map(str, restart))
    # The venv in use becomes the previous one, kept; the one before it goes.
    assert [str(c) for c in run_alone(operations.old_venvs, spec=s, seen=converged(s), install=other)] == [
        f"rm -rf {s.venvs_dir}/0123456789abcdef"
    ]


def test_a_whole_venv_of_the_entry_is_switched_to_without_reinstalling():
    s = spec()
    back = converged(s, venv_link=f"{s.venvs_dir}/0123456789abcdef", venv_previous=s.venv_dir(INSTALL.key))
    (switch,) = run_alone(operations.package, spec=s, seen=back, install=INSTALL)
    assert "mv -T" in str(switch) and "pip" not in str(switch)
    # An install that never finished (no marker) is made again from nothing.
    cut = converged(s, venv_link=None, venvs={INSTALL.key[:16]: ""})
    assert len(run_alone(operations.package, spec=s, seen=cut, install=INSTALL)) == 4


def test_a_venv_from_before_the_lock_is_replaced_by_the_link_and_pruned_after():
    s = spec()
    legacy = converged(s, venv_link=None, venv_legacy=True, venvs={}, venv_previous=None)
    *_, switch = run_alone(operations.package, spec=s, seen=legacy, install=INSTALL)
    assert f"mv -T /opt/vllm-router {s.venvs_dir}/legacy" in str(switch)
    assert "restart" in " ".join(map(str, run_alone(operations.running, spec=s, seen=legacy, install=INSTALL)))
    # The same run removes it after the restart (the switch moved it where the facts did not see it), so the next
    # run, which reads the link and no legacy venv, changes nothing.
    assert [str(c) for c in run_alone(operations.old_venvs, spec=s, seen=legacy, install=INSTALL)] == [
        f"rm -rf {s.venvs_dir}/legacy"
    ]
    after = converged(s, venv_previous=None, venvs={INSTALL.key[:16]: INSTALL.key})
    assert run_alone(operations.old_venvs, spec=s, seen=after, install=INSTALL) == []


# --- the run's lock, checked when the restart executes ----------------------------------------------------------------
@dataclass
class LostLock:
    """The run's lock on the host, whose lease ran out after the plan: another run may hold the host now."""

    path: str
    holder: Holder = field(default_factory=Holder.this_process)

    def check(self) -> None:
        raise LockLost("router1: lost the lock (its lease of 90 s ran out): another run may be changing the host")


def test_the_restart_checks_the_runs_lock_when_it_executes_not_when_it_is_planned(tmp_path):
    s = spec()
    other = wheels.locked_install("router1", VERSION, "3.13", "x86_64")  # a new venv: the router restarts
    inventory = Inventory(([("router1", {})], {}))
    target = inventory.get_host("router1")
    state = State(inventory, Config())
    lock_file = tmp_path / "lock"
    host_run(target).lock = LostLock(str(lock_file))  # type: ignore[assignment]  # what the checks use of a HostLock
    # Planning does not look at the lock (it may be lost between the plan and the restart): it announces the checks.
    with ctx_state.use(state), ctx_host.use(target):
        check, *_, restart = operations.running._inner(spec=s, seen=converged(s), install=other)
    # Executing, the controller's check stops the host before the restart...
    assert isinstance(check, FunctionCommand) and check.function is still_locked
    assert check.function(state, target) is False
    # ...and on the host, the restart's own shell restarts only while the lock file still names this run.
    assert isinstance(restart, StringCommand)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "systemctl.log"}\n')
    (bin_dir / "systemctl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    lock_file.write_text(Holder.this_process().line() + "\n")
    ran = subprocess.run(["sh", "-c", restart.get_raw_value()], env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0 and (tmp_path / "systemctl.log").read_text() == "restart vllm-router.service\n"
    lock_file.write_text(Holder("alice", "laptop", 4242, "2026-12-01T03:00:00Z").line() + "\n")  # another run's now
    ran = subprocess.run(["sh", "-c", restart.get_raw_value()], env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 1 and "no longer holds the host's lock" in ran.stderr
    assert (tmp_path / "systemctl.log").read_text() == "restart vllm-router.service\n"  # not restarted again


# --- the scripts, run for real on this machine -----------------------------------------------------------------------
def build_wheel(where: Path) -> Path:
    """A tiny real wheel named vllm-router 0.1.17 with a `vllm-router` console script."""
    files = {
        "tinyrouter.py": "def main():\n    print('usage: vllm-router')\n",
        "vllm_router-0.1.17.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm-router\nVersion: 0.1.17\n",
        "vllm_router-0.1.17.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "vllm_router-0.1.17.dist-info/entry_points.txt": "[console_scripts]\nvllm-router = tinyrouter:main\n",
    }
    record = (
        "".join(
            f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest()).rstrip(b'=').decode()},"
            f"{len(body)}\n"
            for name, body in files.items()
        )
        + "vllm_router-0.1.17.dist-info/RECORD,,\n"
    )
    path = where / "vllm_router-0.1.17-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, body in {**files, "vllm_router-0.1.17.dist-info/RECORD": record}.items():
            z.writestr(name, body)
    return path


def sh(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1", **env},
    )


def install_for_real(s: RouterSpec, install: wheels.LockedInstall) -> subprocess.CompletedProcess[str]:
    """The package operation's commands, in order, on this machine (the upload written directly)."""
    target = s.venv_dir(install.key)
    made = sh(f"mkdir -p {s.venvs_dir} && rm -rf {target} && {shlex.quote(sys.executable)} -m venv {target}")
    assert made.returncode == 0, made.stderr
    Path(target, operations.REQUIREMENTS).write_text(install.requirements())
    done = sh(operations.install_script(s, install))
    return done if done.returncode else sh(operations.switch_script(s, install))


def venv_state(s: RouterSpec) -> RouterHost:
    return facts.parse(sh("; ".join(facts.venv_lines(s)) + "; true").stdout.splitlines())


@pytest.mark.timeout(300)
def test_real_pip_installs_the_locked_wheel_and_refuses_one_whose_hash_differs(tmp_path):
    files = tmp_path / "index" / "files"
    files.mkdir(parents=True)
    wheel = build_wheel(files)
    write_simple_index(files, tmp_path / "index" / "simple")
    good = wheels.LockedInstall(
        VERSION,
        "3.11",
        "x86_64",
        (wheels.Wheel("vllm-router", VERSION, wheel.name, hashlib.sha256(wheel.read_bytes()).hexdigest()),),
    )
    check_files(files, good)
    s = replace(
        spec(router_venv=str(tmp_path / "opt" / "vllm-router")), index_url=(tmp_path / "index" / "simple").as_uri()
    )
    proc = install_for_real(s, good)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = venv_state(s)
    assert seen.venv_key == good.key and seen.venv_link == s.venv_dir(good.key)
    assert sh(f"{s.venv}/bin/vllm-router --help").stdout == "usage: vllm-router\n"  # the unit's stable path

    # The same wheel's bytes, a lock saying otherwise: pip refuses it, and the router's venv is untouched.
    bad = replace(good, wheels=(replace(good.wheels[0], sha256="0" * 64),))
    with pytest.raises(RuntimeError, match="exactly the locked wheels"):
        check_files(files, bad)
    proc = install_for_real(s, bad)
    assert proc.returncode != 0 and "DO NOT MATCH THE HASHES" in proc.stderr, proc.stderr
    after = venv_state(s)
    assert after.venv_key == good.key and after.venvs[bad.key[:16]] == ""  # no marker: never switched to
    assert sh(f"{s.venv}/bin/vllm-router --help").returncode == 0
