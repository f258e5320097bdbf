"""The deploy's verify step, then its commit or rollback (order: docs/deploy.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from pyinfra.api import Host, State
from pyinfra.context import ctx_host

from gpufleet.defaults import DEFAULTS, SPEED_TOLERANCE_SETTING
from gpufleet.health import HealthReport, HealthState, check, poll_ready, soak
from gpufleet.health.answers import AnswerCheck, check_answers, check_completion
from gpufleet.health.answers import failed as failed_answers
from gpufleet.health.check import reached
from gpufleet.health.serving import Served, run_checks
from gpufleet.health.serving import failed as failed_serving
from gpufleet.health.speed import speed_check
from gpufleet.health.wait import transient
from gpufleet.hoststate.ledger import Version
from gpufleet.hoststate.ledger import roll_back as ledger_roll_back
from gpufleet.operations.base import fail
from gpufleet.operations.run import host_run, run_context
from gpufleet.operations.secret import Hidden
from gpufleet.remote.ssh import transport_from_pyinfra_host
from gpufleet.remote.transport import ContainerInfo
from gpufleet.vllm.commit import commit_pending, roll_back, runs_problem
from gpufleet.vllm.operations.image import now_utc
from gpufleet.vllm.operations.service import save_ledger
from gpufleet.vllm.service_watch import failed_logs, service_exited
from gpufleet.vllm.spec import ServeSpec
from gpufleet.wire.checks import SPEED
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.identity import Expected
from gpufleet.wire.speed import SpeedFigures


@dataclass(frozen=True)
class VerifyOutcome:
    passed: bool
    ready_at: str = ""  # when it first answered ready
    failed: str = ""  # "<state>: <detail>"
    check: str | None = None  # the failed answer or serving check
    port_taken: bool = False  # docker could not publish the port
    speed: SpeedFigures | None = None


class VerifyOutcomes(dict[str, VerifyOutcome]):
    """Verdicts by host name; they exist only once pyinfra executes."""


def _outcomes(host: Host) -> VerifyOutcomes:
    return run_context(host.state).slot(VerifyOutcomes, VerifyOutcomes)


def outcome(host: Host) -> VerifyOutcome | None:
    """None when nothing was verified."""
    return _outcomes(host).get(host.name)


def verify_passed() -> bool:
    """pyinfra's _if for the commit."""
    found = outcome(ctx_host.get())
    return found is not None and found.passed


@dataclass(frozen=True)
class Verification:
    """Its bound methods are the operations' functions: pyinfra names each by __name__."""

    spec: ServeSpec
    timeout_s: float
    api_key: Hidden | None
    ledger_path: str
    served_before: str  # the committed version's model name, for a rollback
    checks: tuple[str, ...] = ()  # gpufleet_verify_checks
    speed_earlier: SpeedFigures | None = None
    speed_tolerance: float = DEFAULTS[SPEED_TOLERANCE_SETTING]

    def verify(self, state: State, host: Host, soak_s: float) -> bool:
        """A verify that could not finish fails the host here; a failed one, in the rollback."""
        found = verify_rollout(host, self, soak_s)
        if found is None:
            return False
        _outcomes(host)[host.name] = found
        return True

    def commit(self, state: State, host: Host) -> bool:
        found = outcome(host)
        if found is None or not found.passed:
            return fail(
                host,
                f"{host.name}: nothing committed: this run's verify did not pass on the host (fix: converge again)",
            )
        if len(state.activated_hosts) > 1 and not still_serving(host, self):
            return False
        return commit_pending(host, self, found.ready_at, found.speed)

    def roll_back_if_failed(self, state: State, host: Host) -> bool:
        """After a failed verify, roll back and return False."""
        found = outcome(host)
        if found is None:
            return fail(
                host, f"{host.name}: nothing rolled back: this run has no verdict for the host (fix: converge again)"
            )
        return True if found.passed else after_failed_verify(host, self, found)

    def roll_back_cut(self, state: State, host: Host, reason: str) -> bool:
        """Roll back a cut run's failed version; unmarked when its port was taken."""
        ledger = host_run(host).ledger
        assert ledger.pending is not None and ledger.committed is not None  # what RollBackPending means
        host.log_styled(f"{reason}: rolling it back", fg="yellow")
        taken = port_taken(failed_logs(host, transport_from_pyinfra_host(host), self.spec.service), self.spec.port)
        return roll_back(
            host,
            self,
            ledger,
            reason + (f"; port {self.spec.port} is taken on the host ({taken})" if taken else ""),
            mark=taken is None,
        )

    @property
    def key(self) -> str | None:
        """The API key, sent inside the SSH channel, never on a command line."""
        return self.api_key.reveal() if self.api_key else None

    def check_once(self, host: Host, expected: Expected) -> Callable[[], HealthReport]:
        transport = transport_from_pyinfra_host(host)
        key = self.key
        return lambda: check(transport, expected, api_key=key)


