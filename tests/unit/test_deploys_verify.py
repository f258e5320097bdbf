"""The ready wait, soak and rollback decisions behind the deploy's verify step (no host: scripted health reports)."""

from __future__ import annotations

import pytest

from gpufleet.deploys.verify import exited_detail
from gpufleet.health import HealthReport, HealthState, poll_ready, soak

READY = HealthReport(HealthState.READY, "/health 200, serving qwen")
STARTING = HealthReport(HealthState.STARTING, "port not answering yet")
GONE = HealthReport(HealthState.CONTAINER_NOT_RUNNING, "no container labelled gpufleet.vllm")
DEAD = HealthReport(HealthState.DEAD, "/health answered 503")


class Clock:
    """A fake monotonic clock that sleep() advances."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def scripted(*reports: HealthReport):
    it = iter(reports)
    return lambda: next(it)


def test_wait_returns_ready_after_starting():
    clock = Clock()
    report = poll_ready(scripted(STARTING, GONE, READY), 60, exited=lambda: None, clock=clock, sleep=clock.sleep)
    assert report.ready and clock.now == 4.0


def test_wait_stops_early_when_the_service_exited_instead_of_waiting_for_the_timeout():
    clock = Clock()
    why = "docker run exited with status 2 (systemd: activating/auto-restart)"
    report = poll_ready(scripted(STARTING, GONE), 1800, exited=lambda: why, clock=clock, sleep=clock.sleep)
    assert report.state is HealthState.DEAD and report.detail == why and clock.now == 2.0


def test_wait_gives_up_at_the_timeout():
    clock = Clock()
    report = poll_ready(lambda: STARTING, 10, exited=lambda: None, clock=clock, sleep=clock.sleep)
    assert report.state is HealthState.STARTING and "gave up after 10 s" in report.detail and clock.now <= 10


def test_soak_catches_an_engine_that_dies_after_its_first_ready():
    clock = Clock()
    report = soak(scripted(READY, READY, DEAD), READY, 20, clock=clock, sleep=clock.sleep)
    assert report.state is HealthState.DEAD and "6 s after it was ready" in report.detail


def test_soak_passes_a_service_that_stays_ready_and_takes_soak_seconds():
    clock = Clock()
    calls = []
    report = soak(lambda: calls.append(1) or READY, READY, 5, clock=clock, sleep=clock.sleep)
    assert report.ready and clock.now == 5.0 and len(calls) == 3  # at 2, 4, 5 s


def test_soak_calls_a_service_whose_container_exited_dead_like_the_ready_wait_does():
    # The container runs with --rm: once the engine dies there may be no container left to call dead.
    clock = Clock()
    why = "docker run exited with status 1 (systemd: activating/auto-restart)"
    report = soak(scripted(READY, GONE), READY, 20, exited=lambda: why, clock=clock, sleep=clock.sleep)
    assert report.state is HealthState.DEAD and report.detail == f"{why} (4 s after it was ready)"


def test_soak_without_an_exit_reason_still_fails_a_vanished_container():
    clock = Clock()
    report = soak(scripted(GONE), READY, 20, exited=lambda: None, clock=clock, sleep=clock.sleep)
    assert report.state is HealthState.CONTAINER_NOT_RUNNING and "2 s after it was ready" in report.detail


def test_zero_soak_checks_nothing():
    assert soak(lambda: pytest.fail("checked"), READY, 0) is READY


@pytest.mark.parametrize("show, exited", [
    ("ActiveState=activating\nSubState=auto-restart\nExecMainStatus=2", True),
    ("ActiveState=failed\nSubState=failed\nExecMainStatus=1", True),
    ("ActiveState=active\nSubState=running\nExecMainStatus=0", False),  # docker run still creating the container
    ("ActiveState=activating\nSubState=start-pre\nExecMainStatus=0", False),
])
def test_exited_detail(show, exited):
    detail = exited_detail(show)
    assert (detail is not None) == exited
    if exited:
        assert "exited with status" in detail and show.splitlines()[-1].split("=")[1] in detail
