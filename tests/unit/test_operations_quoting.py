"""Repo URLs are settings, and the commands that fetch their keys run as root: a hostile URL must reach curl as one
word, exactly as given, and none of its shell syntax may run. Each command is run by a real shell, with curl
replaced by a function that records its argv (validation refuses such URLs too; this is the second wall)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpufleet.vllm.operations import docker, repo_keys

HOSTILE = "https://repo.example/$(touch {m})`touch {m}`;touch {m}&touch {m}|touch {m} 'x\"y\nz"


def run_recording_curl(command: str, tmp_path: Path) -> list[str]:
    log = tmp_path / "argv"
    record = f'curl() {{ for a in "$@"; do printf \'%s\\0\' "$a"; done >> {log}; }}'
    subprocess.run(["sh", "-c", f"{record}\n{command}"], capture_output=True, timeout=10)
    return log.read_text().split("\0")[:-1] if log.exists() else []


@pytest.fixture
def hostile(tmp_path):
    marker = tmp_path / "injected"
    yield HOSTILE.format(m=marker)
    assert not marker.exists(), "shell syntax in the URL ran"


def test_docker_key_fetch_passes_the_url_as_one_word(hostile, tmp_path):
    # Docker's key is fetched as NVIDIA's is (one function): its URL, built from the setting, stays one word.
    command = repo_keys.fetch_key_command(docker.key_url(hostile, "debian"))
    assert run_recording_curl(command, tmp_path) == ["-fsSL", "--max-time", "60", f"{hostile}/debian/gpg"]


def test_nvidia_key_fetch_passes_the_url_as_one_word(hostile, tmp_path):
    command = repo_keys.fetch_key_command(f"{hostile}/gpgkey")
    assert run_recording_curl(command, tmp_path) == ["-fsSL", "--max-time", "60", f"{hostile}/gpgkey"]
