"""The ledger's state machine (gpufleet.hoststate.ledger): transitions, today's format migrated, corrupt files refused with
their reason, the don't-retry rule, and the atomic-write command run for real with sh."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpufleet.hoststate import ledger as L
from gpufleet.hoststate.atomic import atomic_write_command
from gpufleet.hoststate.ledger import (
    Committed,
    CorruptLedger,
    DropPending,
    Failed,
    FinishPending,
    Ledger,
    LedgerStateError,
    Nothing,
    Observed,
    Pending,
    RollBackPending,
    Version,
)  # fmt: skip
from gpufleet.wire.speed import SpeedFigures

OLD_REF = "vllm/vllm-openai@sha256:" + "1" * 64
NEW_REF = "vllm/vllm-openai@sha256:" + "2" * 64
OLD = Version(
    image="vllm/vllm-openai:v0.11.0",
    ref=OLD_REF,
    unit_sha256="a" * 64,
    spec_hash="aaaaaaaaaaaaaaaa",
    service="vllm",
    port=8000,
)
NEW = Version(
    image="vllm/vllm-openai:nightly",
    ref=NEW_REF,
    unit_sha256="b" * 64,
    spec_hash="bbbbbbbbbbbbbbbb",
    service="vllm",
    port=8001,
)
OPERATOR = "ops@laptop pid 4242"
T0, T1, T2 = "2026-12-01T03:00:00Z", "2026-12-01T03:05:00Z", "2026-12-01T03:35:00Z"

COMMITTED_OLD = Ledger(committed=Committed(OLD, T0))


def pending_new() -> Ledger:
    return L.begin(COMMITTED_OLD, NEW, OPERATOR, T1)


# ---- transitions -----------------------------------------------------------------------------------------------


def test_begin_records_the_target_before_any_restart_and_keeps_the_committed_version():
    got = pending_new()
    assert got.pending == Pending(NEW, started_at=T1, operator=OPERATOR)
    assert got.committed == COMMITTED_OLD.committed


def test_begin_refuses_while_a_cut_change_is_unsettled():
    with pytest.raises(LedgerStateError, match="a pending change from ops@laptop pid 4242 is not settled yet"):
        L.begin(pending_new(), OLD, "other@desk pid 1", T2)


def test_commit_makes_the_pending_version_the_rollback_target_and_keeps_the_old_one_in_history():
    got = L.commit(pending_new(), T2)
    assert got == Ledger(committed=Committed(NEW, T2), pending=None, failed=(), history=(Committed(OLD, T0),))


def test_committing_the_same_version_again_adds_no_history():
    again = L.commit(L.begin(COMMITTED_OLD, OLD, OPERATOR, T1), T2)
    assert again.committed == Committed(OLD, T2) and again.history == ()


def test_history_is_bounded():
    ledger = COMMITTED_OLD
    for i in range(L.HISTORY_LIMIT + 5):
        ledger = L.commit(L.begin(ledger, replace(NEW, spec_hash=f"{i:016x}"), OPERATOR, T1), f"t{i}")
    assert len(ledger.history) == L.HISTORY_LIMIT
    assert ledger.history[-1].committed_at == f"t{L.HISTORY_LIMIT + 3}"  # newest kept, oldest dropped


def test_roll_back_marks_the_pending_version_failed_and_keeps_the_committed_one():
    got = L.roll_back(pending_new(), "died during the soak:\nexit 137", T2)
    assert got.committed == COMMITTED_OLD.committed and got.pending is None
    assert got.failed == (Failed(NEW_REF, "bbbbbbbbbbbbbbbb", "died during the soak:\\nexit 137", T2, NEW.image),)
    # Failing again replaces the mark instead of piling up copies.
    twice = L.roll_back(L.begin(L.retry_failed(got, NEW), NEW, OPERATOR, T2), "never ready", "t3")
    assert twice.failed == (Failed(NEW_REF, "bbbbbbbbbbbbbbbb", "never ready", "t3", NEW.image),)


def test_commit_clears_the_failure_mark_of_the_version_it_commits():
    failed = L.roll_back(pending_new(), "never ready", T2)
    retried = L.commit(L.begin(L.retry_failed(failed, NEW), NEW, OPERATOR, "t3"), "t4")
    assert retried.failed == () and retried.committed == Committed(NEW, "t4")


@pytest.mark.parametrize(
    "transition", [lambda ledger: L.commit(ledger, T2), lambda ledger: L.roll_back(ledger, "x", T2), L.drop_pending]
)
def test_settling_needs_a_pending_change(transition):
    with pytest.raises(LedgerStateError, match=r"^nothing pending to "):
        transition(COMMITTED_OLD)


def test_drop_pending_forgets_a_change_that_never_reached_the_host():
    assert L.drop_pending(pending_new()) == COMMITTED_OLD


# ---- the don't-retry rule --------------------------------------------------------------------------------------


def test_a_failed_version_is_refused_until_its_settings_change_or_the_retry_setting_clears_it():
    failed = L.roll_back(pending_new(), "never ready within 900 s", T2)
    assert L.refused_target(failed, NEW) == (
        f"{NEW_REF} with spec bbbbbbbbbbbbbbbb failed at {T2}: never ready within 900 s (fix: change vllm_image or "
        "a setting, or pass --data gpufleet_retry_failed=true to one converge to try it again on purpose)"
    )
    assert L.refused_target(failed, replace(NEW, spec_hash="cccccccccccccccc")) is None  # a setting changed
    assert L.refused_target(failed, OLD) is None
    assert L.refused_target(L.retry_failed(failed, NEW), NEW) is None
    assert L.retry_failed(failed, NEW).committed == failed.committed


# ---- a run that finds a pending record -------------------------------------------------------------------------


def observed(version: Version | None, unit: Version | None, active: bool = True, restarts: int = 0) -> Observed:
    return Observed(
        unit_sha256=unit.unit_sha256 if unit else None,
        running_ref=version.ref if version else None,
        running_spec_hash=version.spec_hash if version else None,
        active=active,
        restarts=restarts,
    )


def test_resume_without_a_pending_change_does_nothing():
    assert L.resume(COMMITTED_OLD, observed(OLD, OLD)) == Nothing("no pending change")


def test_resume_restarts_a_unit_uploaded_but_never_restarted():
    # Cut between the unit upload and the restart: the old container still runs under the new unit file.
    got = L.resume(pending_new(), observed(OLD, NEW))
    assert isinstance(got, FinishPending) and got.restart and got.pending.version == NEW
    assert got.reason == f"cut change by {OPERATOR} since {T1}: the new unit is installed but not running"


def test_resume_verifies_a_new_version_that_runs_but_was_never_verified():
    got = L.resume(pending_new(), observed(NEW, NEW))
    assert isinstance(got, FinishPending) and not got.restart


def test_resume_rolls_back_a_new_version_that_keeps_dying():
    # Cut during the soak of an image that dies: systemd restarts it in a loop.
    got = L.resume(pending_new(), observed(NEW, NEW, restarts=4))
    assert got == RollBackPending(
        pending_new().pending,
        COMMITTED_OLD.committed,
        f"{NEW_REF} restarted 4 times after a cut change by {OPERATOR} since {T1}",
    )


def test_resume_drops_a_change_that_never_reached_the_unit():
    got = L.resume(pending_new(), observed(OLD, OLD))
    assert isinstance(got, DropPending)


def test_resume_rolls_back_when_the_unit_is_neither_version():
    stranger = replace(OLD, unit_sha256="c" * 64)
    got = L.resume(pending_new(), observed(None, stranger, active=False))
    assert isinstance(got, RollBackPending) and got.committed == COMMITTED_OLD.committed
    assert got.reason.endswith("the unit on the host is neither the pending nor the committed version's")


def test_resume_of_a_first_install_can_only_go_forward():
    first = L.begin(Ledger(), NEW, OPERATOR, T1)
    got = L.resume(first, observed(None, None, active=False))
    assert isinstance(got, FinishPending) and got.restart


# ---- text: render, parse, migrate ------------------------------------------------------------------------------


def test_render_is_stable_and_parses_back():
    ledger = L.roll_back(L.begin(L.commit(pending_new(), T2), OLD, OPERATOR, "t3"), "never ready", "t4")
    text = L.render(ledger)
    assert L.parse(text) == ledger
    assert L.render(L.parse(text)) == text
    doc = json.loads(text)
    assert list(doc) == sorted(doc) and text.endswith("}\n")
    assert doc["committed"] == {
        "committed_at": T2,
        "image": NEW.image,
        "port": 8001,
        "ref": NEW_REF,
        "service": "vllm",
        "spec_hash": "bbbbbbbbbbbbbbbb",
        "unit_sha256": "b" * 64,
        "ready_at": None,
    }


def test_render_of_a_pending_change_names_its_operator():
    doc = json.loads(L.render(pending_new()))
    assert doc["schema"] == 2
    assert doc["pending"]["operator"] == OPERATOR and doc["pending"]["started_at"] == T1
    assert doc["pending"]["unit_sha256"] == "b" * 64 and doc["pending"]["port"] == 8001


# What the deploy writes today (operations/image.py's record() then rolled_back(), json.dumps(indent=2)): v0.11.0
# pinned, then nightly pinned, failed its soak and was rolled back.
TODAY_AFTER_ROLLBACK = """{
  "current": {
    "image": "vllm/vllm-openai:v0.11.0",
    "ref": "vllm/vllm-openai@sha256:1111111111111111111111111111111111111111111111111111111111111111",
    "pinned_at": "2026-11-20T10:00:00Z"
  },
  "previous": null,
  "history": [
    {
      "image": "vllm/vllm-openai:v0.11.0",
      "ref": "vllm/vllm-openai@sha256:1111111111111111111111111111111111111111111111111111111111111111",
      "pinned_at": "2026-11-20T10:00:00Z"
    },
    {
      "image": "vllm/vllm-openai:nightly",
      "ref": "vllm/vllm-openai@sha256:2222222222222222222222222222222222222222222222222222222222222222",
      "pinned_at": "2026-11-28T09:00:00Z",
      "failed": "the service died during the 1800 s soak",
      "failed_at": "2026-11-28T09:31:00Z"
    }
  ]
}
"""

TODAY_TWO_PINS = """{
  "current": {
    "image": "vllm/vllm-openai:nightly",
    "ref": "vllm/vllm-openai@sha256:2222222222222222222222222222222222222222222222222222222222222222",
    "pinned_at": "2026-11-28T09:00:00Z"
  },
  "previous": {
    "image": "vllm/vllm-openai:v0.11.0",
    "ref": "vllm/vllm-openai@sha256:1111111111111111111111111111111111111111111111111111111111111111",
    "pinned_at": "2026-11-20T10:00:00Z"
  },
  "history": [
    {
      "image": "vllm/vllm-openai:v0.11.0",
      "ref": "vllm/vllm-openai@sha256:1111111111111111111111111111111111111111111111111111111111111111",
      "pinned_at": "2026-11-20T10:00:00Z"
    },
    {
      "image": "vllm/vllm-openai:nightly",
      "ref": "vllm/vllm-openai@sha256:2222222222222222222222222222222222222222222222222222222222222222",
      "pinned_at": "2026-11-28T09:00:00Z"
    }
  ]
}
"""


def old_version(image: str, ref: str) -> Version:
    return Version(image=image, ref=ref, unit_sha256=None, spec_hash=None, service=None, port=None)


def test_todays_ledger_after_a_rollback_migrates_with_its_failure_mark():
    got = L.parse(TODAY_AFTER_ROLLBACK)
    assert got == Ledger(
        committed=Committed(old_version("vllm/vllm-openai:v0.11.0", OLD_REF), "2026-11-20T10:00:00Z"),
        pending=None,
        failed=(Failed(NEW_REF, None, "the service died during the 1800 s soak", "2026-11-28T09:31:00Z",
                       "vllm/vllm-openai:nightly"),),
        history=(),
    )  # fmt: skip
    # The old format did not record settings: the mark holds the digest whatever the spec, until retried.
    assert L.refused_target(got, NEW) is not None
    assert L.refused_target(L.retry_failed(got, NEW), NEW) is None
    # Migrated once: the new format round-trips.
    assert L.parse(L.render(got)) == got


def test_todays_ledger_after_two_pins_keeps_the_earlier_one_in_history():
    got = L.parse(TODAY_TWO_PINS)
    assert got.committed == Committed(old_version("vllm/vllm-openai:nightly", NEW_REF), "2026-11-28T09:00:00Z")
    assert got.history == (Committed(old_version("vllm/vllm-openai:v0.11.0", OLD_REF), "2026-11-20T10:00:00Z"),)
    assert got.failed == () and got.pending is None
    # The first commit in the new format fills in what the old one did not know.
    assert L.commit(L.begin(got, NEW, OPERATOR, T1), T2).committed == Committed(NEW, T2)


def test_a_first_install_of_todays_format_has_no_current():
    assert L.parse('{"current": null, "previous": null, "history": []}') == Ledger()


VALID = json.loads(L.render(pending_new()))


def broken(**changes: object) -> str:
    return json.dumps({**VALID, **changes})


@pytest.mark.parametrize(("text", "reason"), [
    ("", "empty file"),
    ("  \n", "empty file"),
    (L.render(pending_new())[:120], "not JSON: Expecting ',' delimiter: line 5 column 17 (char 120)"),
    ('{"current": {"image": "a", ', "not JSON: Expecting property name enclosed in double quotes: line 1 column 28 "
                                    "(char 27)"),
    ("[]", "not a JSON object but a list"),
    ('"vllm"', "not a JSON object but a string"),
    ("null", "not a JSON object but null"),
    ("{}", "neither a 'schema' nor a 'current' key"),
    (broken(schema=3), "schema: 3 is not 2 (a newer gpufleet wrote it?)"),
    (broken(committed=[]), "committed: expected an object, got a list"),
    (broken(committed={**VALID["committed"], "port": "8000"}), "committed.port: expected an integer or null, got a "
                                                               "string"),
    (broken(committed={**VALID["committed"], "port": True}), "committed.port: expected an integer or null, got a "
                                                             "boolean"),
    (broken(committed={**VALID["committed"], "ref": "vllm/vllm-openai:nightly"}),
     "committed.ref: 'vllm/vllm-openai:nightly' is not a digest ref (repo@sha256:<64 hex digits>)"),
    (broken(committed={**VALID["committed"], "ref": "x@sha256:abc"}),
     "committed.ref: 'x@sha256:abc' is not a digest ref (repo@sha256:<64 hex digits>)"),
    (broken(committed={**VALID["committed"], "ref": "x;rm -rf /@sha256:" + "a" * 64}),
     f"committed.ref: 'x;rm -rf /@sha256:{'a' * 64}' is not a digest ref (repo@sha256:<64 hex digits>)"),
    # Fields root turns into paths and ports: what gpufleet never writes is refused before anything is touched.
    (broken(committed={**VALID["committed"], "service": "../../../etc/cron.d/x"}),
     "committed.service: '../../../etc/cron.d/x' is not a service name (letters, digits, '-', '_', '.')"),
    (broken(pending={**VALID["pending"], "service": "vllm/x"}),
     "pending.service: 'vllm/x' is not a service name (letters, digits, '-', '_', '.')"),
    (broken(committed={**VALID["committed"], "port": 0}), "committed.port: 0 is not a TCP port (1-65535)"),
    (broken(committed={**VALID["committed"], "port": 70000}), "committed.port: 70000 is not a TCP port (1-65535)"),
    (broken(pending={**VALID["pending"], "operator": None}), "pending.operator: expected a string, got null"),
    (broken(failed={}), "ledger.failed: expected a list, got an object"),
    (broken(failed=[{"ref": NEW_REF}]), "failed[0].spec_hash: missing"),
    (broken(history=[{"image": "x"}]), "history[0].ref: missing"),
    ('{"current": {"image": "a", "pinned_at": "t"}}', "current.ref: missing"),
    ('{"current": "vllm/vllm-openai:v0.11.0"}', "current: expected an object, got a string"),
    ('{"current": null, "history": [{"image": "a", "ref": "a@sha256:' + "1" * 64 + '", "pinned_at": 5}]}',
     "history[0].pinned_at: expected a string, got a number"),
])  # fmt: skip
def test_a_corrupt_ledger_gives_its_one_line_reason(text, reason):
    with pytest.raises(CorruptLedger) as err:
        L.parse(text)
    assert str(err.value) == reason


def test_a_corrupt_ledger_is_a_refusal_naming_host_file_and_fix():
    with pytest.raises(CorruptLedger) as err:
        L.parse("[]")
    assert L.corrupt_refusal("gft1", "/var/lib/gpufleet/vllm.json", err.value) == (
        "gft1: /var/lib/gpufleet/vllm.json is corrupt: not a JSON object but a list (fix: repair it by hand, or move it "
        "away to start a new ledger: the next converge then resolves vllm_image again and the rollback history is "
        "lost)"
    )


# ---- atomic writes, run for real -------------------------------------------------------------------------------


def sh(command: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["sh", "-c", command], input=stdin, capture_output=True, timeout=30)


def owner() -> str:
    return f"{os.getuid()}:{os.getgid()}"


def test_atomic_write_from_stdin_creates_the_directory_and_sets_the_mode(tmp_path: Path):
    path = tmp_path / "state" / "vllm.json"
    done = sh(atomic_write_command(str(path), mode="0600", owner=owner()), b'{"schema": 2}\n')
    assert done.returncode == 0, done.stderr
    assert path.read_bytes() == b'{"schema": 2}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(path.parent) == ["vllm.json"]  # no temp file left


def test_atomic_write_from_an_uploaded_file_replaces_and_removes_the_upload(tmp_path: Path):
    path, upload = tmp_path / "vllm.service", tmp_path / "upload.tmp"
    path.write_text("old\n")
    upload.write_text('[Unit]\nDescription=it\'s "quoted" $HOME\n')
    done = sh(atomic_write_command(str(path), owner=owner(), source=str(upload)))
    assert done.returncode == 0, done.stderr
    assert path.read_text() == '[Unit]\nDescription=it\'s "quoted" $HOME\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["vllm.service"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path):
    path = tmp_path / "daemon.json"
    path.write_text("old\n")
    done = sh(atomic_write_command(str(path), owner=owner(), source=str(tmp_path / "missing upload")))
    assert done.returncode != 0
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["daemon.json"]


def test_atomic_write_quotes_a_path_with_shell_characters(tmp_path: Path):
    path = tmp_path / "a dir; touch pwned" / "it's $x.json"
    done = sh(atomic_write_command(str(path), owner=owner()), b"ok\n")
    assert done.returncode == 0, done.stderr
    assert path.read_text() == "ok\n"
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def read_while_written(path: Path, write: str, versions: list[bytes], rounds: int) -> set[bytes]:
    """Everything a reader saw in `path` while `write` (a shell command reading stdin) replaced it `rounds` times."""
    seen: set[bytes] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                seen.add(path.read_bytes())
            time.sleep(0)  # under gevent (the CLI's patch_all) the reader is a greenlet: let the writer's wait run

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(rounds):
            done = sh(write, versions[i % len(versions)])
            assert done.returncode == 0, done.stderr
    finally:
        stop.set()
        thread.join()
    return seen


def test_a_concurrent_reader_never_sees_a_partial_file(tmp_path: Path):
    path = tmp_path / "vllm.json"
    versions = [b"A" * 1_000_000, b"B" * 600_000]
    path.write_bytes(versions[1])
    # The check can fail: a writer that is not atomic is caught by the same reader.
    torn = read_while_written(path, f"cat > {path}", versions, rounds=6)
    assert torn - set(versions), "the reader never saw a partial write from a plain `cat >`: the check is blind"
    seen = read_while_written(path, atomic_write_command(str(path), owner=owner()), versions, rounds=12)
    assert seen <= set(versions) and len(seen) == 2


def test_ready_at_is_kept_on_the_committed_record_and_optional_when_reading():
    got = L.commit(pending_new(), T2, ready_at=T1)
    assert got.committed == Committed(NEW, T2, ready_at=T1) and L.parse(L.render(got)) == got
    doc = json.loads(L.render(got))
    del doc["committed"]["ready_at"], doc["failed"]  # a file written before ready_at (and before failed's image)
    doc["failed"] = [{"ref": NEW_REF, "spec_hash": None, "reason": "r", "failed_at": T0}]
    again = L.parse(json.dumps(doc))
    assert again.committed == Committed(NEW, T2) and again.failed == (Failed(NEW_REF, None, "r", T0),)


def test_pin_is_the_digest_a_tag_stands_for_pending_then_committed_then_the_one_that_failed():
    assert L.pin(Ledger(), NEW.image) is None
    assert L.pin(COMMITTED_OLD, OLD.image) == OLD_REF and L.pin(COMMITTED_OLD, NEW.image) is None
    assert L.pin(pending_new(), NEW.image) == NEW_REF
    failed = L.roll_back(pending_new(), "dead", T2)
    # The tag that failed keeps naming the digest that failed: refused_target refuses it instead of a new resolve.
    assert L.pin(failed, NEW.image) == NEW_REF and L.refused_target(failed, NEW) is not None
    assert L.pin(failed, OLD.image) == OLD_REF


# ---- a replica group's rank: the group's version, an optional field ----------------------------------------------


def test_a_ranks_version_names_its_group_and_a_ledger_without_the_field_parses_as_before():
    rank = replace(NEW, group="pair@0123456789abcdef")
    text = L.render(L.commit(L.begin(COMMITTED_OLD, rank, OPERATOR, T1), T2))
    assert json.loads(text)["committed"]["group"] == "pair@0123456789abcdef"
    assert L.parse(text).committed == Committed(rank, T2)
    # A replica of its own writes no "group" key (its file is byte for byte what it was), and reads None back.
    plain = L.render(COMMITTED_OLD)
    assert '"group"' not in plain and L.parse(plain).committed == COMMITTED_OLD.committed
    # The group's version is part of the version: another one is another version.
    assert replace(rank, group="pair@ffffffffffffffff") != rank


def test_a_group_version_that_is_not_text_is_corrupt():
    doc = json.loads(L.render(Ledger(committed=Committed(replace(NEW, group="pair@1"), T0))))
    doc["committed"]["group"] = 7
    with pytest.raises(CorruptLedger, match=r"committed\.group: expected a string or null, got a number"):
        L.parse(json.dumps(doc))


# ---- the model's commit beside the image digest ----------------------------------------------------------------

MODEL_AT = "gpufleet-sandbox/Qwen3.5-tiny@" + "c" * 40


def test_the_models_commit_is_recorded_and_parses_back():
    with_model = replace(NEW, model=MODEL_AT, model_revision="main")
    text = L.render(L.commit(L.begin(COMMITTED_OLD, with_model, OPERATOR, T1), T2))
    assert json.loads(text)["committed"]["model"] == MODEL_AT
    assert L.parse(text).committed == Committed(with_model, T2)


def test_a_ledger_written_before_the_model_field_parses_without_it():
    text = L.render(COMMITTED_OLD)
    assert "model" not in json.loads(text)["committed"]
    assert L.parse(text).committed == Committed(OLD, T0)
    assert L.model_pin(L.parse(text), "gpufleet-sandbox/Qwen3.5-tiny", None) is None


def test_a_bad_model_field_is_refused_with_its_place():
    doc = json.loads(L.render(COMMITTED_OLD))
    doc["committed"]["model"] = "tiny@main"
    with pytest.raises(CorruptLedger, match=r"committed\.model: 'tiny@main' is not <org>/<name>@<40 hex commit>"):
        L.parse(json.dumps(doc))


def test_model_pin_keeps_the_commit_until_the_repo_or_revision_setting_changes():
    ledger = Ledger(committed=Committed(replace(OLD, model=MODEL_AT, model_revision="main"), T0))
    assert L.model_pin(ledger, "gpufleet-sandbox/Qwen3.5-tiny", "main") == MODEL_AT
    assert L.model_pin(ledger, "gpufleet-sandbox/Qwen3.5-tiny", "v2") is None
    assert L.model_pin(ledger, "gpufleet-sandbox/other", "main") is None
    cut = L.begin(
        ledger, replace(NEW, model="gpufleet-sandbox/Qwen3.5-tiny@" + "d" * 40, model_revision="main"), OPERATOR, T1
    )
    assert L.model_pin(cut, "gpufleet-sandbox/Qwen3.5-tiny", "main") == "gpufleet-sandbox/Qwen3.5-tiny@" + "d" * 40


# ---- speed figures, kept with a committed version ---------------------------------------------------------------
FIGURES = SpeedFigures(
    (30000.0, 31000.0, 29000.0),
    (0.05, 0.06, 0.04),
    (200.0, 201.0, 199.0),
    (380.0, 390.0, 370.0),
    prompt_tokens=20480,
    decode_tokens=64,
    concurrency=2,
)


def test_a_commit_keeps_its_speed_figures_and_history_keeps_them_after_the_next_commit():
    ledger = L.commit(pending_new(), T2, speed=FIGURES)
    assert ledger.committed.speed == FIGURES
    assert L.parse(L.render(ledger)) == ledger
    later = L.commit(L.begin(ledger, OLD, OPERATOR, "t3"), "t4")
    assert later.history[-1].speed == FIGURES and later.committed.speed is None
    assert json.loads(L.render(later))["history"][-1]["speed"]["prompt_tokens"] == 20480


def test_a_ledger_without_speed_figures_parses_and_renders_as_before():
    ledger = L.commit(pending_new(), T2)
    text = L.render(ledger)
    assert "speed" not in text  # a ledger an older gpufleet wrote reads the same, and is written back unchanged
    assert L.parse(text) == ledger and L.parse(text).committed.speed is None


@pytest.mark.parametrize(("speed", "reason"), [
    ([], "committed.speed: speed figures must be an object, not list"),
    ({**FIGURES.as_dict(), "decode_tokens": 0}, "committed.speed: speed figures' decode_tokens is 0, not a positive "
                                                "integer"),
    ({**FIGURES.as_dict(), "cached_ttft_s": [0.1, -1]}, "committed.speed: speed figure cached_ttft_s is [0.1, -1], "
                                                        "not a list of positive numbers"),
])  # fmt: skip
def test_speed_figures_gpufleet_did_not_write_make_the_ledger_corrupt(speed, reason):
    doc = json.loads(L.render(L.commit(pending_new(), T2, speed=FIGURES)))
    with pytest.raises(CorruptLedger) as err:
        L.parse(json.dumps({**doc, "committed": {**doc["committed"], "speed": speed}}))
    assert str(err.value) == reason


# ---- the GPU verdict at each swap: an optional field --------------------------------------------------------------
def test_a_swap_records_the_gpu_verdict_on_what_it_commits_or_marks_failed_and_history_keeps_it():
    degraded = "degraded (GPU 0: clocks_event_reasons.hw_thermal_slowdown)"
    committed = L.commit(pending_new(), T2, gpu="ok")
    assert committed.committed == Committed(NEW, T2, gpu="ok")
    later = L.commit(L.begin(committed, OLD, OPERATOR, T2), T2, gpu=degraded)
    assert later.history[-1].gpu == "ok" and later.committed.gpu == degraded
    failed = L.roll_back(pending_new(), "died", T2, gpu="needs GPU reset (GPU 1: remapped_rows.pending=Yes)")
    assert failed.failed[-1].gpu == "needs GPU reset (GPU 1: remapped_rows.pending=Yes)"
    for ledger in (committed, later, failed):
        assert L.parse(L.render(ledger)) == ledger
    assert '"gpu": "ok"' in L.render(committed)


def test_a_ledger_written_before_the_gpu_field_parses_and_renders_byte_for_byte():
    before = L.render(L.roll_back(L.begin(L.commit(pending_new(), T2), OLD, OPERATOR, T2), "died", T2))
    assert '"gpu"' not in before
    parsed = L.parse(before)
    assert parsed.committed.gpu is None and parsed.failed[-1].gpu is None and parsed.history[-1].gpu is None
    assert L.render(parsed) == before


def test_a_gpu_field_that_is_not_text_is_a_corrupt_ledger():
    doc = json.loads(L.render(L.commit(pending_new(), T2, gpu="ok")))
    doc["committed"]["gpu"] = 3
    with pytest.raises(CorruptLedger, match=r"committed\.gpu: expected a string or null, got a number"):
        L.parse(json.dumps(doc))


M0, M1 = f"org/model@{'0' * 40}", f"org/model@{'1' * 40}"


def test_a_model_move_that_failed_refuses_that_model_not_the_committed_version():
    """Same digest and settings, a new commit of the model: its failure must not refuse the version it was rolled
    back to, which a plain converge keeps installing."""
    committed = Ledger(committed=Committed(replace(OLD, model=M0), T0))
    failed = L.roll_back(L.begin(committed, replace(OLD, model=M1), OPERATOR, T1), "never ready", T2)
    assert failed.failed[-1].model == M1
    assert L.refused_target(failed, replace(OLD, model=M0)) is None
    assert L.refused_target(failed, replace(OLD, model=M1)) == (
        f"{OLD_REF} with spec aaaaaaaaaaaaaaaa and model {M1} failed at {T2}: never ready (fix: change vllm_image or "
        "a setting, or pass --data gpufleet_retry_failed=true to one converge to try it again on purpose)"
    )
    assert L.refused_target(failed, OLD) is not None  # the model not known before the run: refused, as before
    assert L.parse(L.render(failed)) == failed


def test_a_failure_mark_from_before_models_refuses_the_digest_with_any_model():
    text = L.render(L.roll_back(pending_new(), "never ready", T2))
    assert '"model"' not in text  # a mark without one renders as before
    assert L.refused_target(L.parse(text), replace(NEW, model=M1)) is not None


def test_a_failure_marks_model_that_gpufleet_did_not_write_makes_the_ledger_corrupt():
    doc = json.loads(L.render(L.roll_back(pending_new(), "never ready", T2)))
    doc["failed"][0]["model"] = "../../etc@x"
    with pytest.raises(CorruptLedger, match=r"failed\[0\]\.model: .* is not <org>/<name>@<40 hex commit>"):
        L.parse(json.dumps(doc))
