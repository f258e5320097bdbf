"""The vLLM systemd service: secrets file, unit (running the pinned digest), enabled, (re)started, verified.

Never break a serving host: when a converge replaces the unit of a service that was answering /health, the old
unit is kept (unit_backup); if the new one never gets ready, or dies during the soak (vllm_ready_soak_s), the
verify step puts the old unit back, restarts it, waits until it is ready again, points the state file's "current"
back at it and fails the host with one line.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from pyinfra import host
from pyinfra.api import FunctionCommand, OperationValueError, StringCommand, operation
from pyinfra.context import ctx_state

from gpufleet.health import HealthReport, HealthState, TransportError
from gpufleet.operations.context import Hidden, context, fail, snapshot, use_sudo
from gpufleet.operations.files import put_content, put_secret
from gpufleet.operations.image import STATE_DIR, image_ref, now_utc, pinned_ref, rolled_back, state_file, write_state
from gpufleet.settings import SECRET_VALUE


def env_content(secrets: dict[str, str | None]) -> str:
    """The root-only env file: one NAME=value per set secret (values are never logged). Settings validation
    refuses unsafe values first; this check keeps the operation safe on its own."""
    lines = ["# Managed by gpufleet: secrets for the vLLM unit and the model download. Root-only (0600)."]
    for name, value in secrets.items():
        if value is None:
            continue
        # Values must read the same to systemd's EnvironmentFile, docker's --env-file and sh's `.` (the
        # readiness probe): no quotes, spaces, $ or backslashes.
        if not SECRET_VALUE.fullmatch(value):
            # The value itself is never echoed: this message may end up in logs.
            raise OperationValueError(f"{name}: the secret holds characters an env file cannot carry unquoted "
                                      "(fix: use a token of letters, digits and ._+/=:@-)")
        lines.append(f"{name}={value}")
    return "\n".join(lines) + "\n"


def secret_values(settings: dict[str, Any], secrets: dict[str, str]) -> dict[str, str | None]:
    """env var -> value: the named settings (secrets: env var -> setting name), then vllm_secret_env's."""
    values = {env: settings.get(key) for env, key in secrets.items()}
    return {**values, **(settings.get("vllm_secret_env") or {})}


@operation()
def env_file(path: str, secrets: dict[str, str]):
    """Write the service's root-only secrets file. secrets: env var -> setting name (values read from host data,
    so they never pass through operation arguments), plus every vllm_secret_env entry."""
    commands = list(put_secret(path, env_content(secret_values(context().settings, secrets))))
    if not commands:
        host.noop(f"{path} is up to date (0600 root)")
        return
    yield from commands


def unit_backup(service: str) -> str:
    """Where the unit that was serving is kept while a replacement is verified. In gpufleet's state dir, not next
    to the unit: /etc/systemd/system is for units only."""
    return f"{STATE_DIR}/{service}.service.previous"


def was_serving(snap: Any, service: str) -> bool:
    """Did the service answer /health before this run? Only such a unit is worth keeping to roll back to."""
    return snap.unit_active(f"{service}.service") and snap.health_code == "200"


def _keeps_backup(snap: Any, spec: Any, path: str) -> bool:
    # One decision for the unit operation (which copies the unit) and the verify step (which restores it).
    return bool(snap.file_sha256.get(path)) and was_serving(snap, spec.service)


@operation()
def unit(spec: Any, path: str):
    """Install the systemd unit that runs the pinned image; keep the replaced unit if it was serving."""
    from gpufleet.unit import render_unit

    ref = image_ref(spec.image)
    # Before the pin exists (cold host, or a new vllm_image) the unit will change; while executing, the image
    # operation has resolved the digest and the real text is rendered.
    text = render_unit(spec, ref or spec.image)
    commands = list(put_content(path, text))
    if not commands:
        host.noop(f"{path} runs {ref}")
        return
    if _keeps_backup(snapshot(), spec, path):
        # The verify step puts this unit back if the new one never gets ready or dies during the soak.
        yield StringCommand("install", "-D", "-m", "644", shlex.quote(path), shlex.quote(unit_backup(spec.service)))
    yield from commands
    yield StringCommand("systemctl", "daemon-reload")


def _changed(ops: list[Any]) -> bool:
    state = ctx_state.get()
    if state is not None and state.is_executing:
        return any(op.did_change() for op in ops)
    return any(op.will_change for op in ops)


@operation(is_idempotent=False)
def running(service: str, changes: list[Any], start: bool = True):
    """Enable the vLLM service and (re)start it when its unit, secrets or image changed."""
    unit_name = f"{service}.service"
    snap = snapshot()
    if not start:
        host.noop(f"{unit_name} installed, not started: no GPU on this host (gpufleet_allow_no_gpu)")
        return
    if not snap.unit_enabled(unit_name):
        yield StringCommand("systemctl", "enable", shlex.quote(unit_name))
    if _changed(changes):
        yield StringCommand("systemctl", "restart", shlex.quote(unit_name))
    elif not snap.unit_active(unit_name):
        yield StringCommand("systemctl", "start", shlex.quote(unit_name))
    elif snap.unit_enabled(unit_name):
        host.noop(f"{unit_name} is active and nothing it runs changed")


