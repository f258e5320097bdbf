"""Commit the verified pending version, or roll back to the committed one. Design: docs/crash-safety.md."""

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
    """Each host's preflight GPU verdict, for the swap's ledger entry."""


def record_gpu(host: Host, summary: str) -> None:
    run_context(host.state).slot(GpuAtSwap, GpuAtSwap)[host.name] = summary


def gpu_at_swap(host: Host) -> str | None:
    return run_context(host.state).slot(GpuAtSwap, GpuAtSwap).get(host.name)


class Verified(Protocol):
    """What the commit and rollback read of gpufleet.vllm.verify.Verification."""

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
    """Also stops, disables and removes a service the pending version renamed."""
    ledger = host_run(host).ledger
    if ledger.pending is None:
        return True  # a restart of the committed version: nothing to commit
    service, unit_sha256 = v.spec.service, ledger.pending.version.unit_sha256
    before = ledger.committed.version.service if ledger.committed else None
    sudo = use_sudo(host)
    if unit_sha256 is None:  # refuse rather than guess
        return fail(
            host,
            f"{host.name}: the pending record names no unit checksum: not committed (fix: converge "
            "again: the run writes a new pending record)",
        )
    # A run that lost the host writes nothing.
    try:
        check_lock(host)
    except hostlock.LockLost:
        return fail(
            host, f"{host.name}: {v.ledger_path} not written: this run no longer holds the host (fix: run again)"
        )
    # Checked before the commit names it, so a cut here changes nothing.
    copy = committed_unit(service, unit_sha256)
    ok, output = host.run_shell_command(
        guarded(
            f"sh -c {shlex.quote(atomic_write_command(copy))} < {shlex.quote(unit_path(service))} && "
            f"echo {shlex.quote(unit_sha256 + '  ' + copy)} | sha256sum -c --status",
            still_held_test(host),
        ),
        _sudo=sudo,
    )
    if not ok and REFUSED in output.stdout_lines:
        return fail(host, f"{host.name}: {v.ledger_path} not written: another run holds the host now (fix: run again)")
    if not ok:
        return fail(
            host,
            f"{host.name}: could not keep a copy of the verified unit at {copy}: "
            f"{' | '.join(output.stderr_lines) or 'it is not the unit the ledger names'} (fix: check "
            f"the free space of {UNITS_DIR}, then converge again)",
        )
    if not save_ledger(host, v.ledger_path, ledger_commit(ledger, now_utc(), ready_at, speed, gpu=gpu_at_swap(host))):
        return False
    # Only with the commit on disk may old unit copies and the kept model files go.
    ok, output = host.run_shell_command(
        f"find {shlex.quote(UNITS_DIR)} -maxdepth 1 -name {shlex.quote(service + '-*.service')} "
        f"! -name {shlex.quote(posixpath.basename(copy))} -delete; rm -f {shlex.quote(unit_backup(service))}; "
        f"{weights.drop_kept_command(model_dir(v.spec))}",
        _sudo=sudo,
    )
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
            _sudo=sudo,
        )
        if not ok:
            return fail(
                host,
                f"{host.name}: {service} is committed, but removing the replaced {old} failed: "
                f"{' | '.join(output.stderr_lines[-3:])} (fix: `systemctl disable --now {old}`)",
            )
        host.log_styled(f"{old} replaced by {unit_name(service)}: stopped, disabled and removed")
    host.log_styled(f"committed {ledger.pending.version.ref}")
    return True


def runs_problem(version: Version, container: ContainerInfo | None, what: str) -> str | None:
    """One line naming what answers instead of `version`; `what` says who put it there."""
    if container is None or not container.running:
        return f"no running container of {version.service or 'the service'} answered"
    if container.image != version.ref:
        return f"the container answering runs {container.image}, not {version.ref}, which {what}"
    if version.spec_hash and container.spec_hash != version.spec_hash:
        return (
            f"the container answering has spec {container.spec_hash or 'unlabelled'}, not {version.spec_hash}, "
            f"which {what}"
        )
    return None


