"""The ready wait, soak and rollback decisions behind the deploy's verify step (no host: scripted health reports).
How the verdict picks the commit or the rollback: test_vllm_verdict.py."""

from __future__ import annotations

import pytest

from gpufleet.health import HealthReport, HealthState, poll_ready, soak
from gpufleet.health.answers import AnswerCheck
from gpufleet.health.wait import transient
from gpufleet.hoststate.ledger import Version
from gpufleet.operations.run import remember
from gpufleet.remote.transport import ContainerInfo
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.service_watch import exited_detail
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.verify import (
    Verification,
    VerifyOutcome,
    after_failed_verify,
    installed_problem,
    with_traffic,
)  # fmt: skip

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
    # Gone at 2 s; the service manager's reason waited for up to EXIT_SETTLE_S, then the look stands.
    assert report.state is HealthState.CONTAINER_NOT_RUNNING and "12 s after it was ready" in report.detail


def test_soak_waits_a_moment_for_the_reason_of_a_container_that_went_away():
    # Docker still removing the --rm container while systemd has not yet seen `docker run` return: a moment later
    # the reason is there, and the version is dead with it (not "container-not-running").
    clock = Clock()
    why = "docker run exited with status 1 (systemd: failed/failed)"
    answers = iter([None, None, why])
    report = soak(scripted(GONE), READY, 20, exited=lambda: next(answers), clock=clock, sleep=clock.sleep)
    assert report.state is HealthState.DEAD and report.detail == f"{why} (4 s after it was ready)"


def test_soak_names_the_exit_of_an_engine_whose_port_closed_before_its_container_went_away():
    # The engine's port closes while its container still runs (a "starting" look), then the container goes: the
    # version is dead with the service manager's reason, not "starting".
    clock = Clock()
    why = "docker run exited with status 1 (systemd: failed/failed)"
    answers = iter([None, why])
    report = soak(
        scripted(READY, STARTING, GONE), READY, 20, exited=lambda: next(answers), clock=clock, sleep=clock.sleep
    )
    assert report.state is HealthState.DEAD and report.detail == f"{why} (6 s after it was ready)"


def test_soak_calls_a_port_that_stays_closed_after_ready_dead():
    clock = Clock()
    report = soak(lambda: STARTING, READY, 20, exited=lambda: None, clock=clock, sleep=clock.sleep)
    assert report.state is HealthState.DEAD
    assert report.detail == f"stopped answering: {STARTING.detail} (12 s after it was ready)"


def test_soak_looks_past_a_lost_link_while_it_waits_for_a_closed_port_to_settle():
    clock = Clock()
    why = "docker run exited with status 1 (systemd: failed/failed)"
    report = soak(scripted(STARTING, LINK_LOST, GONE), READY, 20, exited=lambda: why, clock=clock, sleep=clock.sleep)
    assert report.state is HealthState.DEAD and report.detail == f"{why} (4 s after it was ready)"


def test_zero_soak_checks_nothing():
    assert soak(lambda: pytest.fail("checked"), READY, 0) is READY


@pytest.mark.parametrize(
    ("show", "exited"),
    [
        ("ActiveState=activating\nSubState=auto-restart\nExecMainStatus=2", True),
        ("ActiveState=failed\nSubState=failed\nExecMainStatus=1", True),
        ("ActiveState=active\nSubState=running\nExecMainStatus=0", False),  # docker run still creating the container
        ("ActiveState=activating\nSubState=start-pre\nExecMainStatus=0", False),
    ],
)
def test_exited_detail(show, exited):
    detail = exited_detail(show)
    assert (detail is not None) == exited
    if exited:
        assert "exited with status" in detail and show.splitlines()[-1].split("=")[1] in detail


PENDING = Version(
    image="vllm/vllm-openai:nightly",
    ref="vllm/vllm-openai@sha256:" + "b" * 64,
    unit_sha256=None,
    spec_hash="c" * 64,
    service="vllm",
    port=8000,
)
OLD_REF = "vllm/vllm-openai@sha256:" + "a" * 64


@pytest.mark.parametrize(("container", "problem"), [
    (ContainerInfo("new", "running", image=PENDING.ref, spec_hash=PENDING.spec_hash), None),
    # the replacement never started and the old container still answers on the port
    (ContainerInfo("old", "running", image=OLD_REF, spec_hash=PENDING.spec_hash),
     f"the container answering runs {OLD_REF}, not {PENDING.ref}, which this run installed"),
    # new settings on the same image: the old container has the old spec's label
    (ContainerInfo("old", "running", image=PENDING.ref, spec_hash="d" * 64),
     f"the container answering has spec {'d' * 64}, not {PENDING.spec_hash}, which this run installed"),
    (ContainerInfo("old", "running", image=PENDING.ref, spec_hash=None),
     f"the container answering has spec unlabelled, not {PENDING.spec_hash}, which this run installed"),
    (ContainerInfo("new", "exited", image=PENDING.ref, spec_hash=PENDING.spec_hash),
     "no running container of vllm answered"),
    (None, "no running container of vllm answered"),
])  # fmt: skip
def test_only_the_version_this_run_installed_may_be_committed(container, problem):
    assert installed_problem(PENDING, container) == problem


