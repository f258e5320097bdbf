"""Which ledger a service goes by and the refusals the state dir's ledgers call for (gpufleet.hoststate.rules): pure
functions over the ledgers' texts, the service's name and port. The deploy's preflight lines built from them are in
test_vllm_deploy.py; the rollout's changed-since-read check in test_rollout.py."""

from __future__ import annotations

import json

from gpufleet.hoststate.ledger import Committed, Ledger, Version, begin, render
from gpufleet.hoststate.rules import cut_rename_away, host_ledger, replaced_service, taken_over

IMAGE = "reg:5000/vllm/vllm-openai:good"
REF = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64
PORT = 5000
OLD = Version(IMAGE, REF, "a" * 64, "0" * 16, "vllm-qwen35", PORT)


def test_a_renamed_service_takes_over_the_ledger_of_the_one_service_on_its_port():
    other_port = Version(IMAGE, REF, "a" * 64, "0" * 16, "elsewhere", PORT + 1)
    others = {
        "/var/lib/gpufleet/vllm-qwen35.json": render(Ledger(committed=Committed(OLD, "t0"))),
        "/var/lib/gpufleet/elsewhere.json": render(Ledger(committed=Committed(other_port, "t0"))),
        "/var/lib/gpufleet/broken.json": "{",
    }
    ledger = host_ledger(None, others, PORT)
    assert replaced_service(ledger, "renamed") == "vllm-qwen35" and ledger.committed == Committed(OLD, "t0")
    assert taken_over(others, PORT) == ("/var/lib/gpufleet/vllm-qwen35.json", ledger)
    assert host_ledger(render(Ledger()), others, PORT) == Ledger()  # the service's own ledger wins
    # A rename whose new version failed keeps the old service committed in the new service's ledger.
    assert (
        replaced_service(host_ledger(render(Ledger(committed=Committed(OLD, "t0"))), others, PORT), "renamed")
        == "vllm-qwen35"
    )
    assert replaced_service(ledger, "vllm-qwen35") is None  # no rename
    migrated = json.dumps({"current": {"image": OLD.image, "ref": OLD.ref, "pinned_at": "t0"}, "history": []})
    assert host_ledger(None, {"/var/lib/gpufleet/vllm-qwen35.json": migrated}, PORT) == Ledger()  # no port in it


def test_a_taken_over_ledger_names_its_service_from_its_file_when_its_version_does_not():
    unnamed = Version(IMAGE, REF, "a" * 64, "0" * 16, None, PORT)
    ledger = host_ledger(
        None, {"/var/lib/gpufleet/vllm-old.json": render(Ledger(committed=Committed(unnamed, "t0")))}, PORT
    )
    assert ledger.committed is not None and ledger.committed.version.service == "vllm-old"


def test_nothing_is_taken_over_from_two_services_on_the_port_or_one_with_a_run_pending():
    second = Version(IMAGE, REF, "b" * 64, "1" * 16, "vllm-other", PORT)
    two = {
        "/var/lib/gpufleet/vllm-qwen35.json": render(Ledger(committed=Committed(OLD, "t0"))),
        "/var/lib/gpufleet/vllm-other.json": render(Ledger(committed=Committed(second, "t0"))),
    }
    assert host_ledger(None, two, PORT) == Ledger() and taken_over(two, PORT) is None
    pending = {
        "/var/lib/gpufleet/vllm-qwen35.json": render(
            begin(Ledger(committed=Committed(OLD, "t0")), second, "ops@laptop pid 7", "t1")
        )
    }
    assert host_ledger(None, pending, PORT) == Ledger()


def test_a_rename_away_that_was_cut_is_named_for_the_old_service_only():
    new = Version(IMAGE, REF, "b" * 64, "1" * 16, "renamed", PORT)
    cut = render(begin(Ledger(committed=Committed(OLD, "t0")), new, "ops@laptop pid 7", "t1"))
    others = {"/var/lib/gpufleet/renamed.json": cut, "/var/lib/gpufleet/broken.json": "{"}
    line = cut_rename_away("gpu1", others, "vllm-qwen35")
    assert line is not None and line.startswith("gpu1: a run renaming vllm_service 'vllm-qwen35' to 'renamed' was cut")
    assert cut_rename_away("gpu1", others, "elsewhere") is None
    assert (
        cut_rename_away(
            "gpu1", {"/var/lib/gpufleet/renamed.json": render(Ledger(committed=Committed(OLD, "t0")))}, "vllm-qwen35"
        )
        is None
    )  # nothing pending: no run was cut
