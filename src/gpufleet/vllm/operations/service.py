"""The vLLM systemd service: secrets file, unit (running the pinned digest), enabled, (re)started, verified,
committed or rolled back. How a cut run is settled and a failed version rolled back: docs/crash-safety.md.
"""

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


def secret_values(settings: VllmSettings) -> dict[str, str | None]:
    """env var -> value of every secret the env file carries (None: unset)."""
    return {"VLLM_API_KEY": settings.api_key, "HF_TOKEN": settings.hf_token, **settings.secret_env}


def hidden_secrets(settings: VllmSettings) -> dict[str, Hidden | None]:
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
    yield FunctionCommand(still_locked, (), {})  # at execution time: a run that lost the host writes nothing
    yield from commands


def target_version(spec: ServeSpec, host: Host, pin: str | None, model: ModelTarget | None = None) -> Version:
    """The version this run installs, while executing (the digest may only be known after the pull; before it,
    `pin`; the model's commit likewise after its check)."""
    ref = target_ref(pin, host) or spec.image
    at = target_model(model, host)
    return Version(image=spec.image, ref=ref, unit_sha256=sha256(render_unit(spec, ref, at)),
                   spec_hash=spec.spec_hash, service=spec.service, port=spec.port, model=at,
                   model_revision=model.revision if model and at else None,
                   group=spec.group.version(ref, at) if spec.group else None)


def save_ledger(host: Host, path: str, ledger: Ledger) -> bool:
    """Write the host's ledger (atomically) and keep it as this run's view of it; only while this run holds the
    host's lock (a run stalled past its lease must not overwrite the record of the run that holds the host now).
    Checked twice: from here before the write, and on the host in the write's own command (the lock file still
    names this run, and the ledger file is still what this run read or last wrote: compare-and-swap)."""
    if not still_locked(host.state, host):
        return fail(host, f"{host.name}: {path} not written: this run no longer holds the host (fix: run again)")
    held = host_run(host)
    content = render(ledger)
    guards = [test for test in (still_held_test(host), _unchanged_test(path, held.ledger_sha256))
              if test is not None]
    written = write_file(host, path, content, only_if=" && ".join(guards) if guards else None)
    if written is None:
        return fail(host, f"{host.name}: {path} not written: another run holds the host now or changed it since "
                          "this run read it (fix: run again; it reads the host anew)")
    if not written:
        return fail(host, f"{host.name}: could not write {path} (fix: check free space and permissions there)")
    held.ledger, held.ledger_sha256[path] = ledger, sha256(content)
    return True


def _unchanged_test(path: str, read: Mapping[str, str | None]) -> str | None:
    """A shell test: the file's sha256 is what this run read or last wrote (no file: still none). None: not read."""
    if path not in read:
        return None
    now = f"$(sha256sum < {shlex.quote(path)} 2>/dev/null | cut -c1-64)"
    return f'[ "{now}" = "{read[path] or ""}" ]'



def _begin(state: State, host: Host, spec: ServeSpec, path: str, pin: str | None, retry: bool,
           model: ModelTarget | None = None) -> bool:
    """Record the target as pending before the unit changes or the service restarts: a run cut after this point is
    finished or rolled back by the next one (ledger.resume). Nothing to record when the target is what is pending
    already, or the committed version itself (a restart of what was verified). retry: gpufleet_retry_failed (the
    target's failure marks are cleared first)."""
    target, ledger = target_version(spec, host, pin, model), host_run(host).ledger
    if ledger.pending is not None and ledger.pending.version == target:
        return True
    if ledger.pending is None and ledger.committed is not None and ledger.committed.version == target:
        return True
    if ledger.pending is not None:
        # A cut run's version this run does not install: it was never verified, the committed one stays the target.
        ledger = drop_pending(ledger)
    if retry:
        ledger = retry_failed(ledger, target)
    refused = refused_target(ledger, target)
    if refused:
        # The digest is known only now (a tag resolved by this run's pull): refused here instead of at preflight.
        return fail(host, f"{host.name}: {refused}")
    return save_ledger(host, path, begin(ledger, target, hostlock.Holder.this_process().operator(), now_utc()))


