"""The vLLM systemd service: secrets file, unit, (re)start, verify, commit or rollback (docs/crash-safety.md)."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import replace

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, OperationValueError, State, StringCommand, operation
from pyinfra.api.operation import OperationMeta
from pyinfra.context import ctx_state

from gpufleet import hostlock
from gpufleet.hoststate.ledger import (
    DropPending,
    FinishPending,
    Ledger,
    Nothing,
    Resume,
    Version,
    begin,
    drop_pending,
    refused_target,
    render,
    retry_failed,
)  # fmt: skip
from gpufleet.hoststate.paths import unit_backup
from gpufleet.operations.base import Commands, fail
from gpufleet.operations.files import put_content, put_secret, sha256, write_file
from gpufleet.operations.run import host_run, still_held_test, still_locked, while_held
from gpufleet.operations.secret import Hidden
from gpufleet.units import unit_name, unit_path
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.layout import Layout, Managed
from gpufleet.vllm.operations.group import GroupRun
from gpufleet.vllm.operations.image import now_utc, target_ref
from gpufleet.vllm.operations.model import target_model
from gpufleet.vllm.settings import VllmSettings
from gpufleet.vllm.snapshot import snapshot
from gpufleet.vllm.spec import ServeSpec
from gpufleet.vllm.unit import render_unit
from gpufleet.vllm.value_rules import SECRET_VALUE
from gpufleet.vllm.weights import ModelTarget
from gpufleet.wire.identity import Expected, identity_problems


def managed(layout: Layout) -> Managed:
    return Managed(files=(layout.unit_file, layout.env_file), dirs=layout.cache_dirs)


def env_content(secrets: Mapping[str, str | None]) -> str:
    """The root-only env file: one NAME=value per set secret."""
    lines = ["# Managed by gpufleet: secrets for the vLLM unit and the model download. Root-only (0600)."]
    for name, value in secrets.items():
        if value is None:
            continue
        # systemd, docker --env-file and sh must read it alike; the value is never echoed.
        if not SECRET_VALUE.fullmatch(value):
            raise OperationValueError(
                f"{name}: the secret holds characters an env file cannot carry unquoted "
                "(fix: use a token of letters, digits and ._+/=:@-)"
            )
        lines.append(f"{name}={value}")
    return "\n".join(lines) + "\n"


def secret_values(settings: VllmSettings) -> dict[str, str | None]:
    """env var -> secret (None: unset)."""
    return {"VLLM_API_KEY": settings.api_key, "HF_TOKEN": settings.hf_token, **settings.secret_env}


def hidden_secrets(settings: VllmSettings) -> dict[str, Hidden | None]:
    """secret_values wrapped, since pyinfra's debug log shows operation arguments."""
    return {env: Hidden(value) if value is not None else None for env, value in secret_values(settings).items()}


@operation()
def env_file(path: str, secrets: Mapping[str, Hidden | None]) -> Commands:
    """Write the service's root-only secrets file."""
    plain = {env: value.reveal() if value is not None else None for env, value in secrets.items()}
    commands = list(put_secret(path, env_content(plain)))
    if not commands:
        host.noop(f"{path} is up to date (0600 root)")
        return
    yield FunctionCommand(still_locked, (), {})  # a run that lost the host writes nothing
    yield from commands


def target_version(spec: ServeSpec, host: Host, pin: str | None, model: ModelTarget | None = None) -> Version:
    """The version this run installs: the pulled digest once known, else `pin`."""
    ref = target_ref(pin, host) or spec.image
    at = target_model(model, host)
    return Version(
        image=spec.image,
        ref=ref,
        unit_sha256=sha256(render_unit(spec, ref, at)),
        spec_hash=spec.spec_hash,
        service=spec.service,
        port=spec.port,
        model=at,
        model_revision=model.revision if model and at else None,
        group=spec.group.version(ref, at) if spec.group else None,
    )


def save_ledger(host: Host, path: str, ledger: Ledger) -> bool:
    """Write the host's ledger atomically, only while this run holds the lock and the file is as this run left it."""
    if not still_locked(host.state, host):
        return fail(host, f"{host.name}: {path} not written: this run no longer holds the host (fix: run again)")
    held = host_run(host)
    content = render(ledger)
    guards = [test for test in (still_held_test(host), _unchanged_test(path, held.ledger_sha256)) if test is not None]
    written = write_file(host, path, content, only_if=" && ".join(guards) if guards else None)
    if written is None:
        return fail(
            host,
            f"{host.name}: {path} not written: another run holds the host now or changed it since "
            "this run read it (fix: run again; it reads the host anew)",
        )
    if not written:
        return fail(host, f"{host.name}: could not write {path} (fix: check free space and permissions there)")
    held.ledger, held.ledger_sha256[path] = ledger, sha256(content)
    return True


