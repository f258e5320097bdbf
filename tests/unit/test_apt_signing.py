"""The stand-in repos' throwaway signing key: it signs, and nothing of it outlives the build (gpg starts a
gpg-agent per home that would otherwise keep running after `gpufleet sandbox down` and every CI run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpufleet.sandbox.apt_signing import ThrowawayKey

pytestmark = pytest.mark.skipif(shutil.which("gpg") is None, reason="gpg is not installed")


def _processes_naming(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found


def test_a_key_signs_then_leaves_no_agent_and_no_home(tmp_path: Path) -> None:
    (tmp_path / "Release").write_text("Origin: gpufleet test\n")
    home = tmp_path / "key.gnupg"
    with ThrowawayKey(home, "test <test@gpufleet.invalid>") as key:
        public = key.armored_public_key()
        key.sign_release(tmp_path)
        assert _processes_naming(str(home)), "gpg ran without an agent: this test no longer tests the cleanup"
    assert public.startswith("-----BEGIN PGP PUBLIC KEY BLOCK-----")
    assert (tmp_path / "Release.gpg").read_bytes()
    assert "BEGIN PGP SIGNED MESSAGE" in (tmp_path / "InRelease").read_text()
    assert _processes_naming(str(home)) == []
    assert not home.exists()