# Its own completions catch an engine dying under load (docs/verify.md).
SOAK_REQUEST_EVERY_S = 5.0


def with_traffic(check_once: Callable[[], HealthReport], send: Callable[[], AnswerCheck], every_s: float,
                 clock: Callable[[], float] = time.monotonic) -> Callable[[], HealthReport]:  # fmt: skip
    """check_once, sending a request every `every_s` while ready; only a wrong answer fails the look."""
    last_sent: list[float] = []

    def look() -> HealthReport:
        report = check_once()
        if report.ready and (not last_sent or clock() - last_sent[-1] >= every_s):
            last_sent[:] = [clock()]
            answer = send()
            if not answer.ran:
                return check_once()
            if not answer.ok:
                return answer_failed(check_once, f"answers: {answer.line()}")
        return report

    return look


def answer_failed(check_once: Callable[[], HealthReport], line: str) -> HealthReport:
    """Misconfigured with `line`, unless the host is no longer ready."""
    again = check_once()
    return again if not again.ready else replace(again, state=HealthState.MISCONFIGURED, detail=line)


class CheckNotRun(Exception):
    """A check could not run while the host still read ready."""


def verify_rollout(host: Host, v: Verification, soak_s: float) -> VerifyOutcome | None:
    """None when the verify could not finish: the host failed, the version stays pending."""
    spec = v.spec
    exited = service_exited(host, spec.service)
    check_once = v.check_once(host, Expected.from_spec(spec))
    host.log_styled(f"waiting up to {v.timeout_s:.0f} s for /health and /v1/models ({spec.served_model_name})")
    report = poll_ready(check_once, v.timeout_s, exited=exited)
    ready_at = now_utc()
    if report.ready and soak_s > 0:
        host.log_styled(
            f"ready: {report.detail}; watching it for {soak_s:.0f} s (vllm_ready_soak_s), with a "
            f"completion every {SOAK_REQUEST_EVERY_S:.0f} s"
        )
        send = partial(
            check_completion,
            transport_from_pyinfra_host(host),
            reached(Expected.from_spec(spec), report.container),
            api_key=v.key,
        )
        report = soak(with_traffic(check_once, send, SOAK_REQUEST_EVERY_S), report, soak_s, exited=exited)
    failed_check = "completion" if report.detail.startswith("answers: completion:") else None
    pending = host_run(host).ledger.pending  # None: a restart of the committed version
    problem = installed_problem(pending.version, report.container) if report.ready and pending else None
    if problem:
        report = replace(report, state=HealthState.MISCONFIGURED, detail=problem)
    not_run = None
    figures = None
    try:
        if report.ready:
            report, failed_check = answers_report(host, v, report, check_once)
        if report.ready and pending is not None and SPEED in v.checks:
            report, failed_check, figures = speed_report(host, v, report, check_once)
        if report.ready and pending is not None and v.checks:
            report, failed_check = serving_report(host, v, report, check_once)
    except CheckNotRun as unknown:
        not_run = str(unknown)
    if report.ready and not_run is None:
        host.log_styled(f"ready: {report.detail}", fg="green")
        return VerifyOutcome(passed=True, ready_at=ready_at, speed=figures)
    if not_run is not None or (transient(report) and pending is not None):
        # Nothing against the version; the next run verifies it.
        why = not_run or f"{report.state}: {report.detail}"
        kept = ", the new version stays pending" if pending else ""
        fix = "converge again" if not_run else "restore the link to the host, then converge again"
        fail(
            host,
            f"{host.name}: could not finish verifying {spec.service} ({why}); nothing was committed or rolled "
            f"back{kept} (fix: {fix}: the next run verifies it)",
        )
        return None

    logs = failed_logs(host, transport_from_pyinfra_host(host), spec.service)[-20:]
    for line in logs:
        host.log_styled(f"  | {line}")
    failed = f"{report.state}: {report.detail}"
    taken = port_taken(logs, spec.port)
    if taken:  # the cause, not the exit status it led to
        failed += f"; port {spec.port} is taken on the host ({taken})"
    failed_check = failed_check if report.state == HealthState.MISCONFIGURED else None
    return VerifyOutcome(passed=False, failed=failed, check=failed_check, port_taken=taken is not None)


def still_serving(host: Host, v: Verification) -> bool:
    """One more look before a delayed commit; not ready is a failed verify."""
    pending = host_run(host).ledger.pending
    report = v.check_once(host, Expected.from_spec(v.spec))()
    problem = installed_problem(pending.version, report.container) if report.ready and pending else None
    if report.ready and problem is None:
        return True
    if transient(report):
        return fail(
            host,
            f"{host.name}: could not look at {v.spec.service} again before its commit ({report.state}: "
            f"{report.detail}); nothing was committed or rolled back, the new version stays pending "
            "(fix: restore the link to the host, then converge again: the next run verifies it)",
        )
    detail = problem or f"{report.state}: {report.detail}"
    return after_failed_verify(
        host,
        v,
        VerifyOutcome(passed=False, failed=f"{detail} (after its verify, while the run waited for the other hosts)"),
    )