def _unchanged_test(path: str, read: Mapping[str, str | None]) -> str | None:
    """A shell test that the file is as this run read or wrote it; None when it was not read."""
    if path not in read:
        return None
    now = f"$(sha256sum < {shlex.quote(path)} 2>/dev/null | cut -c1-64)"
    return f'[ "{now}" = "{read[path] or ""}" ]'


def _begin(
    state: State, host: Host, spec: ServeSpec, path: str, pin: str | None, retry: bool, model: ModelTarget | None = None
) -> bool:
    """Record the target as pending before the unit changes or the service restarts."""
    target, ledger = target_version(spec, host, pin, model), host_run(host).ledger
    if ledger.pending is not None and ledger.pending.version == target:
        return True
    if ledger.pending is None and ledger.committed is not None and ledger.committed.version == target:
        return True
    if ledger.pending is not None:
        # Never verified: the committed version stays the rollback target.
        ledger = drop_pending(ledger)
    if retry:
        ledger = retry_failed(ledger, target)
    refused = refused_target(ledger, target)
    if refused:
        # Preflight could not know a tag this pull resolved.
        return fail(host, f"{host.name}: {refused}")
    return save_ledger(host, path, begin(ledger, target, hostlock.Holder.this_process().operator(), now_utc()))


def _backup_commands(spec: ServeSpec) -> Commands:
    """Copy the serving unit as the rollback target of a ledger of the old format."""
    committed = host_run().ledger.committed
    if committed is None or committed.version.unit_sha256 is not None:
        return
    snap = snapshot()
    if (
        snap.unit_active(unit_name(spec.service))
        and snap.health_code == "200"
        and snap.file_sha256.get(unit_path(spec.service))
    ):
        yield StringCommand(
            "install", "-D", "-m", "644", shlex.quote(unit_path(spec.service)), shlex.quote(unit_backup(spec.service))
        )


@operation()
def unit(
    spec: ServeSpec, path: str, ledger_path: str, pin: str | None, retry_failed: bool, model: ModelTarget | None = None
) -> Commands:
    """Install the unit that runs the pinned image; the ledger names it pending first."""
    ref = target_ref(pin)
    # Without a pin the plan shows a change; while executing, the pull has resolved it.
    text = render_unit(spec, ref or spec.image, target_model(model))
    commands = list(put_content(path, text))
    if not commands:
        host.noop(f"{path} runs {ref}")
        return
    yield from _backup_commands(spec)
    yield FunctionCommand(_begin, (spec, ledger_path, pin, retry_failed, model), {})
    yield FunctionCommand(still_locked, (), {})  # _begin may have recorded nothing
    yield from commands
    yield StringCommand("systemctl", "daemon-reload")


def _executing() -> bool:
    state = ctx_state.get()
    return state is not None and state.is_executing


def _changed(ops: list[OperationMeta]) -> bool:
    """Does one of `ops` change the host: will_change while planning, did_change once it ran. (pyinfra's
    `_if=any_changed(...)` is checked only while executing: every --dry would list a restart.)"""
    return any(op.did_change() if op.is_complete() else op.will_change for op in ops)


