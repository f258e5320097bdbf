"""`gpufleet sandbox` refuses clearly (one line, no traceback) where it cannot run."""

from __future__ import annotations

import shutil

from click.testing import CliRunner

from gpufleet.cli.sandbox import sandbox
from gpufleet.sandbox import fleet


def test_up_without_root_is_one_line(monkeypatch):
    monkeypatch.setattr(fleet.os, "geteuid", lambda: 1000)
    result = CliRunner().invoke(sandbox, ["up", "1"])
    assert result.exit_code == 1
    assert result.output.splitlines() == ["Error: the sandbox needs root (it creates network namespaces, mounts and containers)"]


def test_down_without_systemd_nspawn_names_the_package(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(fleet.os, "geteuid", lambda: 0)
    monkeypatch.setattr(fleet.shutil, "which", lambda t: None if t == "systemd-nspawn" else real_which(t))
    result = CliRunner().invoke(sandbox, ["down"])
    assert result.exit_code == 1
    assert len(result.output.splitlines()) == 1
    assert "apt-get install" in result.output and "systemd-container" in result.output


def test_up_rejects_a_bad_count():
    result = CliRunner().invoke(sandbox, ["up", "0"])
    assert result.exit_code == 2 and "COUNT" in result.output
