"""The rollback of a renamed vllm_service whose new version failed verification (gpufleet.vllm.commit.roll_back):
the failure is marked in the old service's ledger (the one a later run of either name reads) first, then the old
service's unit goes back and restarts, the new service's unit is disabled and removed, and the new service's own
files go. A rollback that renames nothing writes its own ledger and removes nothing."""

from __future__ import annotations

import shlex
from types import SimpleNamespace
from typing import Any

import pytest

from gpufleet import hostlock
from gpufleet.health import HealthReport, HealthState
from gpufleet.hoststate.atomic import atomic_write_command
from gpufleet.hoststate.ledger import Committed, Ledger, Version, begin, parse
from gpufleet.hoststate.paths import committed_unit, ledger_path, unit_backup
from gpufleet.operations.run import host_run, remember
from gpufleet.remote.transport import ContainerInfo
from gpufleet.units import unit_path
from gpufleet.vllm import commit, verify, weights
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.layout import model_dir
from gpufleet.vllm.settings import build_spec

TAG = "reg:5000/vllm/vllm-openai:good"
GOOD = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64
DIES = "reg:5000/vllm/vllm-openai@sha256:" + "2" * 64
OLD, NEW = "vllm-qwen35", "vllm-renamed"


class RunState:
    """Stands for pyinfra's State: the host memos are kept per state (weakly)."""


class RollbackHost:
    """What the rollback uses of a pyinfra Host: every command succeeds and is kept, with the uploads, in order."""

    name, data, connector = "gpu1", {"ssh_user": "root"}, None

    def __init__(self) -> None:
        self.state = RunState()
        self.done: list[tuple[str, Any]] = []  # ("run", command) or ("put", (path, text))
        self.said: list[str] = []

    def run_shell_command(self, command: str, **_: Any):
        self.done.append(("run", str(command)))
        made = ["/tmp/tmp.private"] if str(command).endswith("mktemp -d") else []  # upload()'s private dir
        return True, SimpleNamespace(stdout_lines=made, stderr_lines=[])

    def put_file(self, src: Any, dest: str, **_: Any) -> bool:
        self.done.append(("put", (dest, src.getvalue())))
        return True

    def log_styled(self, message: str, **_: Any) -> None:
        self.said.append(message)

    def commands(self) -> list[str]:
        return [what for kind, what in self.done if kind == "run"]

    def ledger_written(self) -> tuple[int, str, Ledger]:
        """(where in `done`, the ledger's path, its content) of the one ledger the rollback wrote."""
        # The upload goes to a private temp dir; the root command after it renames its copy over the ledger.
        [(at, path, text)] = [
            (i, self.done[i + 1][1].rpartition('mv -fT "$tmp" ')[2].split(";")[0], what[1])
            for i, (kind, what) in enumerate(self.done)
            if kind == "put" and ".json; " in self.done[i + 1][1]
        ]
        text = text.decode() if isinstance(text, bytes) else text
        return at, path, parse(text)


SERVING_GOOD = ContainerInfo("c0ffee", "running", image=GOOD, spec_hash="0123456789abcdef")


def rolled_back(
    monkeypatch: pytest.MonkeyPatch,
    service: str,
    port: int = 5000,
    mark: bool = True,
    answers: ContainerInfo | None = SERVING_GOOD,
    model: str | None = None,
) -> tuple[RollbackHost, Ledger]:
    """A host whose committed version is OLD's on port 5000 (its model's commit `model`) and whose pending one
    (`service` on `port`, the dies digest) failed: the rollback run with `answers` (the committed version, by
    default) ready again."""
    monkeypatch.setattr(verify, "transport_from_pyinfra_host", lambda host: None)
    monkeypatch.setattr(
        commit, "poll_ready", lambda *_, **__: HealthReport(HealthState.READY, "ready", container=answers)
    )
    spec = build_spec("gpu1", {"vllm_image": TAG, "vllm_service": service, "vllm_port": port})
    committed = Version(
        image=TAG, ref=GOOD, unit_sha256="a" * 64, spec_hash="0123456789abcdef", service=OLD, port=5000, model=model
    )
    pending = Version(
        image=TAG,
        ref=DIES,
        unit_sha256="b" * 64,
        spec_hash=spec.spec_hash,
        service=service,
        port=port,
        model=model and model[:-40] + "f" * 40,
    )
    ledger = begin(Ledger(committed=Committed(committed, "t0", "t0")), pending, "ops@laptop pid 7", "t1")
    host = RollbackHost()
    remember(host, HostSnapshot()).ledger = ledger
    v = verify.Verification(spec, 5.0, None, ledger_path(service), "qwen35")
    assert commit.roll_back(host, v, ledger, "dead: exited 1", mark=mark) is False  # the host failed either way
    return host, ledger