@operation(is_idempotent=False)
def running(
    spec: ServeSpec,
    *,
    ledger_path: str,
    changes: list[OperationMeta],
    pin: str | None,
    retry_failed: bool,
    start: bool = True,
    force: bool = False,
    replaces: str | None = None,
    model: ModelTarget | None = None,
    group: GroupRun | None = None,
) -> Commands:
    """Enable the service and (re)start it when needed. replaces: the service a renamed vllm_service replaces,
    disabled first since both would hold the same GPUs and port."""
    name = unit_name(spec.service)
    snap = snapshot()
    if not start:
        host.noop(f"{name} installed, not started: no GPU on this host (gpufleet_allow_no_gpu)")
        return
    if snap.running.need_daemon_reload:
        # A cut run wrote this unit.
        yield StringCommand("systemctl", "daemon-reload")
    if not snap.unit_enabled(name):
        yield StringCommand("systemctl", "enable", shlex.quote(name))
    drift = snap.running.drift()
    if drift and _executing():  # pyinfra runs this generator twice: say it once
        host.log_styled(f"{name} does not run what its unit says ({'; '.join(drift)}): restarting it", fg="yellow")
    ranks = group.others_restart(host.name) if group else []
    if ranks and not (_changed(changes) or drift or force) and _executing():
        host.log_styled(f"restarting {name} with its group: {'; '.join(ranks)}", fg="yellow")
    if _changed(changes) or drift or force or not snap.unit_active(name) or ranks:
        yield FunctionCommand(still_locked, (), {})
        yield FunctionCommand(_begin, (spec, ledger_path, pin, retry_failed, model), {})
        # The lock may be lost since: checked again on the host.
        restart = f"systemctl {'restart' if snap.unit_active(name) else 'start'} {shlex.quote(name)}"
        if replaces:
            restart = f"{{ systemctl disable --now {shlex.quote(unit_name(replaces))} || true; }} && {restart}"
        yield StringCommand(
            "sh",
            "-c",
            shlex.quote(
                while_held(
                    host,
                    restart,
                    f"{host.name}: not restarting {name}: this run no longer holds the host's lock (fix: run again)",
                )
            ),
        )
    elif snap.unit_enabled(name):
        host.noop(f"{name} is active and nothing it runs changed")


# (state, host, soak seconds) -> False when it could not finish (gpufleet.vllm.verify).
Verify = Callable[[State, Host, float], bool]
# The commit or rollback after the verdict.
AfterVerify = Callable[[State, Host], bool]


def serves_expected(snap: HostSnapshot, expected: Expected) -> bool:
    """Did the snapshot's probe find the expected server ready?"""
    if snap.health_code != "200" or snap.served_models is None:
        return False
    if not snap.cache_config:
        expected = replace(expected, cache_config={})
    return not identity_problems(expected, snap.served_models, snap.cache_config)


@operation(is_idempotent=False)
def ready(
    spec: ServeSpec,
    *,
    verify: Verify,
    roll_back: AfterVerify,
    changes: list[OperationMeta],
    start: bool = True,
    soak_s: float = 0.0,
    force: bool = False,
    group: GroupRun | None = None,
    serves: bool | None = None,
) -> Commands:
    """Verify the service, with a soak after a (re)start, and roll back at once when that fails."""
    snap = snapshot()
    if not start:
        host.noop("no GPU: the service is not started, nothing to verify")
        return
    restarted = (
        force
        or _changed(changes)
        or bool(snap.running.drift())
        or not snap.unit_active(unit_name(spec.service))
        or bool(group and group.others_restart(host.name))
    )
    if not restarted and (serves if serves is not None else serves_expected(snap, Expected.from_spec(spec))):
        host.noop(f"ready: /health 200, /v1/models serves {spec.served_model_name}")
        return
    yield FunctionCommand(verify, (soak_s if restarted else 0.0,), {})
    yield FunctionCommand(roll_back, (), {})


@operation(is_idempotent=False)
def committed(verified: OperationMeta, commit: AfterVerify) -> Commands:
    """Commit the version the `verified` ready operation passed (call with _if=<its verdict>)."""
    if not _changed([verified]):
        host.noop("nothing was restarted or verified: nothing to commit")
        return
    if _executing() and host_run().ledger.pending is None:
        host.noop("verified a restart of the committed version: nothing new to commit")
        return
    yield FunctionCommand(commit, (), {})


@operation(is_idempotent=False)
def settled(decision: Resume, ledger_path: str, roll_back: Callable[[State, Host, str], bool]) -> Commands:
    """Settle what a cut run left pending before anything else changes."""
    if isinstance(decision, Nothing):
        host.noop("no change left pending by a cut run")
    elif isinstance(decision, FinishPending):
        what = "restarting and verifying it" if decision.restart else "verifying it"
        if _executing():  # say it once
            host.log_styled(f"{decision.reason}: {what}", fg="yellow")
        host.noop(f"{decision.reason}: {what}")
    elif isinstance(decision, DropPending):
        yield FunctionCommand(_drop, (ledger_path, decision.reason), {})
    else:
        yield FunctionCommand(roll_back, (decision.reason,), {})


def _drop(state: State, host: Host, path: str, reason: str) -> bool:
    host.log_styled(f"{reason}: dropping it", fg="yellow")
    ledger = host_run(host).ledger
    return save_ledger(host, path, drop_pending(ledger)) if ledger.pending is not None else True