# --- verify, soak, roll back ---------------------------------------------------------------------------------
POLL_S = 2.0


@dataclass(frozen=True)
class Rollback:
    """What the verify step needs to put the serving version back: the kept unit, the state entry it ran and the
    model name it served (the failed change may have renamed it)."""

    unit_path: str
    backup: str
    state_file: str
    previous: dict[str, Any] | None  # the state file's "current" before this run
    served_model_name: str


def exited_detail(show: str) -> str | None:
    """From `systemctl show -p ActiveState -p SubState -p ExecMainStatus`: why the service is not running its
    container, or None while it is (still) running it.

    The container runs with --rm, so once `docker run` exits there is nothing left for docker to report: without
    this, an image that exits at once would be waited for until vllm_ready_timeout (30 min by default)."""
    props = dict(line.split("=", 1) for line in show.splitlines() if "=" in line)
    active, sub, status = props.get("ActiveState", ""), props.get("SubState", ""), props.get("ExecMainStatus", "")
    if sub == "auto-restart" or active == "failed":
        return f"docker run exited with status {status or '?'} (systemd: {active}/{sub})"
    return None


def wait_ready(check_once: Callable[[], HealthReport], exited: Callable[[], str | None], timeout_s: float,
               poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], Any] = time.sleep) -> HealthReport:
    """Poll until ready; stop early on dead, misconfigured, or a service whose container exited."""
    deadline = clock() + timeout_s
    while True:
        report = check_once()
        if report.state in (HealthState.READY, HealthState.DEAD, HealthState.MISCONFIGURED):
            return report
        if report.state is HealthState.CONTAINER_NOT_RUNNING:
            why = exited()
            if why:
                return replace(report, state=HealthState.DEAD, detail=why)
        if clock() + poll_s > deadline:
            return replace(report, detail=f"{report.detail} (gave up after {timeout_s:.0f} s)")
        sleep(poll_s)


def soak(check_once: Callable[[], HealthReport], ready: HealthReport, soak_s: float, poll_s: float = POLL_S,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Any] = time.sleep) -> HealthReport:
    """Keep checking a just-ready service for soak_s: an engine that dies right after its first /health 200
    (a bad kernel on the first batch, a crashing engine core) must fail the deploy, not the first client."""
    start = clock()
    report = ready
    while clock() - start < soak_s:
        sleep(min(poll_s, max(0.0, soak_s - (clock() - start))))
        report = check_once()
        if not report.ready:
            return replace(report, detail=f"{report.detail} ({clock() - start:.0f} s after it was ready)")
    return report


def _journal(host: Any, service: str, lines: int = 15) -> list[str]:
    ok, output = host.run_shell_command(f"journalctl -u {shlex.quote(service + '.service')} -n {int(lines)} "
                                        "--no-pager -o cat",
                                        _sudo=use_sudo(host))
    return output.stdout_lines if ok else []


def _failed_logs(host: Any, transport: Any, service: str) -> list[str]:
    try:
        logs = transport.logs(service, tail=30)
    except TransportError:
        logs = []
    # No container left to read (it ran with --rm, or docker run itself failed): the journal has its output.
    return logs or _journal(host, service)