def test_a_rename_going_back_marks_the_old_ledger_and_leaves_nothing_of_the_new_service(monkeypatch):
    host, before = rolled_back(monkeypatch, NEW)
    [(restored_at, restore)] = [
        (i, shlex.split(what)[-1])
        for i, (kind, what) in enumerate(host.done)
        if kind == "run" and "systemctl restart" in what
    ]  # sh -c '<the restore>'
    # reset-failed: a new unit whose engine died is not left listed as failed once it is gone.
    # The committed unit's copy is the one its ledger names by checksum (the old place for a ledger from before);
    # it goes back only if it is that unit, written atomically.
    assert restore.startswith(
        f'b={committed_unit(OLD, "a" * 64)}; [ -e "$b" ] || b={unit_backup(OLD)} && '
        f'echo "{"a" * 64}  $b" | sha256sum -c --status && '
    )
    assert (
        f"systemctl disable --now {NEW}.service; rm -f {unit_path(NEW)}; systemctl reset-failed {NEW}.service "
        f'2>/dev/null; true; }} && sh -c {shlex.quote(atomic_write_command(unit_path(OLD)))} < "$b" '
        f"&& systemctl daemon-reload && systemctl enable {OLD}.service && systemctl restart "
        f"{OLD}.service"
    ) in restore
    at, path, written = host.ledger_written()
    assert path == ledger_path(OLD)
    assert written.committed == before.committed and written.pending is None
    assert before.pending is not None
    assert [(f.ref, f.spec_hash) for f in written.failed] == [(DIES, before.pending.version.spec_hash)]
    # The new service's ledger (its pending record), secrets and flag note go, after the mark is written: a run cut
    # before that finds the pending record and settles it again.
    removed = [(i, what) for i, (kind, what) in enumerate(host.done) if kind == "run" and what.startswith("rm -f ")]
    assert removed == [
        (removed[0][0], f"rm -f {ledger_path(NEW)} /etc/gpufleet/{NEW}.env /var/lib/gpufleet/{NEW}.flags-accepted")
    ]
    assert removed[0][0] > at
    # The mark comes before the unit goes back: a run cut in between does not try the failed version again.
    assert at < restored_at


def test_a_rollback_that_renames_nothing_writes_its_own_ledger_and_removes_nothing(monkeypatch):
    host, before = rolled_back(monkeypatch, OLD, port=5001)  # a port change that failed
    assert not [what for what in host.commands() if "disable" in what or "gpufleet-kept" in what]
    at, path, written = host.ledger_written()
    assert at < next(i for i, (kind, what) in enumerate(host.done) if kind == "run" and "systemctl restart" in what)
    assert path == ledger_path(OLD)
    assert written.committed == before.committed and written.pending is None and written.failed[-1].ref == DIES
    assert not [what for what in host.commands() if what.startswith("rm -f ")]


def test_a_rollback_puts_the_committed_commits_model_files_back_before_its_restart(monkeypatch):
    model = f"org/model@{'c' * 40}"
    host, _ = rolled_back(monkeypatch, OLD, model=model)
    [restore] = [shlex.split(what)[-1] for what in host.commands() if "systemctl restart" in what]
    put_back = weights.restore_command(model_dir(build_spec("gpu1", {"vllm_image": TAG})), model)
    assert put_back in restore and restore.index(put_back) < restore.index("systemctl restart")


class FailingCopyHost(RollbackHost):
    """A host whose disk is full: the copy of the unit fails."""

    def run_shell_command(self, command: str, **_: Any):
        self.done.append(("run", str(command)))
        ok = "sha256sum -c" not in command
        return ok, SimpleNamespace(stdout_lines=[], stderr_lines=[] if ok else ["No space left on device"])


