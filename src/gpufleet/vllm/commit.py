"""A verify's verdict applied to the host: the pending version committed, or rolled back to the committed one with
the pending one marked failed. gpufleet.vllm.verify decides which."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Callable
from typing import Protocol

from pyinfra import logger
from pyinfra.api import Host

from gpufleet import hostlock
from gpufleet.defaults import RETRY_SETTING
from gpufleet.health import HealthReport, poll_ready
from gpufleet.hoststate.atomic import atomic_write_command
from gpufleet.hoststate.ledger import Ledger, Version, drop_pending
from gpufleet.hoststate.ledger import commit as ledger_commit
from gpufleet.hoststate.ledger import roll_back as ledger_roll_back
from gpufleet.hoststate.paths import UNITS_DIR, committed_unit, ledger_path, unit_backup
from gpufleet.operations.base import fail
from gpufleet.operations.files import REFUSED, guarded
from gpufleet.operations.run import check_lock, host_run, run_context, still_held_test, while_held
from gpufleet.remote.ssh import use_sudo
from gpufleet.remote.transport import ContainerInfo
from gpufleet.units import unit_name, unit_path
from gpufleet.vllm import weights
from gpufleet.vllm.layout import model_dir
from gpufleet.vllm.operations.flagcheck import accepted_file
from gpufleet.vllm.operations.image import now_utc, pull_stats_file
from gpufleet.vllm.operations.service import save_ledger
from gpufleet.vllm.service_watch import service_exited
from gpufleet.vllm.spec import ServeSpec
from gpufleet.vllm.unit import env_file_path
from gpufleet.wire.identity import Expected
from gpufleet.wire.speed import SpeedFigures


class GpuAtSwap(dict[str, str]):
    """Each host's GPU verdict as this run's preflight read it, for the swap's ledger entry (a run context slot)."""


def record_gpu(host: Host, summary: str) -> None:
    run_context(host.state).slot(GpuAtSwap, GpuAtSwap)[host.name] = summary


def gpu_at_swap(host: Host) -> str | None:
    return run_context(host.state).slot(GpuAtSwap, GpuAtSwap).get(host.name)


