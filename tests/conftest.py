"""Suite-wide rules. Under CI (CI=true) a tier that could not run is a failure, never a silent skip."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

import gpufleet.inventory  # noqa: F401,I001  first: pyinfra_cli's gevent patch_all() must precede any thread
from tests.sshd import Sshd

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
# Tiers that need machinery (root + nspawn hosts, a real vLLM); CI must run them.
REQUIRED_TIERS = ("integration", "vllm")
_tier_passes: Counter[str] = Counter()


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """A throwaway sshd on 127.0.0.1 (started and stopped by PID): the health checks' SSH channels are real."""
    why = Sshd.available()
    if why:
        pytest.skip(f"no throwaway sshd: {why}")
    server = Sshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


# A login-less system account on every Debian (home /nonexistent, shell nologin): a session as `nobody` shows in
# what sshd answers when it starts the session's command, and it is never root.
OTHER_USER = "nobody"


@pytest.fixture(scope="module")
def sshd_nobody(tmp_path_factory: pytest.TempPathFactory):
    """A throwaway sshd on 127.0.0.1 that lets only OTHER_USER in: SSH settings that name another user."""
    why = Sshd.available()
    if why:
        pytest.skip(f"no throwaway sshd: {why}")
    server = Sshd(tmp_path_factory.mktemp("sshd-nobody"), user=OTHER_USER).start()
    yield server
    server.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tiers = [t for t in REQUIRED_TIERS if t in report.keywords]
    if report.when == "call" and report.passed:
        _tier_passes.update(tiers)
    # A skipped test of a required tier fails the run under CI: the tier must really have run.
    if in_ci() and report.skipped and tiers:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"required test tier {'/'.join(tiers)} skipped under CI: {reason}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Also catch a tier that never reached the call phase (skipped at collection, not found, crashed early).
    # Applies to whole-suite runs (no paths given), which is what .ci/run does.
    paths_given = any(not arg.startswith("-") for arg in session.config.invocation_params.args)
    if not in_ci() or paths_given:
        return
    missing = [tier for tier in REQUIRED_TIERS if _tier_passes[tier] == 0]
    if missing:
        session.config.get_terminal_writer().line(
            f"CI: no test of tier(s) {', '.join(missing)} passed: the tier did not run", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
