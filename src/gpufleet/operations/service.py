"""The vLLM systemd service: secrets file, unit (running the pinned digest), enabled, (re)started, verified.

Never break a serving host: when a converge replaces the unit of a service that was answering /health, the old
unit is kept (layout.unit_backup) and the verify step gets a Rollback; the deploy's verify callback
(gpufleet.deploys.verify) puts the old unit back if the new one never gets ready or dies during the soak.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, OperationValueError, State, StringCommand, operation
from pyinfra.api.operation import OperationMeta
from pyinfra.context import ctx_state

from gpufleet import hostlock
from gpufleet.facts.host import HostSnapshot
from gpufleet.health.check import Expected, identity_problems
from gpufleet.operations.files import put_content, put_secret
from gpufleet.operations.image import image_ref
from gpufleet.operations.layout import Layout, Managed, unit_backup
from gpufleet.operations.remote import Commands
from gpufleet.operations.secret import Hidden
from gpufleet.operations.snapshot import snapshot
from gpufleet.settings import SECRET_VALUE
from gpufleet.spec import ServeSpec
from gpufleet.unit import render_unit, unit_name

# Secrets every service's env file may carry: env var -> the setting holding it (vllm_secret_env adds more).
ENV_SECRETS = {"VLLM_API_KEY": "vllm_api_key", "HF_TOKEN": "vllm_hf_token"}


def managed(layout: Layout) -> Managed:
    return Managed(files=(layout.unit_file, layout.env_file), dirs=layout.cache_dirs)


def env_content(secrets: Mapping[str, str | None]) -> str:
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


def secret_values(settings: Mapping[str, Any], secrets: Mapping[str, str] = ENV_SECRETS) -> dict[str, str | None]:
    """env var -> value: the named settings (secrets: env var -> setting name), then vllm_secret_env's."""
    values = {env: settings.get(key) for env, key in secrets.items()}
    return {**values, **(settings.get("vllm_secret_env") or {})}


def hidden_secrets(settings: Mapping[str, Any]) -> dict[str, Hidden | None]:
    """secret_values, each wrapped for its way through pyinfra (operation arguments show in its debug log)."""
    return {env: Hidden(value) if value is not None else None for env, value in secret_values(settings).items()}


@operation()
def env_file(path: str, secrets: Mapping[str, Hidden | None]) -> Commands:
    """Write the service's root-only secrets file: one NAME=value per set secret (env var -> Hidden value)."""
    plain = {env: value.reveal() if value is not None else None for env, value in secrets.items()}
    commands = list(put_secret(path, env_content(plain)))
    if not commands:
        host.noop(f"{path} is up to date (0600 root)")
        return
    yield from commands


def was_serving(snap: HostSnapshot, service: str) -> bool:
    """Did the service answer /health before this run? Only such a unit is worth keeping to roll back to."""
    return snap.unit_active(unit_name(service)) and snap.health_code == "200"


def _keeps_backup(snap: HostSnapshot, service: str, path: str) -> bool:
    # One decision for the unit operation (which copies the unit) and the verify step (which restores it).
    return bool(snap.file_sha256.get(path)) and was_serving(snap, service)


@operation()
def unit(spec: ServeSpec, path: str) -> Commands:
    """Install the systemd unit that runs the pinned image; keep the replaced unit if it was serving."""
    ref = image_ref(spec.image)
    # Before the pin exists (cold host, or a new vllm_image) the unit will change; while executing, the image
    # operation has resolved the digest and the real text is rendered.
    text = render_unit(spec, ref or spec.image)
    commands = list(put_content(path, text))
    if not commands:
        host.noop(f"{path} runs {ref}")
        return
    if _keeps_backup(snapshot(), spec.service, path):
        # The verify step puts this unit back if the new one never gets ready or dies during the soak.
        yield StringCommand("install", "-D", "-m", "644", shlex.quote(path), shlex.quote(unit_backup(spec.service)))
    yield from commands
    yield StringCommand("systemctl", "daemon-reload")


def _executing() -> bool:
    state = ctx_state.get()
    return state is not None and state.is_executing


def _changed(ops: list[OperationMeta]) -> bool:
    if _executing():
        return any(op.did_change() for op in ops)
    return any(op.will_change for op in ops)


