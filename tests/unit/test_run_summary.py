"""The deploy's last lines name every host that failed or could not be reached, with the fix (a real pyinfra run
over a throwaway sshd; the unreachable host is a closed port)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.ports import free_port

PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
DEPLOY = """
from pyinfra import host
from pyinfra.operations import server

from gpufleet.harness import register_deploy_file

register_deploy_file(__file__)
server.shell(name="a step", commands=["exit 3" if host.data.get("breaks") else "true"])
"""


def test_the_last_lines_name_each_unreachable_and_failed_host_with_its_fix(sshd, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    login = {
        "ssh_hostname": "127.0.0.1",
        "ssh_port": sshd.port,
        "ssh_user": sshd.user,
        "ssh_key": str(sshd.client_key),
        "ssh_known_hosts_file": str(known_hosts),
        "ssh_strict_host_key_checking": "accept-new",
    }
    closed = free_port()  # nothing listens there: the connection is refused
    hosts = [("fine", login), ("down", {**login, "ssh_port": closed}), ("broken", {**login, "breaks": True})]
    (tmp_path / "inventory.py").write_text(f"hosts = {hosts!r}\n")
    (tmp_path / "deploy.py").write_text(DEPLOY)
    run = subprocess.run(
        [PYINFRA, "-y", str(tmp_path / "inventory.py"), str(tmp_path / "deploy.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    tail = run.stderr.rstrip().splitlines()[-3:]
    assert tail[0] == "2 host(s) did not converge:", run.stderr[-3000:]
    assert tail[1] == (
        f"  down: could not be reached over SSH (fix: check that it is up and that `ssh -p {closed} "
        f"{sshd.user}@127.0.0.1 true` logs in with the inventory's ssh_* settings, then run again)"
    )
    assert tail[2].startswith("  broken: failed; its error is in the [broken] lines above (fix: ")
    assert "fine" not in "\n".join(tail)


def test_a_run_where_every_host_converged_ends_with_pyinfras_results(sshd, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    login = {
        "ssh_hostname": "127.0.0.1",
        "ssh_port": sshd.port,
        "ssh_user": sshd.user,
        "ssh_key": str(sshd.client_key),
        "ssh_known_hosts_file": str(known_hosts),
        "ssh_strict_host_key_checking": "accept-new",
    }
    (tmp_path / "inventory.py").write_text(f"hosts = {[('fine', login)]!r}\n")
    (tmp_path / "deploy.py").write_text(DEPLOY)
    run = subprocess.run(
        [PYINFRA, "-y", str(tmp_path / "inventory.py"), str(tmp_path / "deploy.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "did not converge" not in run.stdout + run.stderr
