"""The deploy's verify step: ready, soak, and roll back a failed new version. The deploy-side use of
gpufleet.health (whose poller, check and notion of "ready" `gpufleet verify` shares).

verify_rollout() runs inside the ready operation's FunctionCommand, while pyinfra executes: it waits for the
restarted service, watches it for the soak, and, given a Rollback (the unit that was serving was kept), puts that
unit back, points the state file's "current" back at it, waits until it is ready again and fails the host with
one line naming both versions.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace

from pyinfra import logger
from pyinfra.api import Host, State

from gpufleet import hostlock
from gpufleet.health import (
    Expected,
    HealthReport,
    Transport,
    TransportError,
    check,
    poll_ready,
    soak,
    transport_from_pyinfra_host,
)
from gpufleet.health.wait import Exited
from gpufleet.operations.image import image_ref, now_utc, rolled_back, write_state
from gpufleet.operations.remote import fail, use_sudo
from gpufleet.operations.secret import Hidden
from gpufleet.operations.service import Rollback
from gpufleet.spec import ServeSpec
from gpufleet.unit import unit_name


def exited_detail(show: str) -> str | None:
    """From `systemctl show -p ActiveState -p SubState -p ExecMainStatus`: why the service is not running its
    container, or None while it is (still) running it."""
    props = dict(line.split("=", 1) for line in show.splitlines() if "=" in line)
    active, sub, status = props.get("ActiveState", ""), props.get("SubState", ""), props.get("ExecMainStatus", "")
    if sub == "auto-restart" or active == "failed":
        return f"docker run exited with status {status or '?'} (systemd: {active}/{sub})"
    return None


def service_exited(host: Host, service: str) -> Exited:
    """health.wait's `exited` for a systemd service: asks systemd whether `docker run` exited."""
    def probe() -> str | None:
        ok, output = host.run_shell_command(
            f"systemctl show -p ActiveState -p SubState -p ExecMainStatus {shlex.quote(unit_name(service))}")
        return exited_detail("\n".join(output.stdout_lines)) if ok else None
    return probe


def _journal(host: Host, service: str, lines: int = 15) -> list[str]:
    ok, output = host.run_shell_command(f"journalctl -u {shlex.quote(unit_name(service))} -n {int(lines)} "
                                        "--no-pager -o cat", _sudo=use_sudo(host))
    return output.stdout_lines if ok else []


def failed_logs(host: Host, transport: Transport, service: str) -> list[str]:
    try:
        logs = transport.logs(service, tail=30)
    except TransportError:
        logs = []
    # No container left to read (it ran with --rm, or docker run itself failed): the journal has its output.
    return logs or _journal(host, service)


@dataclass(frozen=True)
class Verification:
    """The verify step of one host's deploy; pass its bound `run` to gpufleet.operations.service.ready (a bound
    method: pyinfra names a FunctionCommand by its function's __name__)."""

    spec: ServeSpec
    timeout_s: float
    api_key: Hidden | None

    def run(self, state: State, host: Host, rollback: Rollback | None, soak_s: float) -> bool:
        return verify_rollout(host, self.spec, self.timeout_s, self.api_key, rollback, soak_s)


def verify_rollout(host: Host, spec: ServeSpec, timeout_s: float, api_key: Hidden | None, rollback: Rollback | None,
                   soak_s: float) -> bool:
    """Ready within timeout_s, then still ready for soak_s; else the logs, and the rollback if there is one."""
    transport = transport_from_pyinfra_host(host)
    key = api_key.reveal() if api_key else None  # sent inside the SSH channel, never on a command line
    expected = Expected.from_spec(spec)
    exited = service_exited(host, spec.service)

    def check_once(expected: Expected = expected) -> HealthReport:
        return check(transport, expected, api_key=key)

    host.log_styled(f"waiting up to {timeout_s:.0f} s for /health and /v1/models ({spec.served_model_name})")
    report = poll_ready(check_once, timeout_s, exited=exited)
    if report.ready and soak_s > 0:
        host.log_styled(f"ready: {report.detail}; watching it for {soak_s:.0f} s (vllm_ready_soak_s)")
        report = soak(check_once, report, soak_s, exited=exited)
    if report.ready:
        host.log_styled(f"ready: {report.detail}", fg="green")
        return True

    for line in failed_logs(host, transport, spec.service)[-20:]:
        host.log_styled(f"  | {line}")
    if rollback is None:
        return fail(host, f"{spec.service} not ready ({report.state}): {report.detail} "
                          f"(fix: see the container log above; `journalctl -u {spec.service}`)")
    # The previous version is held to what it served before this run, not to the new settings' identity.
    previous = replace(expected, served_model_name=rollback.served_model_name, max_model_len=None, cache_config={})
    return roll_back(host, spec, report, rollback, lambda: check_once(previous), exited, timeout_s)