def committing(host: RollbackHost) -> tuple[verify.Verification, Ledger]:
    spec = build_spec("gpu1", {"vllm_image": TAG, "vllm_service": OLD})
    committed = Version(image=TAG, ref=GOOD, unit_sha256="a" * 64, spec_hash="0123456789abcdef", service=OLD, port=5000)
    pending = Version(image=TAG, ref=DIES, unit_sha256="b" * 64, spec_hash=spec.spec_hash, service=OLD, port=5000)
    ledger = begin(Ledger(committed=Committed(committed, "t0", "t0")), pending, "ops@laptop pid 7", "t1")
    remember(host, HostSnapshot()).ledger = ledger
    return verify.Verification(spec, 5.0, None, ledger_path(OLD), "qwen35"), ledger


def test_a_commit_keeps_a_checked_copy_named_by_the_ledger_first_and_prunes_old_copies_only_after():
    host = RollbackHost()
    v, _ = committing(host)
    assert commit.commit_pending(host, v, "t2") is True
    copy = committed_unit(OLD, "b" * 64)
    [(copied_at, copied)] = [
        (i, what) for i, (kind, what) in enumerate(host.done) if kind == "run" and copy in what and "sha256sum" in what
    ]
    # Written atomically from the unit on disk, then checked against the checksum the ledger will name.
    assert copied == (
        f"sh -c {shlex.quote(atomic_write_command(copy))} < {unit_path(OLD)} && "
        f"echo {shlex.quote('b' * 64 + '  ' + copy)} | sha256sum -c --status"
    )
    at, path, written = host.ledger_written()
    assert path == ledger_path(OLD) and written.committed is not None
    assert written.committed.version.unit_sha256 == "b" * 64
    [(pruned_at, pruned)] = [(i, what) for i, (kind, what) in enumerate(host.done) if kind == "run" and "find " in what]
    assert copied_at < at < pruned_at
    assert f"! -name {OLD}-{'b' * 64}.service -delete" in pruned and f"rm -f {unit_backup(OLD)}" in pruned
    assert weights.drop_kept_command(model_dir(v.spec)) in pruned  # the model files a rollback would have put back


def test_a_copy_that_fails_commits_nothing_and_prunes_nothing():
    host = FailingCopyHost()
    v, before = committing(host)
    assert commit.commit_pending(host, v, "t2") is False
    assert [kind for kind, _ in host.done] == ["run"]  # the copy, and nothing after it
    assert host_run(host).ledger == before  # still pending: the next run verifies it again


class LostLock:
    """A run lock whose lease ran out while the run was stalled: another run may hold the host now."""

    def check(self) -> None:
        raise hostlock.LockLost("gpu1: this run's lock on the host is gone (its lease of 90 s ran out)")


def test_a_run_that_lost_the_hosts_lock_writes_no_ledger(monkeypatch):
    host = RollbackHost()
    v, before = committing(host)
    host_run(host).lock = LostLock()  # type: ignore[assignment]  # what check_lock calls of a HostLock
    assert commit.commit_pending(host, v, "t2") is False
    assert [kind for kind, _ in host.done if kind == "put"] == []  # no ledger upload
    assert host_run(host).ledger == before


def test_a_rollback_is_judged_by_the_container_that_answers_not_by_its_mark(monkeypatch):
    # The unit went back, but what answers afterwards is the failed digest (its restart never took over): the mark
    # is on disk (written first), and the host's line says the rollback did not bring the committed version back.
    failed_one = ContainerInfo("dead00", "running", image=DIES, spec_hash="0123456789abcdef")
    host, _ = rolled_back(monkeypatch, OLD, answers=failed_one)
    [line] = [said for said in host.said if said.startswith("gpu1: ")]
    assert f"the rollback to {GOOD} did not bring it back (the container answering runs {DIES}, not {GOOD}" in line
    assert "which is ready" not in line
    _, _, written = host.ledger_written()
    assert written.failed[-1].ref == DIES  # the version is still what failed


def test_a_version_that_lost_its_port_to_another_process_is_not_marked_failed(monkeypatch):
    host, before = rolled_back(monkeypatch, OLD, mark=False)
    at, path, written = host.ledger_written()
    # One ledger write, after the restore: the pending record dropped, no failure mark.
    assert path == ledger_path(OLD) and written.failed == () and written.pending is None
    assert written.committed == before.committed
    assert at > next(i for i, (kind, what) in enumerate(host.done) if kind == "run" and "systemctl restart" in what)
    assert any("not marked failed: another process held the port" in said for said in host.said)