def _backup_commands(spec: ServeSpec) -> Commands:
    """Keep a copy of the committed unit to roll back to, for a ledger migrated from the old format (no copy was
    made at its commit): the unit that was serving, as before."""
    committed = host_run().ledger.committed
    if committed is None or committed.version.unit_sha256 is not None:
        return  # none to go back to, or its copy was made when it was committed (gpufleet.vllm.commit)
    snap = snapshot()
    if snap.unit_active(unit_name(spec.service)) and snap.health_code == "200" and snap.file_sha256.get(
            unit_path(spec.service)):
        yield StringCommand("install", "-D", "-m", "644", shlex.quote(unit_path(spec.service)),
                            shlex.quote(unit_backup(spec.service)))


@operation()
def unit(spec: ServeSpec, path: str, ledger_path: str, pin: str | None, retry_failed: bool,
         model: ModelTarget | None = None) -> Commands:
    """Install the systemd unit that runs the pinned image (resolved by this run's pull, else `pin`) and names the
    model's commit; the ledger names it pending first (retry_failed: gpufleet_retry_failed, a failed version's marks
    cleared)."""
    ref = target_ref(pin)
    # Before the pin exists (cold host, or a new vllm_image) the unit will change; while executing, the image
    # operation has resolved the digest and the real text is rendered.
    text = render_unit(spec, ref or spec.image, target_model(model))
    commands = list(put_content(path, text))
    if not commands:
        host.noop(f"{path} runs {ref}")
        return
    yield from _backup_commands(spec)
    yield FunctionCommand(_begin, (spec, ledger_path, pin, retry_failed, model), {})
    yield FunctionCommand(still_locked, (), {})  # _begin may have had nothing to record: checked here either way
    yield from commands
    yield StringCommand("systemctl", "daemon-reload")


def _executing() -> bool:
    state = ctx_state.get()
    return state is not None and state.is_executing


def _changed(ops: list[OperationMeta]) -> bool:
    """Does one of `ops` change the host: will_change while planning (what --dry shows), did_change once it ran
    (while executing: a unit planned before the pull may turn out unchanged). pyinfra's own OperationMeta.changed is
    exactly this, but marked deprecated (removed in v4). Its `_if=any_changed(...)` (pyinfra.operations.util) does
    not fit the callers: pyinfra checks _if only while executing, so a plan would list the restart on every host
    (a converged host's --dry would show a change), and _if only ANDs its conditions, while a restart also follows
    from what the snapshot shows (drift, an inactive unit, a cut run's version)."""
    return any(op.did_change() if op.is_complete() else op.will_change for op in ops)


@operation(is_idempotent=False)
def running(spec: ServeSpec, ledger_path: str, changes: list[OperationMeta], pin: str | None, retry_failed: bool,
            start: bool = True, force: bool = False, replaces: str | None = None,
            model: ModelTarget | None = None, group: GroupRun | None = None) -> Commands:
    """Enable the vLLM service and (re)start it when its unit, secrets or image changed, when what runs is not what
    the unit on disk says (snapshot's RunningService.drift: the file checksums alone cannot see that), or when a cut
    run's version is to be finished (force). replaces: the service a renamed vllm_service replaces, stopped and
    disabled first (both would hold the same GPUs and port: a reboot during the new one's soak must not start both);
    the verify step removes it once the new one is committed, and a rollback enables it again. group: a replica
    group's ranks restart together."""
    name = unit_name(spec.service)
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
    ranks = group.others_restart(host.name) if group else []
    if ranks and not (_changed(changes) or drift or force) and _executing():
        host.log_styled(f"restarting {name} with its group: {'; '.join(ranks)}", fg="yellow")
    if _changed(changes) or drift or force or not snap.unit_active(name) or ranks:
        yield FunctionCommand(still_locked, (), {})
        yield FunctionCommand(_begin, (spec, ledger_path, pin, retry_failed, model), {})
        # Checked on the host in the restart's own shell too: a lock lost since the check above refuses it there.
        restart = f"systemctl {'restart' if snap.unit_active(name) else 'start'} {shlex.quote(name)}"
        if replaces:
            restart = f"{{ systemctl disable --now {shlex.quote(unit_name(replaces))} || true; }} && {restart}"
        yield StringCommand("sh", "-c", shlex.quote(while_held(
            host, restart, f"{host.name}: not restarting {name}: this run no longer holds the host's lock (fix: run "
                           "again)")))
    elif snap.unit_enabled(name):
        host.noop(f"{name} is active and nothing it runs changed")