def roll_back(host: Host, spec: ServeSpec, report: HealthReport, rollback: Rollback,
              check_previous: Callable[[], HealthReport], exited: Exited, timeout_s: float) -> bool:
    """Put the kept unit back, point the state file at it, wait until it is ready; always False (the host
    failed its rollout), with one line saying where it stands."""
    new_ref = image_ref(spec.image, host) or spec.image
    previous = rollback.previous or {}
    prev_ref = previous.get("ref") or "the previous unit"
    what = f"new image {new_ref}" if new_ref != prev_ref else f"new settings (same image {new_ref})"
    failed = f"{what} failed verification ({report.state}: {report.detail})"
    try:
        hostlock.check_run_lock(host)  # the rollback restarts too: never interleaved with another run's restart
    except hostlock.LockLost as lost:
        return fail(host, f"{failed}; not rolled back: {lost}")
    host.log_styled(f"rolling back to {prev_ref}")
    ok, output = host.run_shell_command(
        f"install -m 644 {shlex.quote(rollback.backup)} {shlex.quote(rollback.unit_path)} && "
        f"systemctl daemon-reload && systemctl restart {shlex.quote(unit_name(spec.service))}", _sudo=use_sudo(host))
    if not ok:
        return fail(host, f"{failed}; the rollback to {prev_ref} failed too: {' | '.join(output.stderr_lines[-3:])} "
                          f"(fix: `systemctl status {spec.service}`; {rollback.backup} holds the unit that served)")
    # Right after the unit goes back: "current" is what the unit runs, whether or not it gets ready.
    if previous and new_ref != prev_ref and not restore_state(host, rollback, new_ref, report):
        return fail(host, f"rolled back to {prev_ref}, but could not write {rollback.state_file}")
    again = poll_ready(check_previous, timeout_s, exited=exited)
    if not again.ready:
        return fail(host, f"{failed}; rolled back to {prev_ref}, which is not ready either ({again.state}: "
                          f"{again.detail}) (fix: `journalctl -u {spec.service}`; {rollback.backup} holds the unit "
                          "that served)")
    fix = (f"set vllm_image back to {previous['image']} or to an image that accepts these settings"
           if new_ref != prev_ref and previous.get("image") else "revert the settings changed in this run")
    # One line naming the host (not the "[host]" prefix): it reads the same in a summary or a grep of the log.
    logger.error(f"{host.name}: {failed}; rolled back to {prev_ref}, which is ready (fix: {fix}, then converge "
                 "again; the failed container's log is above)")
    return False


def restore_state(host: Host, rollback: Rollback, failed_ref: str, report: HealthReport) -> bool:
    """Point the state file's "current" back at the version that served, marking failed_ref failed in history."""
    ok, output = host.run_shell_command(f"cat {shlex.quote(rollback.state_file)}", _sudo=use_sudo(host))
    try:
        on_host = json.loads("\n".join(output.stdout_lines)) if ok else None
    except ValueError:
        on_host = None
    reason = f"{report.state}: {report.detail}"
    new_state = rolled_back(on_host, failed_ref, rollback.previous or {}, reason, now_utc())
    return write_state(host, rollback.state_file, new_state)
