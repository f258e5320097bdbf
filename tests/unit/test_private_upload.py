"""Every root file gpufleet uploads goes through a directory of the SSH user's own (`mktemp -d`), never through a
fixed name in /tmp that a local user can take first, and root renames its copy into place only when it hashes to
what was sent (gpufleet.operations.files.upload). The composed shell commands run here for real, through a stand-in
for pyinfra's Host that runs them locally."""

from __future__ import annotations

import hashlib
import stat
import subprocess
from pathlib import Path
from typing import Any

from gpufleet.operations import files
from gpufleet.operations.files import sha256, upload, write_file
from tests.unit.test_ledger_cas import LocalHost, Output, _no_chown


class RecordingHost(LocalHost):
    """LocalHost, keeping every command and upload; `corrupt` changes the bytes an upload lands with."""

    def __init__(self, corrupt: bool = False) -> None:
        super().__init__()
        self.corrupt, self.commands, self.uploads = corrupt, [], []

    def run_shell_command(self, command: str, **_: Any) -> tuple[bool, Output]:
        self.commands.append(command)
        return super().run_shell_command(command)

    def put_file(self, io: Any, path: str, **kwargs: Any) -> bool:
        data = io.read()
        parent = Path(path).parent
        self.uploads.append((path, stat.S_IMODE(parent.stat().st_mode), parent.exists()))
        Path(path).write_bytes(data + b"tampered" if self.corrupt and not path.endswith("sha256") else data)
        return True


def test_an_upload_goes_through_a_private_directory_made_for_it_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "atomic_write_command", _no_chown(files.atomic_write_command))
    target = tmp_path / "etc" / "vllm.service"
    host = RecordingHost()
    assert upload(host, "[Unit]\n", str(target), mode="0644") is True  # type: ignore[arg-type]
    assert target.read_text() == "[Unit]\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
    [(sent, mode, _)] = host.uploads
    assert Path(sent).name == "upload" and mode == 0o700  # made by `mktemp -d` under umask 077
    assert not Path(sent).parent.exists()  # removed afterwards
    assert host.commands[0] == "umask 077 && mktemp -d"
    again = RecordingHost()
    upload(again, "[Unit]\n", str(target))  # type: ignore[arg-type]
    assert again.uploads[0][0] != sent  # a new name each time: none to take first
    assert sorted(p.name for p in target.parent.iterdir()) == ["vllm.service"]


def test_a_changed_upload_is_not_renamed_into_place(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "atomic_write_command", _no_chown(files.atomic_write_command))
    monkeypatch.setattr(files, "use_sudo", lambda host: False)
    target = tmp_path / "vllm.json"
    target.write_text("old\n")
    assert write_file(RecordingHost(corrupt=True), str(target), "new\n") is False  # type: ignore[arg-type]
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm.json"]  # root's copy removed too


def test_a_secrets_digest_is_checked_from_a_file_never_from_a_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "atomic_write_command", _no_chown(files.atomic_write_command))
    target, content = tmp_path / "vllm-qwen35.env", "VLLM_API_KEY=sk-1234\n"
    host = RecordingHost()
    assert upload(host, content, str(target), mode="0600", secret=True) is True  # type: ignore[arg-type]
    assert target.read_text() == content and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert not any(sha256(content) in command or "sk-1234" in command for command in host.commands)
    target.write_text("old\n")
    assert upload(RecordingHost(corrupt=True), content, str(target), secret=True) is False  # type: ignore[arg-type]
    assert target.read_text() == "old\n"


def test_the_check_is_on_roots_copy_beside_the_target(tmp_path):
    command = files.atomic_write_command(
        str(tmp_path / "x"), owner="0:0", source=str(tmp_path / "up"), sha256=hashlib.sha256(b"x").hexdigest()
    )
    (tmp_path / "up").write_bytes(b"y")
    done = subprocess.run(["sh", "-c", command.replace("chown 0:0", "true")], capture_output=True, text=True)
    assert done.returncode != 0 and "the upload is not what was sent" in done.stderr
    assert not (tmp_path / "x").exists()