def after_failed_verify(host: Host, v: Verification, found: VerifyOutcome) -> bool:
    """Roll back, or with nothing to go back to, mark the pending version failed. Always False."""
    spec, ledger = v.spec, host_run(host).ledger
    # A taken port is the host's fault, not the version's.
    mark = not found.port_taken
    if ledger.pending is None or ledger.committed is None or ledger.committed.version == ledger.pending.version:
        if (
            mark
            and ledger.pending is not None
            and not save_ledger(
                host, v.ledger_path, ledger_roll_back(ledger, found.failed, now_utc(), check=found.check)
            )
        ):
            return False
        fix = (
            f"`ss -ltnp 'sport = :{spec.port}'` on the host shows what holds it: stop that, or set vllm_port to a "
            "free port"
            if found.port_taken
            else f"see the container log above; `journalctl -u {spec.service}`"
        )
        return fail(host, f"{host.name}: {spec.service} not ready ({found.failed}) (fix: {fix})")
    return roll_back(host, v, ledger, found.failed, check=found.check, mark=mark)


_PORT_TAKEN = ("address already in use", "port is already allocated")


def port_taken(logs: Sequence[str], port: int) -> str | None:
    """docker's own words when it could not publish `port`."""
    for line in reversed(logs):
        if f":{port}" in line and any(words in line for words in _PORT_TAKEN):
            start = line.find("Bind for") if "Bind for" in line else line.find("listen ")
            return excerpt(line[start:] if start >= 0 else line, 120)
    return None


def installed_problem(version: Version, container: ContainerInfo | None) -> str | None:
    """One line when what answers is not what this run installed."""
    return runs_problem(version, container, "this run installed")


def answers_report(host: Host, v: Verification, ready: HealthReport,
                   check_once: Callable[[], HealthReport]) -> tuple[HealthReport, str | None]:  # fmt: skip
    """A client's requests; returns the report and the failed check."""
    checks = check_answers(
        transport_from_pyinfra_host(host), reached(Expected.from_spec(v.spec), ready.container), api_key=v.key
    )
    bad = failed_answers([c for c in checks if c.ran])
    return _judged(host, "answer check", checks, ready, check_once, bad and f"answers: {bad}")


def serving_report(host: Host, v: Verification, ready: HealthReport,
                   check_once: Callable[[], HealthReport]) -> tuple[HealthReport, str | None]:  # fmt: skip
    """The serving checks (gpufleet.health.serving)."""
    served = Served.from_spec(v.spec)
    names = served.applicable([name for name in v.checks if name != SPEED])  # speed_report ran it
    if not names:
        return ready, None
    host.log_styled(f"serving checks: {', '.join(names)} (gpufleet_verify_checks)")
    checks = run_checks(
        transport_from_pyinfra_host(host),
        reached(Expected.from_spec(v.spec), ready.container),
        served,
        names,
        api_key=v.key,
    )
    return _judged(host, "serving check", checks, ready, check_once, failed_serving([c for c in checks if c.ran]))


def speed_report(
    host: Host, v: Verification, ready: HealthReport, check_once: Callable[[], HealthReport]
) -> tuple[HealthReport, str | None, SpeedFigures | None]:
    """The speed check against the old version; also returns its figures."""
    host.log_styled(
        f"speed check: {'against the old version' if v.speed_earlier else 'no earlier figures'}, "
        f"at most {v.speed_tolerance:.0%} slower"
    )
    check, figures = speed_check(
        transport_from_pyinfra_host(host),
        reached(Expected.from_spec(v.spec), ready.container),
        Served.from_spec(v.spec),
        v.speed_earlier,
        v.speed_tolerance,
        api_key=v.key,
    )
    report, failed_check = _judged(
        host, "serving check", (check,), ready, check_once, None if check.ok else f"check {check.line()}"
    )
    return report, failed_check, figures


def _judged(
    host: Host,
    kind: str,
    checks: Sequence[AnswerCheck],
    ready: HealthReport,
    check_once: Callable[[], HealthReport],
    bad: str | None,
) -> tuple[HealthReport, str | None]:
    """Raises CheckNotRun when a check did not run and the host still reads ready."""
    for c in checks:
        host.log_styled(f"{kind} {c.line()}", fg="green" if c.ok else "red" if c.ran else "yellow")
    if bad is not None:
        return answer_failed(check_once, bad), next(c.name for c in checks if not c.ok and c.ran)
    unknown = next((c for c in checks if not c.ran), None)
    if unknown is None:
        return ready, None
    again = check_once()
    if not again.ready:
        return again, None
    raise CheckNotRun(f"{kind} {unknown.line()}")