def _exited(host: Any, service: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        ok, output = host.run_shell_command(
            f"systemctl show -p ActiveState -p SubState -p ExecMainStatus {shlex.quote(service + '.service')}")
        return exited_detail("\n".join(output.stdout_lines)) if ok else None
    return probe


def _verify(state, host, spec: Any, timeout_s: float, soak_s: float, api_key: Hidden | None,
            rollback: Rollback | None) -> bool:
    from gpufleet.health import Expected, check, transport_from_pyinfra_host

    transport = transport_from_pyinfra_host(host)
    key = api_key.reveal() if api_key else None  # sent inside the SSH channel, never on a command line
    expected = Expected.from_spec(spec)

    def check_once(expected: Expected = expected) -> HealthReport:
        return check(transport, expected, api_key=key)

    host.log_styled(f"waiting up to {timeout_s:.0f} s for /health and /v1/models ({spec.served_model_name})")
    report = wait_ready(check_once, _exited(host, spec.service), timeout_s)
    if report.ready and soak_s > 0:
        host.log_styled(f"ready: {report.detail}; watching it for {soak_s:.0f} s (vllm_ready_soak_s)")
        report = soak(check_once, report, soak_s)
    if report.ready:
        host.log_styled(f"ready: {report.detail}", fg="green")
        return True

    for line in _failed_logs(host, transport, spec.service)[-20:]:
        host.log_styled(f"  | {line}")
    if rollback is None:
        return fail(host, f"{spec.service} not ready ({report.state}): {report.detail} "
                          f"(fix: see the container log above; `journalctl -u {spec.service}`)")
    previous_expected = replace(expected, served_model_name=rollback.served_model_name, max_model_len=None,
                                cache_config={})
    return _roll_back(host, spec, report, rollback, partial(check_once, previous_expected), timeout_s)


def _roll_back(host: Any, spec: Any, report: HealthReport, rollback: Rollback,
               check_previous: Callable[[], HealthReport], timeout_s: float) -> bool:
    """Put the kept unit back, point the state file at it, wait until it is ready; always False (the host
    failed its rollout), with one line saying where it stands."""
    ctx = context(host)
    new_ref = ctx.resolved.get("image_ref") or pinned_ref(ctx.snapshot.state, spec.image) or spec.image
    previous = rollback.previous or {}
    prev_ref = previous.get("ref") or "the previous unit"
    what = f"new image {new_ref}" if new_ref != prev_ref else f"new settings (same image {new_ref})"
    sudo = use_sudo(host)
    host.log_styled(f"rolling back to {prev_ref}")
    ok, output = host.run_shell_command(
        f"install -m 644 {shlex.quote(rollback.backup)} {shlex.quote(rollback.unit_path)} && "
        f"systemctl daemon-reload && systemctl restart {shlex.quote(spec.service + '.service')}", _sudo=sudo)
    if not ok:
        return fail(host, f"{what} failed verification ({report.state}: {report.detail}); the rollback to "
                          f"{prev_ref} failed too: {' | '.join(output.stderr_lines[-3:])} "
                          f"(fix: `systemctl status {spec.service}`; {rollback.backup} holds the unit that served)")
    if previous and new_ref != prev_ref:
        # Right after the unit goes back: "current" is what the unit runs, whether or not it gets ready.
        ok, output = host.run_shell_command(f"cat {shlex.quote(rollback.state_file)}", _sudo=sudo)
        try:
            on_host = json.loads("\n".join(output.stdout_lines)) if ok else None
        except ValueError:
            on_host = None
        reason = f"{report.state}: {report.detail}"
        if not write_state(host, rollback.state_file, rolled_back(on_host, new_ref, previous, reason, now_utc())):
            return fail(host, f"rolled back to {prev_ref}, but could not write {rollback.state_file}")
    # The previous version is held to what it served before this run, not to the new settings' identity.
    again = wait_ready(check_previous, _exited(host, spec.service), timeout_s)
    if not again.ready:
        return fail(host, f"{what} failed verification ({report.state}: {report.detail}); rolled back to "
                          f"{prev_ref}, which is not ready either ({again.state}: {again.detail}) "
                          f"(fix: `journalctl -u {spec.service}`; {rollback.backup} holds the unit that served)")
    fix = (f"set vllm_image back to {previous['image']} or to an image that accepts these settings"
           if new_ref != prev_ref and previous.get("image") else "revert the settings changed in this run")
    from pyinfra import logger

    # One line naming the host (not the "[host]" prefix): it reads the same in a summary or a grep of the log.
    logger.error(f"{host.name}: {what} failed verification ({report.state}: {report.detail}); rolled back to "
                 f"{prev_ref}, which is ready (fix: {fix}, then converge again; the failed container's log is above)")
    return False


@operation(is_idempotent=False)
def ready(spec: Any, timeout_s: float, changes: list[Any], start: bool = True, soak_s: float = 0.0,
          unit_op: Any = None):
    """Verify the vLLM service answers /health and serves the expected model; after a (re)start, watch it for
    soak_s and put the unit that was serving back if the new one fails (unit_op: the unit operation)."""
    snap = snapshot()
    if not start:
        host.noop("no GPU: the service is not started, nothing to verify")
        return
    unit_name = f"{spec.service}.service"
    restarted = _changed(changes) or not snap.unit_active(unit_name)
    serving = snap.health_code == "200" and spec.served_model_name in (snap.served_models or [])
    if serving and not restarted:
        host.noop(f"ready: /health 200, /v1/models serves {spec.served_model_name}")
        return
    from gpufleet.unit import unit_path

    path = unit_path(spec)
    rollback = None
    if unit_op is not None and _changed([unit_op]) and _keeps_backup(snap, spec, path):
        rollback = Rollback(unit_path=path, backup=unit_backup(spec.service), state_file=state_file(spec.service),
                            previous=(snap.state or {}).get("current"),
                            served_model_name=(snap.served_models or [spec.served_model_name])[0])
    api_key = context().settings.get("vllm_api_key")
    yield FunctionCommand(_verify, (spec, timeout_s, soak_s if restarted else 0.0,
                                    Hidden(api_key) if api_key else None, rollback), {})