def test_the_soak_sends_a_request_at_a_bounded_rate_and_a_failed_one_ends_it():
    clock = Clock()
    sent: list[float] = []
    answers = iter(
        [
            AnswerCheck("completion", True, "2 tokens"),
            AnswerCheck("completion", True, "2 tokens"),
            AnswerCheck("completion", False, "POST /v1/chat/completions answered 500: engine dead"),
        ]
    )

    def send() -> AnswerCheck:
        sent.append(clock.now)
        return next(answers)

    look = with_traffic(lambda: READY, send, every_s=5.0, clock=clock)
    report = soak(look, READY, 60, exited=lambda: None, clock=clock, sleep=clock.sleep)
    # Polled every 2 s, a request at most every 5 s: at 2, 8 and 14 s; the third failed and ended the soak there.
    assert sent == [2.0, 8.0, 14.0]
    assert report.state is HealthState.MISCONFIGURED
    assert (
        report.detail
        == "answers: completion: POST /v1/chat/completions answered 500: engine dead (14 s after it was ready)"
    )


def test_the_soak_sends_nothing_while_the_host_is_not_ready():
    sent = []
    look = with_traffic(lambda: DEAD, lambda: sent.append(1) or AnswerCheck("completion", True, ""), every_s=0)
    assert look().state is HealthState.DEAD and not sent


def test_a_failed_soak_request_from_an_engine_that_just_died_reads_dead():
    looks = iter([READY, DEAD])
    look = with_traffic(lambda: next(looks), lambda: AnswerCheck("completion", False, "answered 500"), every_s=0)
    assert look() is DEAD


LINK_LOST = HealthReport(HealthState.SSH_UNREACHABLE, "gpu1: SSH failed: timed out")
DOCKER_UNASKED = HealthReport(HealthState.CONTAINER_NOT_RUNNING, "cannot read container state: docker inspect failed")


def test_the_soak_looks_past_a_lost_link_and_still_passes_a_server_that_stayed_up():
    clock = Clock()
    report = soak(
        scripted(READY, LINK_LOST, DOCKER_UNASKED, LINK_LOST, READY, READY),
        READY,
        12,
        exited=lambda: None,
        clock=clock,
        sleep=clock.sleep,
    )
    assert report.ready and clock.now == 12.0


def test_a_soak_that_ends_on_a_lost_link_is_not_ready_and_not_the_servers_fault():
    clock = Clock()
    report = soak(scripted(READY, LINK_LOST), READY, 4, exited=lambda: None, clock=clock, sleep=clock.sleep)
    assert report.state is HealthState.SSH_UNREACHABLE and transient(report)


def test_only_the_hosts_own_answers_are_not_transient():
    assert transient(LINK_LOST) and transient(DOCKER_UNASKED)
    assert not any(transient(r) for r in (READY, STARTING, GONE, DEAD))


@pytest.mark.parametrize("line", [
    # docker-ce 27 (the journal of `docker run`, exit 125), and the older daemon's wording
    "docker: Error response from daemon: driver failed programming external connectivity on endpoint x (1f2e): "
    "failed to bind host port for 0.0.0.0:5000:172.17.0.2:5000/tcp: listen tcp4 0.0.0.0:5000: bind: address already "
    "in use.",
    "docker: Error response from daemon: driver failed programming external connectivity on endpoint x: Bind for "
    "0.0.0.0:5000 failed: port is already allocated.",
])  # fmt: skip
def test_a_port_docker_could_not_publish_is_named_from_its_own_words(line):
    from gpufleet.vllm.verify import port_taken

    found = port_taken(["Starting vllm-qwen35.service...", line, "vllm-qwen35.service: Main process exited"], 5000)
    assert found is not None and "5000" in found and ("already in use" in found or "already allocated" in found)
    assert port_taken([line], 8000) is None  # another port's trouble is not this one's
    assert port_taken(["INFO: Uvicorn running on http://0.0.0.0:5000"], 5000) is None


class RunState:
    """Stands for pyinfra's State (the run's context is kept per state): the failure line is logged only."""


class Logged:
    """What after_failed_verify uses of a pyinfra Host when it writes nothing: its name, its state, its log."""

    name, data = "gpu1", {}

    def __init__(self) -> None:
        self.state = RunState()
        self.lines: list[str] = []

    def log_styled(self, message: str, **_) -> None:
        self.lines.append(message)


@pytest.mark.parametrize("port_taken", [False, True])
def test_a_failed_restart_of_the_committed_version_fails_the_host_on_one_line_and_writes_nothing(port_taken):
    # Nothing pending (drift, a secrets change): nothing to roll back to or mark failed; the host fails, with the fix
    # the verdict points at.
    host = Logged()
    remember(host, HostSnapshot())  # its ledger: nothing pending, nothing committed
    spec = build_spec("gpu1", {"vllm_image": "reg:5000/vllm/vllm-openai:good", "vllm_port": 5000})
    v = Verification(spec, 5.0, None, "/var/lib/gpufleet/vllm-qwen35.json", "qwen35")
    found = VerifyOutcome(passed=False, failed="dead: docker run exited with status 125", port_taken=port_taken)
    assert after_failed_verify(host, v, found) is False
    (line,) = host.lines
    assert line.startswith(f"gpu1: {spec.service} not ready (dead: docker run exited with status 125) (fix: ")
    assert ("ss -ltnp 'sport = :5000'" in line) == port_taken
