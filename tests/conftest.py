"""Suite-wide rules. Under CI (CI=true) a tier that could not run is a failure, never a silent skip.

A whole-suite run (`pytest`, no paths) spreads over WORKERS pytest-xdist processes (`-n auto` in
pyproject.toml); a run that names paths stays in one process unless it passes `-n N` itself.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

import gpufleet.inventory  # noqa: F401  first: pyinfra_cli's gevent patch_all() must precede any thread
from tests.sshd import Sshd

if os.environ.get("PYTEST_XDIST_WORKER"):
    # In a pytest-xdist worker that patch comes too late: execnet's receiver thread (a real OS thread) already runs,
    # and the worker's test queue, made after this import, would wait on gevent's Event, which that thread cannot
    # wake (the worker dies with gevent's LoopExit). Its execmodel hands out OS-thread primitives instead.
    import _queue

    from execnet.gateway_base import MainThreadOnlyExecModel
    from gevent.monkey import get_original

    class _OsThreadEvent:
        """threading.Event on a C SimpleQueue, which blocks the OS thread (gevent leaves _queue alone)."""

        def __init__(self) -> None:
            self._flag = False
            self._bell: _queue.SimpleQueue[None] = _queue.SimpleQueue()

        def is_set(self) -> bool:
            return self._flag

        def set(self) -> None:
            self._flag = True
            self._bell.put(None)

        def clear(self) -> None:
            self._flag = False

        def wait(self, timeout: float | None = None) -> bool:
            while not self._flag:
                try:
                    self._bell.get(timeout=timeout)
                except _queue.Empty:
                    break
            return self._flag

    MainThreadOnlyExecModel.RLock = lambda self: get_original("_thread", "RLock")()  # type: ignore[method-assign]
    MainThreadOnlyExecModel.Event = lambda self: _OsThreadEvent()  # type: ignore[method-assign]

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
# Tiers that need machinery (root + nspawn hosts, a real vLLM); CI must run them.
REQUIRED_TIERS = ("integration", "vllm")
_tier_passes: Counter[str] = Counter()
# Most of the suite's time is waiting on test hosts (boots, soaks, readiness polls), so more workers than the CI
# machine's 2 cores pay off; each worker boots its own session fleet (tests/integration/fleets.py).
WORKERS = 3
# A worker runs a group's tests in collection order, one group at a time. A module is a group (module fixtures,
# steps that build on each other); these are one group each, for what they share besides the session fleet.
SHARED_GROUPS = {
    "tests/integration/test_router.py": "fleet-rtr",
    "tests/integration/test_rollout_router.py": "fleet-rtr",  # the same fleet gf-rtr, after test_router.py
    "tests/vllm/": "vllm",  # real vLLM servers, CPU-heavy: never more than 2 at once on the machine
}
# The longest groups, sent to workers first so none of them is left running alone at the end.
LONGEST_FIRST = ("vllm", "fleet-rtr", "tests/integration/test_rollout.py")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def whole_suite(config: pytest.Config) -> bool:
    """No paths given: pytest collected its testpaths, as .ci/run's plain `pytest` does."""
    return config.args_source is pytest.Config.ArgsSource.TESTPATHS


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """What `-n auto` (pyproject's addopts) means here: WORKERS for the whole suite; none for a targeted run, which
    would otherwise wait on worker start-ups for a few tests."""
    return WORKERS if whole_suite(config) else 0


def xdist_group(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return next((group for prefix, group in SHARED_GROUPS.items() if module.startswith(prefix)), module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Hand out whole groups (xdist_group above), in collection order. pytest-xdist's own loadgroup needs marks it
    reads from a node id that pytest 9.2 no longer lets it change; a group here is a function of the node id."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    config.option.loadscopereorder = False  # keep LONGEST_FIRST's order, not the most tests first
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist every worker collects; the scheduler queues the groups in the order they collected them."""
    if hasattr(config, "workerinput"):
        rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(xdist_group(item.nodeid), len(rank)))


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
    # Applies to whole-suite runs (no paths given), which is what .ci/run does. Under xdist the controller sees
    # every worker's reports (pytest_runtest_logreport above runs there too); a worker sees only its own share.
    if not in_ci() or not whole_suite(session.config) or hasattr(session.config, "workerinput"):
        return
    missing = [tier for tier in REQUIRED_TIERS if _tier_passes[tier] == 0]
    if missing:
        session.config.get_terminal_writer().line(
            f"CI: no test of tier(s) {', '.join(missing)} passed: the tier did not run", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
