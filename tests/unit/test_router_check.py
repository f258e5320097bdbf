"""gpufleet.router.check: a router's status against the inventory -> the problems, one line each with its fix."""

from __future__ import annotations

import dataclasses

import pytest

from gpufleet.router.check import RouterExpected, RouterVerdict, problems, verify_router
from gpufleet.router.settings import replicas, resolve_router
from gpufleet.router.status import RouterStatus, WorkerRow

GPU1, GPU2 = "http://10.0.0.11:5000", "http://10.0.0.12:5000"
EXPECTED = RouterExpected(
    {GPU1: "gpu1", GPU2: "gpu2"}, health_check_interval_s=7, service="vllm-router", inventory="inventories/lab.py"
)


def worker(url: str, healthy: bool = True) -> WorkerRow:
    return WorkerRow(url, healthy, load=0, routed=0, running=0)


def ready(*workers: WorkerRow) -> RouterStatus:
    return RouterStatus("rtr1", "ready", "", "cache_aware", workers)


def test_a_router_routing_to_every_replica_healthy_passes():
    assert problems(ready(worker(GPU2), worker(GPU1)), EXPECTED) == ()


def test_a_trailing_slash_is_the_same_worker():
    assert problems(ready(worker(GPU1 + "/"), worker(GPU2)), EXPECTED) == ()


def test_an_unhealthy_worker_names_router_replica_and_fix():
    assert problems(ready(worker(GPU1), worker(GPU2, healthy=False)), EXPECTED) == (
        "rtr1: worker http://10.0.0.12:5000 (gpu2) is not healthy in the router (fix: gpufleet verify "
        "inventories/lab.py --host gpu2; the router re-checks it every 7 s)",
    )


def test_a_replica_missing_from_the_worker_set_names_the_fix_that_puts_it_back():
    assert problems(ready(worker(GPU1)), EXPECTED) == (
        "rtr1: worker http://10.0.0.12:5000 (gpu2) is not in the router's worker set (fix: once gpu2 verifies "
        "ready, `gpufleet status inventories/lab.py --fix` puts it back)",
    )


def test_a_worker_not_in_the_inventory_is_named():
    (line,) = problems(ready(worker(GPU1), worker(GPU2), worker("http://10.0.0.99:5000")), EXPECTED)
    assert line == (
        "rtr1: worker http://10.0.0.99:5000 is not a replica of the inventory (fix: `gpufleet status "
        "inventories/lab.py --fix` removes it)"
    )


def test_a_worker_api_without_its_fence_is_a_problem_and_an_unknown_fence_is_not():
    row = dataclasses.replace(ready(worker(GPU1), worker(GPU2)), fenced=False)
    assert problems(row, EXPECTED) == (
        "rtr1: the router's worker API is open to every local user of rtr1: its nftables fence is not loaded (fix: "
        "pyinfra inventories/lab.py deploys/router.py loads it)",
    )
    assert problems(dataclasses.replace(row, fenced=None), EXPECTED) == ()


def test_a_moved_replica_is_missing_at_its_new_address_and_extra_at_its_old_one():
    lines = problems(ready(worker(GPU1), worker("http://10.0.0.42:5000")), EXPECTED)
    assert [line.split(" (fix")[0] for line in lines] == [
        "rtr1: worker http://10.0.0.12:5000 (gpu2) is not in the router's worker set",
        "rtr1: worker http://10.0.0.42:5000 is not a replica of the inventory",
    ]


def test_a_router_with_no_healthy_worker_names_each():
    row = RouterStatus("rtr1", "not-ready", "no healthy worker", None, (worker(GPU1, False), worker(GPU2, False)))
    assert [line.split(":")[1] for line in problems(row, EXPECTED)] == [" worker http", " worker http"]


def test_a_router_with_no_workers_misses_every_replica():
    lines = problems(RouterStatus("rtr1", "not-ready", "no workers"), EXPECTED)
    assert len(lines) == 2 and all("is not in the router's worker set" in line for line in lines)


def test_a_router_that_does_not_answer_is_one_line_with_the_fix():
    row = RouterStatus("rtr1", "down", "GET /workers: connection refused", "cache_aware")
    assert problems(row, EXPECTED) == (
        "rtr1: the router does not answer: GET /workers: connection refused (fix: `systemctl status vllm-router` on "
        "rtr1; pyinfra inventories/lab.py deploys/router.py starts it)",
    )


def test_a_router_host_ssh_cannot_reach_is_one_line():
    (line,) = problems(RouterStatus("rtr1", "unreachable", "cannot SSH to 10.0.0.5: timed out"), EXPECTED)
    assert line.startswith("rtr1: cannot SSH to the router host: cannot SSH to 10.0.0.5: timed out (fix: ")


def test_whatever_the_router_sent_stays_on_one_line():
    (line,) = problems(ready(worker(GPU1), worker(GPU2), worker("http://x:1\nfix: all good")), EXPECTED)
    assert "\n" not in line and "http://x:1\\nfix: all good" in line


def test_expected_workers_are_the_replicas_at_the_router_deploys_urls():
    found = replicas([("gpu1", {"ssh_hostname": "10.0.0.11"}), ("gpu2", {"router_worker_address": "10.1.0.12"})])
    settings = resolve_router("rtr1", {"router_health_check_interval_s": 3, "router_service": "rtr"})
    exp = RouterExpected.for_router(settings, found, "inv.py")
    assert exp == RouterExpected({GPU1: "gpu1", "http://10.1.0.12:5000": "gpu2"}, 3, "rtr", "inv.py")


def test_the_verdict_row_is_the_status_row_with_ok_and_problems():
    verdict = RouterVerdict(ready(worker(GPU1)), problems(ready(worker(GPU1)), EXPECTED))
    row = verdict.as_dict()
    assert (row["host"], row["role"], row["state"], row["ok"]) == ("rtr1", "router", "ready", False)
    assert row["problems"] == list(verdict.problems) and len(row["problems"]) == 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.mark.parametrize(
    ("deadline", "looks", "ok"), [(0.0, 1, False), (0.5, 1, False), (1.5, 2, False), (10.0, 3, True)]
)
def test_verify_waits_for_a_router_until_it_passes_or_the_deadline(deadline, looks, ok):
    rows = iter([ready(worker(GPU1)), ready(worker(GPU1), worker(GPU2, False)), ready(worker(GPU1), worker(GPU2))])
    read: list[RouterStatus] = []
    clock = Clock()

    def look() -> RouterStatus:
        read.append(next(rows))
        return read[-1]

    verdict = verify_router(look, EXPECTED, deadline, clock=clock, sleep=clock.sleep)
    assert (len(read), verdict.ok) == (looks, ok)


def test_a_client_port_that_does_not_answer_is_a_problem_even_with_every_worker_healthy():
    # The router routes fine on its loopback, but clients reach it through nginx on the client port.
    row = dataclasses.replace(ready(worker(GPU1), worker(GPU2)), front_door="502")
    (line,) = problems(row, EXPECTED)
    assert line == (
        "rtr1: the client port does not answer /health (502): clients cannot reach the router (fix: "
        "`systemctl status nginx` on rtr1; pyinfra inventories/lab.py deploys/router.py configures it)"
    )
    assert problems(dataclasses.replace(row, front_door="200"), EXPECTED) == ()