def _still_locked(state: State, host: Host) -> bool:
    """A (re)start must not interleave with another run's: stop this host if its lock was lost (the lease ran out
    while this run was stalled, and another run may hold the host now)."""
    try:
        hostlock.check_run_lock(host)
    except hostlock.LockLost as lost:
        host.log_styled(str(lost), fg="red")
        return False
    return True


@operation(is_idempotent=False)
def running(service: str, changes: list[OperationMeta], start: bool = True) -> Commands:
    """Enable the vLLM service and (re)start it when its unit, secrets or image changed, or when what runs is not
    what the unit on disk says (snapshot's RunningService.drift: the file checksums alone cannot see that)."""
    name = unit_name(service)
    snap = snapshot()
    if not start:
        host.noop(f"{name} installed, not started: no GPU on this host (gpufleet_allow_no_gpu)")
        return
    if snap.running.need_daemon_reload:
        # A unit written by a run that was cut before its daemon-reload: load it before (re)starting.
        yield StringCommand("systemctl", "daemon-reload")
    if not snap.unit_enabled(name):
        yield StringCommand("systemctl", "enable", shlex.quote(name))
    drift = snap.running.drift()
    if drift and _executing():  # said once (pyinfra runs this generator to plan, and again to execute)
        host.log_styled(f"{name} does not run what its unit says ({'; '.join(drift)}): restarting it", fg="yellow")
    if _changed(changes) or drift:
        yield FunctionCommand(_still_locked, (), {})
        yield StringCommand("systemctl", "restart", shlex.quote(name))
    elif not snap.unit_active(name):
        yield FunctionCommand(_still_locked, (), {})
        yield StringCommand("systemctl", "start", shlex.quote(name))
    elif snap.unit_enabled(name):
        host.noop(f"{name} is active and nothing it runs changed")


@dataclass(frozen=True)
class Rollback:
    """What the verify step needs to put the serving version back: the kept unit, the state entry it ran and the
    model name it served (the failed change may have renamed it)."""

    unit_path: str
    backup: str
    state_file: str
    previous: dict[str, Any] | None  # the state file's "current" before this run
    served_model_name: str


# The deploy's verify step, run while executing: (state, host, rollback or None, soak seconds) -> ready.
Verify = Callable[[State, Host, "Rollback | None", float], bool]


def serves_expected(snap: HostSnapshot, expected: Expected) -> bool:
    """Did the snapshot's probe find the expected server ready? The same identity check() holds a server to,
    on what the probe could see: /v1/models always, the cache config when /metrics reported it."""
    if snap.health_code != "200" or snap.served_models is None:
        return False
    if not snap.cache_config:
        expected = replace(expected, cache_config={})
    return not identity_problems(expected, snap.served_models, snap.cache_config)


@operation(is_idempotent=False)
def ready(spec: ServeSpec, layout: Layout, verify: Verify, changes: list[OperationMeta], start: bool = True,
          soak_s: float = 0.0, unit_op: OperationMeta | None = None) -> Commands:
    """Verify the vLLM service serves what its spec says; after a (re)start, verify with a soak of soak_s and
    hand verify a Rollback when the unit that was serving was kept (unit_op: the unit operation)."""
    snap = snapshot()
    if not start:
        host.noop("no GPU: the service is not started, nothing to verify")
        return
    restarted = _changed(changes) or bool(snap.running.drift()) or not snap.unit_active(unit_name(spec.service))
    if not restarted and serves_expected(snap, Expected.from_spec(spec)):
        host.noop(f"ready: /health 200, /v1/models serves {spec.served_model_name}")
        return
    rollback = None
    if unit_op is not None and _changed([unit_op]) and _keeps_backup(snap, spec.service, layout.unit_file):
        served = [model_id for model_id, _ in snap.served_models or []] or [spec.served_model_name]
        rollback = Rollback(unit_path=layout.unit_file, backup=unit_backup(spec.service),
                            state_file=layout.state_file, previous=(snap.state or {}).get("current"),
                            served_model_name=served[0])
    yield FunctionCommand(verify, (rollback, soak_s if restarted else 0.0), {})