def roll_back(
    host: Host, v: Verified, ledger: Ledger, failed_detail: str, check: str | None = None, *, mark: bool = True
) -> bool:
    """Restore the committed version, marking the pending one failed unless mark=False. Always False; one line
    names both digests."""
    assert ledger.pending is not None and ledger.committed is not None
    spec, pending, committed = v.spec, ledger.pending.version, ledger.committed.version
    service = committed.service or spec.service
    unit = unit_path(service)
    backup = committed_unit(service, committed.unit_sha256) if committed.unit_sha256 else unit_backup(service)
    what = f"new image {pending.ref}" if pending.ref != committed.ref else f"new settings (same image {pending.ref})"
    failed = f"{what} failed verification ({failed_detail})"
    try:
        check_lock(host)
    except hostlock.LockLost as lost:
        return fail(host, f"{host.name}: {failed}; not rolled back: {lost}")
    # Marked first, in the committed service's ledger: a cut run never tries the version again.
    if mark and not save_ledger(
        host,
        ledger_path(service),
        ledger_roll_back(ledger, failed_detail, now_utc(), check=check, gpu=gpu_at_swap(host)),
    ):
        return False
    host.log_styled(f"rolling back to {committed.ref}")
    steps = []
    if committed.unit_sha256:
        # Only a copy with the committed checksum goes back (older ledgers: unit_backup).
        steps.append(f'b={shlex.quote(backup)}; [ -e "$b" ] || b={shlex.quote(unit_backup(service))}')
        steps.append(f'echo "{committed.unit_sha256}  $b" | sha256sum -c --status')
        source = '"$b"'
    else:
        source = shlex.quote(backup)
    renamed = service != spec.service
    if renamed:
        # One vLLM container runs; reset-failed clears the new unit's failed listing.
        new = shlex.quote(unit_name(spec.service))
        steps.append(
            f"{{ systemctl disable --now {new}; rm -f {shlex.quote(unit_path(spec.service))}; "
            f"systemctl reset-failed {new} 2>/dev/null; true; }}"
        )
    if committed.model:
        steps.append(weights.restore_command(model_dir(spec), committed.model))
    steps += [
        f"sh -c {shlex.quote(atomic_write_command(unit))} < {source}",
        "systemctl daemon-reload",
        f"systemctl enable {shlex.quote(unit_name(service))}",
        f"systemctl restart {shlex.quote(unit_name(service))}",
    ]
    restore = while_held(
        host,
        " && ".join(steps),
        f"{host.name}: not rolled back: this run no longer holds the host's lock (fix: run again)",
    )
    ok, output = host.run_shell_command(f"sh -c {shlex.quote(restore)}", _sudo=use_sudo(host))
    if not ok:
        return fail(
            host,
            f"{host.name}: {failed}; the rollback to {committed.ref} failed too: "
            f"{' | '.join(output.stderr_lines[-3:]) or 'no copy of the committed unit at ' + backup} "
            f"(fix: `systemctl status {service}`; {backup} holds the unit that was committed)",
        )
    if renamed:
        # After the mark, so a cut run still finds the record.
        left = (v.ledger_path, env_file_path(spec.service), accepted_file(spec.service))
        ok, output = host.run_shell_command(
            f"rm -f {' '.join(shlex.quote(path) for path in left)}", _sudo=use_sudo(host)
        )
        if not ok:
            host.log_styled(f"could not remove {', '.join(left)}: {' | '.join(output.stderr_lines[-3:])}", fg="yellow")
    # What it served before, on its own port; the ledger keeps no address.
    previous = Expected(
        service=service, port=committed.port or spec.port, served_model_name=v.served_before, address=spec.reach_address
    )
    again = poll_ready(v.check_once(host, previous), v.timeout_s, exited=service_exited(host, service))
    # Judged by what answers, not by the mark.
    runs = runs_problem(committed, again.container, "the rollback put back") if again.ready else None
    if not again.ready or runs:
        why = runs or f"{again.state}: {again.detail}"
        return fail(
            host,
            f"{host.name}: {failed}; the rollback to {committed.ref} did not bring it back ({why}) "
            f"(fix: `journalctl -u {service}`; {backup} holds the unit that was committed)",
        )
    if not mark:
        if not save_ledger(host, ledger_path(service), drop_pending(ledger)):
            return False
        return fail(
            host,
            f"{host.name}: {failed}; rolled back to {committed.ref}, which is ready; the new version is "
            "not marked failed: another process held the port (fix: stop what holds it, then converge "
            "again)",
        )
    fix = (
        f"set vllm_image back to {committed.image} or to an image that accepts these settings"
        if pending.ref != committed.ref and committed.image != pending.image
        else "revert the settings or the image changed in this run"
    )
    # Names the host itself: it reads the same in a summary or a grep.
    logger.error(
        f"{host.name}: {failed}; rolled back to {committed.ref}, which is ready (fix: {fix}, then converge "
        f"again; {RETRY_SETTING}=true tries the failed version again on purpose)"
    )
    return False
