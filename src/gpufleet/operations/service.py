"""The vLLM systemd service: secrets file, unit (running the pinned digest), enabled, (re)started, verified."""

from __future__ import annotations

import re
from typing import Any

from pyinfra import host
from pyinfra.api import FunctionCommand, OperationValueError, StringCommand, operation
from pyinfra.context import ctx_state

from gpufleet.operations.context import Hidden, context, fail, snapshot, use_sudo
from gpufleet.operations.files import put_content, put_secret
from gpufleet.operations.image import image_ref

# Values must read the same to systemd's EnvironmentFile, docker's --env-file and sh's `.` (the readiness probe):
# no quotes, spaces, $, backslashes or a leading ~.
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9._+/=:@-]+$")


def env_content(secrets: dict[str, str | None]) -> str:
    """The root-only env file: one NAME=value per set secret (values are never logged)."""
    lines = ["# Managed by gpufleet: secrets for the vLLM unit and the model download. Root-only (0600)."]
    for name, value in secrets.items():
        if value is None:
            continue
        if not _SAFE_VALUE.match(value):
            # The value itself is never echoed: this message may end up in logs.
            raise OperationValueError(f"{name}: the secret holds characters an env file cannot carry unquoted "
                                      "(fix: use a token of letters, digits and ._+/=:@-)")
        lines.append(f"{name}={value}")
    return "\n".join(lines) + "\n"


@operation()
def env_file(path: str, secrets: dict[str, str]):
    """Write the service's root-only secrets file. secrets: env var -> setting name (values read from host data,
    so they never pass through operation arguments)."""
    settings = context().settings
    commands = list(put_secret(path, env_content({env: settings.get(key) for env, key in secrets.items()})))
    if not commands:
        host.noop(f"{path} is up to date (0600 root)")
        return
    yield from commands


@operation()
def unit(spec: Any, path: str):
    """Install the systemd unit that runs the pinned image."""
    from gpufleet.unit import render_unit

    ref = image_ref(spec.image)
    # Before the pin exists (cold host, or a new vllm_image) the unit will change; while executing, the image
    # operation has resolved the digest and the real text is rendered.
    text = render_unit(spec, ref or spec.image)
    commands = list(put_content(path, text))
    if not commands:
        host.noop(f"{path} runs {ref}")
        return
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
        yield StringCommand("systemctl", "enable", unit_name)
    if _changed(changes):
        yield StringCommand("systemctl", "restart", unit_name)
    elif not snap.unit_active(unit_name):
        yield StringCommand("systemctl", "start", unit_name)
    elif snap.unit_enabled(unit_name):
        host.noop(f"{unit_name} is active and nothing it runs changed")


class _BearerTransport:
    """A gpufleet.health transport that adds `Authorization: Bearer <key>` to every request.

    vLLM guards /v1/* with the API key; the key travels inside the SSH channel, never on a command line.
    (Until gpufleet.health takes an API key itself.)
    """

    def __init__(self, inner: Any, api_key: str):
        self._inner, self._auth = inner, f"Bearer {api_key}"
        self.name = inner.name

    def http(self, port: int, timeout: float):
        conn = self._inner.http(port, timeout)
        request = conn.request

        def with_auth(method, url, body=None, headers=None, **kwargs):
            return request(method, url, body, {**(headers or {}), "Authorization": self._auth}, **kwargs)

        conn.request = with_auth
        return conn

    def container(self, service: str):
        return self._inner.container(service)

    def logs(self, service: str, tail: int = 30):
        return self._inner.logs(service, tail)


def _wait_ready(state, host, spec: Any, timeout_s: float, api_key: Hidden | None) -> bool:
    from gpufleet.health import Expected, transport_from_pyinfra_host, wait_until_ready

    host.log_styled(f"waiting up to {timeout_s:.0f} s for /health and /v1/models ({spec.served_model_name})")
    transport = transport_from_pyinfra_host(host)
    if api_key:
        transport = _BearerTransport(transport, api_key.reveal())
    report = wait_until_ready(transport, Expected.from_spec(spec), timeout_s)
    if report.ready:
        host.log_styled(f"ready: {report.detail}", fg="green")
        return True
    logs = list(report.logs)
    if not logs:
        # No container to read (docker run itself failed): systemd's journal has docker's error.
        ok, output = host.run_shell_command(f"journalctl -u {spec.service}.service -n 15 --no-pager -o cat",
                                            _sudo=use_sudo(host))
        logs = output.stdout_lines if ok else []
    for line in logs[-20:]:
        host.log_styled(f"  | {line}")
    return fail(host, f"{spec.service} not ready ({report.state}): {report.detail} "
                      f"(fix: see the container log above; `journalctl -u {spec.service}`)")


@operation(is_idempotent=False)
def ready(spec: Any, timeout_s: float, changes: list[Any], start: bool = True):
    """Verify the vLLM service answers /health and serves the expected model."""
    snap = snapshot()
    if not start:
        host.noop("no GPU: the service is not started, nothing to verify")
        return
    serving = snap.health_code == "200" and spec.served_model_name in (snap.served_models or [])
    if serving and not _changed(changes) and snap.unit_active(f"{spec.service}.service"):
        host.noop(f"ready: /health 200, /v1/models serves {spec.served_model_name}")
        return
    api_key = context().settings.get("vllm_api_key")
    yield FunctionCommand(_wait_ready, (spec, timeout_s, Hidden(api_key) if api_key else None), {})
