"""The run's state (gpufleet.operations.run): one typed context per pyinfra State, a record per host, run-wide records
by type, and nothing left behind once the run's State is gone."""

from __future__ import annotations

import gc
import weakref

import pytest
from pyinfra.api import Config, Inventory, State

from gpufleet.hoststate.ledger import Ledger
from gpufleet.operations.run import host_run, remember, report, reported, run_context, snapshot
from gpufleet.vllm.facts import HostSnapshot


def a_run() -> tuple[State, Inventory]:
    inventory = Inventory(([("gpu1", {}), ("gpu2", {})], {}))
    return State(inventory, Config()), inventory


def test_each_run_and_each_host_has_its_own_record():
    (first, inventory), (second, _) = a_run(), a_run()
    gpu1, gpu2 = inventory.get_host("gpu1"), inventory.get_host("gpu2")
    snap = HostSnapshot(arch="arm64")
    assert remember(gpu1, snap) is host_run(gpu1) and snapshot(gpu1) is snap
    with pytest.raises(RuntimeError, match=r"^gpu2: gpufleet operations decide from the host snapshot: read it first"):
        snapshot(gpu2)
    assert run_context(first).host("gpu1").snapshot is snap and run_context(second).host("gpu1").snapshot is None
    host_run(gpu1).ledger = Ledger()
    assert run_context(first).hosts.keys() == {"gpu1", "gpu2"}


def test_a_run_wide_record_is_made_once_by_its_type_and_not_kept_when_making_it_failed():
    class Workers(tuple):  # a slice's own record: the base never imports it
        pass

    (first, _), (second, _) = a_run(), a_run()
    made: list[int] = []

    def make() -> Workers:
        made.append(1)
        return Workers(("w1",))

    def broken() -> Workers:
        raise ValueError("no replica verifies ready")

    with pytest.raises(ValueError, match=r"^no replica verifies ready$"):
        run_context(first).slot(Workers, broken)
    assert run_context(first).slot(Workers, make) == ("w1",)
    assert run_context(first).slot(Workers, make) is run_context(first).slot(Workers, broken)
    run_context(second).slot(Workers, make)  # another run makes its own
    assert len(made) == 2


def test_reported_problems_are_one_line_each_once_and_only_for_hosts_that_have_some():
    state, inventory = a_run()
    host_run(inventory.get_host("gpu2"))  # a record without problems
    report(state, "gpu1", "gpu1: first\nline")
    report(state, "gpu1", "gpu1: first\nline")
    report(state, "gpu1", "gpu1: second")
    assert reported(state) == {"gpu1": ["gpu1: first\\nline", "gpu1: second"]}
    assert reported(a_run()[0]) == {}


def test_a_runs_state_goes_with_its_state():
    class Kept:
        pass

    state, inventory = a_run()
    kept = weakref.ref(run_context(state).slot(Kept, Kept))
    assert kept() is not None
    del state, inventory
    gc.collect()
    assert kept() is None
