"""use_sudo: the deploy decides sudo from the user the SSH session really logged in as, like `gpufleet status`.

Real sshd processes on 127.0.0.1 (tests/sshd.py): the suite's own (the local user, root in CI) and one that lets
only `nobody` in, reached with no ssh_user in the host data but an ssh config file naming the user.
"""

from __future__ import annotations

from pathlib import Path

from gpufleet.remote.ssh import pyinfra_host, use_sudo
from tests.conftest import OTHER_USER
from tests.sshd import Sshd


def connected(server: Sshd, tmp_path: Path, **extra: object):
    data = {"ssh_hostname": "127.0.0.1", "ssh_port": server.port, "ssh_key": str(server.client_key),
            "ssh_known_hosts_file": str(tmp_path / "known_hosts"), **extra}  # fmt: skip
    host = pyinfra_host("box", data)
    host.connect(raise_exceptions=True)
    return host


def test_a_session_of_a_user_named_only_by_the_ssh_config_goes_through_sudo(sshd_nobody, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(f"Host 127.0.0.1\n  User {OTHER_USER}\n")
    host = connected(sshd_nobody, tmp_path, ssh_config_file=str(config))
    try:
        assert "ssh_user" not in host.data.dict()  # host data alone would have read this as a root session
        assert use_sudo(host) is True
    finally:
        host.disconnect()


def test_the_session_user_decides_not_the_host_data(sshd, tmp_path):
    host = connected(sshd, tmp_path, ssh_user=sshd.user)
    try:
        assert use_sudo(host) is (sshd.user != "root")
    finally:
        host.disconnect()


def test_before_connecting_only_ssh_user_can_tell():
    assert use_sudo(pyinfra_host("box", {"ssh_user": "deploy"})) is True
    assert use_sudo(pyinfra_host("box", {"ssh_user": "root"})) is False