# The deploy's verify step, run while executing: (state, host, soak seconds) -> False only when it could not finish.
# It keeps its verdict for the rollback after it and for committed (gpufleet.vllm.verify).
Verify = Callable[[State, Host, float], bool]
# What follows the verdict, run while executing: (state, host) -> success (the commit; the rollback of a failed
# version always fails the host).
AfterVerify = Callable[[State, Host], bool]


def serves_expected(snap: HostSnapshot, expected: Expected) -> bool:
    """Did the snapshot's probe find the expected server ready? The same identity check() holds a server to,
    on what the probe could see: /v1/models always, the cache config when /metrics reported it."""
    if snap.health_code != "200" or snap.served_models is None:
        return False
    if not snap.cache_config:
        expected = replace(expected, cache_config={})
    return not identity_problems(expected, snap.served_models, snap.cache_config)


@operation(is_idempotent=False)
def ready(spec: ServeSpec, verify: Verify, roll_back: AfterVerify, changes: list[OperationMeta], start: bool = True,
          soak_s: float = 0.0, force: bool = False, group: GroupRun | None = None, serves: bool | None = None
          ) -> Commands:
    """Verify the vLLM service serves what its spec says; after a (re)start (or with force: a cut run's version to
    finish), verify with a soak of soak_s, and when that fails roll back at once (roll_back: the committed version
    back, the host failed on one line). The commit is the next operation's (committed): it may wait for the other
    hosts' verify, a rollback must not (pyinfra runs each operation on every host before the next one starts).
    group: a replica group's ranks are verified together (through the head: `serves` says whether it serves)."""
    snap = snapshot()
    if not start:
        host.noop("no GPU: the service is not started, nothing to verify")
        return
    restarted = (force or _changed(changes) or bool(snap.running.drift())
                 or not snap.unit_active(unit_name(spec.service)) or bool(group and group.others_restart(host.name)))
    if not restarted and (serves if serves is not None else serves_expected(snap, Expected.from_spec(spec))):
        host.noop(f"ready: /health 200, /v1/models serves {spec.served_model_name}")
        return
    yield FunctionCommand(verify, (soak_s if restarted else 0.0,), {})
    yield FunctionCommand(roll_back, (), {})


@operation(is_idempotent=False)
def committed(verified: OperationMeta, commit: AfterVerify) -> Commands:
    """Commit the version the verify passed (call with _if=<its passed verdict>): the ledger names it committed and
    its unit is kept as the next rollback target. verified: the ready operation; nothing to commit when it verified
    nothing, or (known while executing) when nothing is pending: a restart of the committed version itself."""
    if not _changed([verified]):
        host.noop("nothing was restarted or verified: nothing to commit")
        return
    if _executing() and host_run().ledger.pending is None:
        host.noop("verified a restart of the committed version: nothing new to commit")
        return
    yield FunctionCommand(commit, (), {})


@operation(is_idempotent=False)
def settled(decision: Resume, ledger_path: str, roll_back: Callable[[State, Host, str], bool]) -> Commands:
    """Settle what a cut run left pending (ledger.resume's decision) before anything else changes: drop a change
    that never reached the unit, or roll back to the committed version (roll_back: the verify step's). A version to
    finish is restarted, verified and committed by the steps after this one."""
    if isinstance(decision, Nothing):
        host.noop("no change left pending by a cut run")
    elif isinstance(decision, FinishPending):
        what = "restarting and verifying it" if decision.restart else "verifying it"
        if _executing():  # said once (pyinfra runs this generator to plan, and again to execute)
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
