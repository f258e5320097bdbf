"""A rollout's replica groups (gpufleet.rollout.group): a group is one replica of the batches, with all its ranks, the
head first; its head alone is a router's worker; it is done only when every rank committed the target."""

from __future__ import annotations

from types import SimpleNamespace

from gpufleet.rollout import group
from gpufleet.rollout.swap import replica_batches
from gpufleet.vllm.group import Member

PAIR = ("g1", "g2")


def fleet() -> dict:
    """solo1, g2 (a rank listed before its head), g1 (the head), solo2: what an inventory may list in any order."""

    def host(name: str, rank: int | None):
        member = Member("pair", rank, PAIR, ("10.0.0.1", "10.0.0.2"), 29501, None) if rank is not None else None
        return SimpleNamespace(name=name, spec=SimpleNamespace(group=member))

    return {h.name: h for h in (host("solo1", None), host("g2", 1), host("g1", 0), host("solo2", None))}


def test_a_group_is_one_replica_of_a_batch_with_every_rank_head_first():
    hosts = fleet()
    order = list(hosts)
    assert group.units(order, hosts) == [["solo1"], ["g1", "g2"], ["solo2"]]
    assert group.expand(order, hosts) == ["solo1", "g1", "g2", "solo2"]
    assert replica_batches(order, hosts, canary=1, batch=1) == [["solo1"], ["g1", "g2"], ["solo2"]]
    assert replica_batches(["g2", "solo2", "solo1"], hosts, canary=1, batch=2) == [["g1", "g2"], ["solo2", "solo1"]]
    assert group.canaries(["g2", "solo1"], hosts, 1) == {"g1", "g2"}


def test_only_the_head_is_a_routers_worker():
    hosts = fleet()
    assert [h.name for h in group.workers(hosts.values())] == ["solo1", "g1", "solo2"]
    assert group.is_worker(hosts, "g1") and not group.is_worker(hosts, "g2")
    assert group.is_worker({}, "unknown") and not group.in_group({}, "unknown")


def test_a_group_is_done_only_when_every_rank_committed_the_target():
    hosts = fleet()
    assert group.done({"solo1", "g1"}, hosts) == {"solo1"}  # g1 waits for g2: swapped again together
    assert group.done({"solo1", "g1", "g2"}, hosts) == {"solo1", "g1", "g2"}


def test_a_rank_skipped_for_its_gpus_skips_its_whole_group():
    hosts = fleet()
    skipped = group.skipped({"g2": "GPU 0: needs a reboot", "solo1": "GPU 1: needs a reset"}, hosts)
    assert skipped == {
        "g2": "GPU 0: needs a reboot",
        "solo1": "GPU 1: needs a reset",
        "g1": "not swapped: g2, a rank of its group, is skipped for its GPUs",
    }
