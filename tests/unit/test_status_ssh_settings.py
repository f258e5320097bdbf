"""`gpufleet status` / `verify` log in as the deploy does: pyinfra's connector with the inventory's SSH settings.

Real sshd processes on 127.0.0.1 (tests/sshd.py): one on a random port that lets only `nobody` in, the suite's
own (the local user). An inventory file goes through pyinfra's loader, as the CLI reads it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
from click.testing import CliRunner

from gpufleet.cli.verify import status, verify
from gpufleet.remote import ssh
from tests.conftest import OTHER_USER
from tests.sshd import Sshd


def login(server: Sshd, known_hosts: Path, strict: str, **extra: object) -> dict:
    """Host data reaching `server` with its client key, a known_hosts file of the test's and a checking policy."""
    return {"ssh_hostname": "127.0.0.1", "ssh_port": server.port, "ssh_key": str(server.client_key),
            "ssh_known_hosts_file": str(known_hosts), "ssh_strict_host_key_checking": strict, **extra}  # fmt: skip


def write_inventory(path: Path, hosts: list[tuple[str, dict]]) -> str:
    path.write_text(f"hosts = {hosts!r}\n")
    return str(path)


def rows(result) -> dict[str, dict]:
    """status --json's host rows by name; no host here serves vLLM, so status found problems (exit status 1)."""
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["command"] == "status" and doc["ok"] is False
    return {row["host"]: row for row in doc["hosts"]}


def test_status_logs_in_with_the_inventorys_port_user_and_known_hosts_file(sshd_nobody, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(sshd_nobody.known_hosts_line())
    inventory = write_inventory(tmp_path / "inv.py", [
        ("as-nobody", login(sshd_nobody, known_hosts, "yes", ssh_user=OTHER_USER)),
        ("as-default-user", login(sshd_nobody, known_hosts, "yes")),  # pyinfra's default: the local user
    ])  # fmt: skip

    got = rows(CliRunner().invoke(status, [inventory, "--json"]))

    # Logged in on the non-default port, key checked strictly against the given file, as `nobody`: its docker
    # query ran in nobody's session, which has no home and no shell.
    nobody = got["as-nobody"]
    assert nobody["state"] == "container-not-running", nobody["detail"]
    assert nobody["detail"].startswith("cannot read container state: as-nobody: docker inspect failed: ")
    assert "home directory /nonexistent" in nobody["detail"]
    # The same server refuses any other user: a row that says so, not the table's end.
    default = got["as-default-user"]
    assert default["state"] == "ssh-unreachable"
    assert f"cannot SSH to 127.0.0.1:{sshd_nobody.port}: Authentication error" in default["detail"]
    assert known_hosts.read_text() == sshd_nobody.known_hosts_line()  # strict checking never writes the file


def test_strict_checking_refuses_an_unknown_or_changed_host_key(sshd, tmp_path):
    empty = tmp_path / "empty_known_hosts"
    empty.touch()
    changed = tmp_path / "changed_known_hosts"
    impostor = paramiko.Ed25519Key.from_private_key_file(str(sshd.client_key))  # any key but the server's
    changed.write_text(f"[127.0.0.1]:{sshd.port} {impostor.get_name()} {impostor.get_base64()}\n")
    accepting = tmp_path / "accepting_known_hosts"
    accepting.touch()
    inventory = write_inventory(tmp_path / "inv.py", [
        ("unknown-key", login(sshd, empty, "yes")),
        ("changed-key", login(sshd, changed, "accept-new")),
        ("accept-new", login(sshd, accepting, "accept-new")),
    ])  # fmt: skip

    result = CliRunner().invoke(verify, [inventory])

    assert result.exit_code == 1 and "Traceback" not in result.output
    out = result.output
    assert (
        f"unknown-key: ssh-unreachable: cannot SSH to 127.0.0.1:{sshd.port}: SSH error (StrictPolicy: No host key "
        f"for [127.0.0.1]:{sshd.port} found in known_hosts) (fix: add the host's key to {empty}, e.g. with "
        "ssh-keyscan, or set ssh_strict_host_key_checking)"
    ) in out
    assert f"changed-key: ssh-unreachable: cannot SSH to 127.0.0.1:{sshd.port}: SSH host key error" in out
    assert "does not match" in out
    assert empty.read_text() == ""
    # accept-new (pyinfra's default) connects and records the key in the inventory's file, as the deploy would.
    assert "accept-new: ssh-unreachable" not in out
    assert accepting.read_text() == sshd.known_hosts_line()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word (no SSH banner): a stalled host."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    listener.close()


def test_stalled_hosts_are_cut_at_the_connect_bound_in_parallel(silent_port, sshd, tmp_path, monkeypatch):
    bound_s, stalled = 1.0, 6
    monkeypatch.setattr(ssh, "SSH_TIMEOUT_S", bound_s)
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(sshd.known_hosts_line())
    hosts = [(f"stalled-{i}", {"ssh_hostname": "127.0.0.1", "ssh_port": silent_port}) for i in range(stalled)]
    hosts.append(("reachable", login(sshd, known_hosts, "yes")))
    inventory = write_inventory(tmp_path / "inv.py", hosts)

    start = time.monotonic()
    got = rows(CliRunner().invoke(status, [inventory, "--json"]))
    elapsed = time.monotonic() - start

    assert list(got) == [name for name, _ in hosts]  # inventory order
    for i in range(stalled):
        row = got[f"stalled-{i}"]
        assert row["state"] == "ssh-unreachable"
        assert row["detail"] == f"cannot SSH to 127.0.0.1:{silent_port}: no SSH session within 1 s"
    assert got["reachable"]["state"] != "ssh-unreachable", got["reachable"]["detail"]
    # One after another the stalled hosts alone would take 6 s.
    assert elapsed < (stalled - 1) * bound_s, elapsed  # one after another would take stalled * bound_s