class Verified(Protocol):
    """What the commit and the rollback read of the host's verify step (gpufleet.vllm.verify.Verification)."""

    @property
    def spec(self) -> ServeSpec: ...
    @property
    def ledger_path(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def served_before(self) -> str: ...
    def check_once(self, host: Host, expected: Expected) -> Callable[[], HealthReport]: ...


def commit_pending(host: Host, v: Verified, ready_at: str, speed: SpeedFigures | None = None) -> bool:
    """The pending version becomes the committed one; a service it renamed is stopped, disabled and removed."""
    ledger = host_run(host).ledger
    if ledger.pending is None:
        return True  # a restart of the committed version (drift, secrets): verified, nothing new to commit
    service, unit_sha256 = v.spec.service, ledger.pending.version.unit_sha256
    before = ledger.committed.version.service if ledger.committed else None
    sudo = use_sudo(host)
    if unit_sha256 is None:  # every pending record since unit checksums has one; refuse rather than guess
        return fail(host, f"{host.name}: the pending record names no unit checksum: not committed (fix: converge "
                          "again: the run writes a new pending record)")
    # Nothing is written by a run that lost the host (its lease ran out while it stalled): checked from here, and on
    # the host in the copy's own command, as every ledger write is (operations.service.save_ledger).
    try:
        check_lock(host)
    except hostlock.LockLost:
        return fail(host, f"{host.name}: {v.ledger_path} not written: this run no longer holds the host (fix: run "
                          "again)")
    # The copy is written (atomically, synced) and checked against the ledger's checksum before the commit names it:
    # a cut or a full disk here leaves the committed version and its own copy as they were.
    copy = committed_unit(service, unit_sha256)
    ok, output = host.run_shell_command(guarded(
        f"sh -c {shlex.quote(atomic_write_command(copy))} < {shlex.quote(unit_path(service))} && "
        f"echo {shlex.quote(unit_sha256 + '  ' + copy)} | sha256sum -c --status", still_held_test(host)),
        _sudo=sudo)
    if not ok and REFUSED in output.stdout_lines:
        return fail(host, f"{host.name}: {v.ledger_path} not written: another run holds the host now (fix: run again)")
    if not ok:
        return fail(host, f"{host.name}: could not keep a copy of the verified unit at {copy}: "
                          f"{' | '.join(output.stderr_lines) or 'it is not the unit the ledger names'} (fix: check "
                          f"the free space of {UNITS_DIR}, then converge again)")
    if not save_ledger(host, v.ledger_path, ledger_commit(ledger, now_utc(), ready_at, speed, gpu=gpu_at_swap(host))):
        return False
    # Only now, with the commit on disk, may copies of units no longer committed go, and the model files kept for
    # a rollback.
    ok, output = host.run_shell_command(
        f"find {shlex.quote(UNITS_DIR)} -maxdepth 1 -name {shlex.quote(service + '-*.service')} "
        f"! -name {shlex.quote(posixpath.basename(copy))} -delete; rm -f {shlex.quote(unit_backup(service))}; "
        f"{weights.drop_kept_command(model_dir(v.spec))}", _sudo=sudo)
    if not ok:
        host.log_styled(f"could not prune old unit copies: {' | '.join(output.stderr_lines[-2:])}", fg="yellow")
    if before and before != service:
        old = unit_name(before)
        ok, output = host.run_shell_command(
            f"systemctl disable --now {shlex.quote(old)}; systemctl reset-failed {shlex.quote(old)} 2>/dev/null; "
            f"rm -f {shlex.quote(unit_path(before))} "
            f"{shlex.quote(unit_backup(before))} {shlex.quote(UNITS_DIR)}/{shlex.quote(before + '-')}*.service "
            f"{shlex.quote(ledger_path(before))} "
            f"{shlex.quote(env_file_path(before))} {shlex.quote(accepted_file(before))} "
            f"{shlex.quote(pull_stats_file(before))} && systemctl daemon-reload",
            _sudo=sudo)
        if not ok:
            return fail(host, f"{host.name}: {service} is committed, but removing the replaced {old} failed: "
                              f"{' | '.join(output.stderr_lines[-3:])} (fix: `systemctl disable --now {old}`)")
        host.log_styled(f"{old} replaced by {unit_name(service)}: stopped, disabled and removed")
    host.log_styled(f"committed {ledger.pending.version.ref}")
    return True


def runs_problem(version: Version, container: ContainerInfo | None, what: str) -> str | None:
    """One line when what answers is not `version` (its digest, its spec label), naming what runs instead; `what`
    says who put the version there."""
    if container is None or not container.running:
        return f"no running container of {version.service or 'the service'} answered"
    if container.image != version.ref:
        return f"the container answering runs {container.image}, not {version.ref}, which {what}"
    if version.spec_hash and container.spec_hash != version.spec_hash:
        return (f"the container answering has spec {container.spec_hash or 'unlabelled'}, not {version.spec_hash}, "
                f"which {what}")
    return None


def roll_back(host: Host, v: Verified, ledger: Ledger, failed_detail: str, check: str | None = None, *,
              mark: bool = True) -> bool:
    """Put the committed version's unit back, restart it, mark the pending version failed and wait until the
    committed one answers. Always False, with one line naming both digests. mark=False (the port was taken, the
    host's fault) marks nothing."""
    assert ledger.pending is not None and ledger.committed is not None
    spec, pending, committed = v.spec, ledger.pending.version, ledger.committed.version
    service = committed.service or spec.service
    unit = unit_path(service)
    backup = committed_unit(service, committed.unit_sha256) if committed.unit_sha256 else unit_backup(service)
    what = (f"new image {pending.ref}" if pending.ref != committed.ref
            else f"new settings (same image {pending.ref})")
    failed = f"{what} failed verification ({failed_detail})"
    try:
        check_lock(host)  # the rollback restarts too: never interleaved with another run's restart
    except hostlock.LockLost as lost:
        return fail(host, f"{host.name}: {failed}; not rolled back: {lost}")
    # The mark first: a run cut anywhere after this line finds the pending version failed (never to be tried again
    # by a re-run rollout) and the committed one to converge to (a plain converge puts its unit back). Marked in the
    # committed service's own ledger: a rename going back marks it there, where a later run of either name reads it.
    if mark and not save_ledger(host, ledger_path(service), ledger_roll_back(ledger, failed_detail, now_utc(),
                                                                          check=check, gpu=gpu_at_swap(host))):
        return False
    host.log_styled(f"rolling back to {committed.ref}")
    steps = []
    if committed.unit_sha256:
        # Only the committed unit goes back: a copy that is not it is refused, the host stays as it is. A ledger
        # committed before content-addressed copies kept its copy at the old place.
        steps.append(f"b={shlex.quote(backup)}; [ -e \"$b\" ] || b={shlex.quote(unit_backup(service))}")
        steps.append(f"echo \"{committed.unit_sha256}  $b\" | sha256sum -c --status")
        source = '"$b"'
    else:
        source = shlex.quote(backup)
    renamed = service != spec.service
    if renamed:
        # A rename going back: the new service's unit goes, so that one vLLM container runs. reset-failed: a unit
        # whose engine died before the stop stays listed as failed (`systemctl --failed`, monitoring) until cleared.
        new = shlex.quote(unit_name(spec.service))
        steps.append(f"{{ systemctl disable --now {new}; rm -f {shlex.quote(unit_path(spec.service))}; "
                     f"systemctl reset-failed {new} 2>/dev/null; true; }}")
    if committed.model:
        # Its own model files too, kept while the new commit was downloaded over them (gpufleet.vllm.weights).
        steps.append(weights.restore_command(model_dir(spec), committed.model))
    steps += [f"sh -c {shlex.quote(atomic_write_command(unit))} < {source}", "systemctl daemon-reload",
              f"systemctl enable {shlex.quote(unit_name(service))}",
              f"systemctl restart {shlex.quote(unit_name(service))}"]
    restore = while_held(host, " && ".join(steps), f"{host.name}: not rolled back: this run no longer holds the "
                                                    "host's lock (fix: run again)")
    ok, output = host.run_shell_command(f"sh -c {shlex.quote(restore)}", _sudo=use_sudo(host))
    if not ok:
        return fail(host, f"{host.name}: {failed}; the rollback to {committed.ref} failed too: "
                          f"{' | '.join(output.stderr_lines[-3:]) or 'no copy of the committed unit at ' + backup} "
                          f"(fix: `systemctl status {service}`; {backup} holds the unit that was committed)")
    if renamed:
        # The new service never committed anything: its ledger (the pending record, settled now), secrets and flag
        # check note go. Only after the mark is written: a run cut before it finds the pending record and settles it.
        left = (v.ledger_path, env_file_path(spec.service), accepted_file(spec.service))
        ok, output = host.run_shell_command(f"rm -f {' '.join(shlex.quote(path) for path in left)}",
                                            _sudo=use_sudo(host))
        if not ok:
            host.log_styled(f"could not remove {', '.join(left)}: {' | '.join(output.stderr_lines[-3:])}",
                            fg="yellow")
    # Held to what it served before this run, on its own port: not to the new settings' identity.
    # Reached where this run's spec publishes (the ledger keeps the committed version's port, not its address).
    previous = Expected(service=service, port=committed.port or spec.port, served_model_name=v.served_before,
                        address=spec.reach_address)
    again = poll_ready(v.check_once(host, previous), v.timeout_s, exited=service_exited(host, service))
    # Judged by what answers, not by the mark written before the restore.
    runs = runs_problem(committed, again.container, "the rollback put back") if again.ready else None
    if not again.ready or runs:
        why = runs or f"{again.state}: {again.detail}"
        return fail(host, f"{host.name}: {failed}; the rollback to {committed.ref} did not bring it back ({why}) "
                          f"(fix: `journalctl -u {service}`; {backup} holds the unit that was committed)")
    if not mark:
        if not save_ledger(host, ledger_path(service), drop_pending(ledger)):
            return False
        return fail(host, f"{host.name}: {failed}; rolled back to {committed.ref}, which is ready; the new version is "
                          "not marked failed: another process held the port (fix: stop what holds it, then converge "
                          "again)")
    fix = (f"set vllm_image back to {committed.image} or to an image that accepts these settings"
           if pending.ref != committed.ref and committed.image != pending.image
           else "revert the settings or the image changed in this run")
    # One line naming the host (not the "[host]" prefix): it reads the same in a summary or a grep of the log.
    logger.error(f"{host.name}: {failed}; rolled back to {committed.ref}, which is ready (fix: {fix}, then converge "
                 f"again; {RETRY_SETTING}=true tries the failed version again on purpose)")
    return False
