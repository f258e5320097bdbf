"""The one reader of a host's ledgers (gpufleet.hoststate.reader), its sections (gpufleet.hoststate.sections), and the
two that use it: the host snapshot's command and the rollout's read (gpufleet.rollout.ledgers). The reading's shell
runs here for real (sh, a state dir of the test's own); the deploy and the rollout must see the same ledger."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from gpufleet.hoststate import reader, sections
from gpufleet.hoststate.ledger import Committed, Ledger, Version, begin, render
from gpufleet.hoststate.rules import host_ledger
from gpufleet.rollout.ledgers import parse_read
from gpufleet.vllm.facts import parse_snapshot
from gpufleet.vllm.host_command import Paths, snapshot_command

REF = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64
NEW_REF = "reg:5000/vllm/vllm-openai@sha256:" + "2" * 64
PORT = 5000


def version(service: str, port: int = PORT, ref: str = REF) -> Version:
    return Version("reg:5000/vllm/vllm-openai:good", ref, "a" * 64, "0" * 16, service, port)


def committed(service: str, port: int = PORT) -> str:
    return render(Ledger(committed=Committed(version(service, port), "t0")))


def output(own: str | None, others: Mapping[str, str] | None = None) -> str:
    """What reader.read_command prints on a host with these files (own: the service's ledger; None: no file)."""
    lines = ["", sections.MARK + reader.OWN]
    if own is not None:
        lines += [reader.PRESENT, own.rstrip("\n")]
    lines += ["", sections.MARK + reader.OTHERS]
    for path, text in (others or {}).items():
        lines += ["", sections.MARK + reader.OTHER + path, text.rstrip("\n")]
    return "\n".join([*lines, "", sections.MARK + sections.END, ""])


def read_on(state: Path, service: str) -> subprocess.CompletedProcess[str]:
    """The reading's own command, run by a real shell over `state` as the host's state dir."""
    return subprocess.run(
        ["sh", "-c", reader.read_command(str(state / f"{service}.json"))],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


# --- the reading on a real shell --------------------------------------------------------------------------------
def test_the_reading_brings_back_the_services_ledger_and_every_other_ledger_by_path(tmp_path):
    (tmp_path / "vllm-qwen35.json").write_text(committed("vllm-qwen35").rstrip("\n"))  # as json.dump: no last newline
    (tmp_path / "old.json").write_text('{"schema": 2}\n')
    (tmp_path / "vllm-qwen35.pull").write_text("not a ledger\n")  # not *.json: not read
    ran = read_on(tmp_path, "vllm-qwen35")
    assert ran.returncode == 0, ran.stderr
    texts = reader.read_output(ran.stdout.splitlines())
    assert texts.own == committed("vllm-qwen35")
    assert texts.others == {str(tmp_path / "old.json"): '{"schema": 2}\n'}


def test_no_file_is_none_an_empty_file_is_text_and_an_empty_state_dir_has_no_others(tmp_path):
    ran = read_on(tmp_path / "absent", "vllm-qwen35")  # not even the directory
    assert ran.returncode == 0 and reader.read_output(ran.stdout.splitlines()) == reader.LedgerTexts(None, {})
    (tmp_path / "vllm-qwen35.json").write_text("")
    texts = reader.read_output(read_on(tmp_path, "vllm-qwen35").stdout.splitlines())
    assert texts.own == "\n" and texts.others == {}  # an empty file: corrupt, not absent


def test_an_output_cut_short_or_with_a_section_twice_is_not_read():
    whole = output(committed("a"), {"/var/lib/gpufleet/b.json": committed("b")}).splitlines()
    with pytest.raises(sections.Truncated):
        reader.read_output(whole[:-1])
    # A file that carries gpufleet's marker cannot name a ledger of its own twice.
    forged = output(None, {"/var/lib/gpufleet/b.json": f"{{\n{sections.MARK}{reader.OWN}\n{reader.PRESENT}\n{{}}"})
    with pytest.raises(sections.Forged, match=r"^its section 'state' appears twice"):
        reader.read_output(forged.splitlines())


def test_the_snapshot_reads_the_ledgers_with_the_readers_own_lines():
    paths = Paths(
        service="vllm-qwen35",
        models_dir="/srv/m",
        model_dir="/srv/m/q",
        dirs=(),
        files=(),
        ledger_path="/var/lib/gpufleet/vllm-qwen35.json",
        env_file="/etc/gpufleet/vllm-qwen35.env",
        port=PORT,
        nvidia_key_url="http://repo/gpgkey",
        docker_repo_url=None,
        nvidia_keyring="/k",
        docker_keyring="/d",
    )
    command = snapshot_command(paths).splitlines()
    lines = reader.read_lines(paths.ledger_path)
    at = command.index(lines[0])
    assert command[at : at + len(lines)] == lines


# --- the deploy and the rollout see the same ledger -------------------------------------------------------------
def test_the_rollout_reads_a_renamed_services_taken_over_ledger(tmp_path):
    # vllm_service renamed vllm-qwen35 -> vllm-renamed, same port: the new name has no ledger of its own yet.
    (tmp_path / "vllm-qwen35.json").write_text(committed("vllm-qwen35"))
    (tmp_path / "elsewhere.json").write_text(committed("elsewhere", PORT + 1))
    ran = read_on(tmp_path, "vllm-renamed")
    got = parse_read("gpu1", "vllm-renamed", PORT, ran.returncode, ran.stdout, ran.stderr)
    assert got.error is None and got.committed_ref == REF and got.ledger is not None
    assert got.ledger.committed == Committed(version("vllm-qwen35"), "t0")
    assert got.path == str(tmp_path / "vllm-qwen35.json")  # the file it came from (`history` names it)
    # On another port nothing is taken over: a host gpufleet never converged for this service.
    elsewhere = parse_read("gpu1", "vllm-renamed", PORT + 2, ran.returncode, ran.stdout, ran.stderr)
    assert elsewhere.ledger is None and elsewhere.error is None and elsewhere.committed_ref is None


@pytest.mark.parametrize(
    "files",
    [
        {},
        {"vllm-qwen35.json": committed("vllm-qwen35")},  # the service's own
        {"vllm-qwen35.json": committed("vllm-qwen35"), "renamed.json": committed("renamed")},
        {"old.json": committed("old")},  # taken over
        {"old.json": committed("old"), "older.json": committed("older")},  # two on the port: neither
        {
            "old.json": render(
                begin(Ledger(committed=Committed(version("old"), "t0")), version("old", ref=NEW_REF), "x", "t1")
            )
        },  # a run pending there: not taken over
        {"old.json": "{"},  # another service's corrupt ledger: its own deploy's refusal
    ],
    ids=["none", "own", "own-and-another", "taken-over", "ambiguous", "pending", "corrupt-other"],
)
def test_the_deploy_and_the_rollout_see_the_same_ledger(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    ran = read_on(tmp_path, "vllm-qwen35")
    snap = parse_snapshot(ran.stdout.splitlines())  # the snapshot's parser over the same lines
    deploy_sees = host_ledger(snap.ledger_text, snap.other_ledgers, PORT)
    rollout_sees = parse_read("gpu1", "vllm-qwen35", PORT, ran.returncode, ran.stdout, ran.stderr)
    assert rollout_sees.error is None
    assert (rollout_sees.ledger or Ledger()) == deploy_sees


def test_a_corrupt_own_ledger_is_the_deploys_refusal_line_in_the_rollout_too():
    got = parse_read("h1", "v", PORT, 0, output("{not json"), "")
    assert got.ledger is None and got.error.startswith("h1: /var/lib/gpufleet/v.json is corrupt: not JSON")


def test_a_reading_that_failed_or_was_cut_names_the_file():
    assert "Permission denied" in parse_read("h1", "v", PORT, 1, "", "sudo: Permission denied").error
    cut = parse_read("h1", "v", PORT, 0, output(None)[: -len(sections.END) - 2], "")
    assert cut.ledger is None and cut.error == (
        "cannot read /var/lib/gpufleet/v.json: the reading's output is truncated (no end marker)"
    )
