"""A router whose SSH session broke mid-rollout is reached again (a new session, its lock taken again) and the call
made once more; a router that answers with an error is not (its answer stands). The sessions are stand-ins here;
tests/integration/test_rollout_router.py cuts a real one (ss -K) and blocks one with the host's firewall."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gpufleet.rollout import routers as routers_module
from gpufleet.rollout.routers import Routers
from gpufleet.router.api import RouterError


@dataclass
class Session:
    alive: bool = True

    def is_active(self) -> bool:
        return self.alive


@dataclass
class Client:
    session: Session = field(default_factory=Session)
    closed: bool = False

    def get_transport(self) -> Session:
        return self.session

    def close(self) -> None:
        self.closed = True


class FakeRouter:
    """What Routers uses of gpufleet.router.api.Router: its name, its transport's client, its worker list."""

    def __init__(self, name: str, workers: list[str] | Exception):
        self.name, self.workers, self.non_finite = name, workers, []
        self.transport = type("Transport", (), {"client": Client()})()

    def list_workers(self) -> list[str]:
        if isinstance(self.workers, Exception):
            raise self.workers
        return self.workers


@pytest.fixture
def reachable_again(monkeypatch):
    """connect() gives a fresh session that answers; the lock is taken again over it."""
    fresh = FakeRouter("gfr4", ["http://10.0.0.11:5000"])
    monkeypatch.setattr(routers_module, "_broken", lambda r: r.transport.client.session.alive is False)
    monkeypatch.setattr(routers_module, "connect", lambda name, data: fresh)
    relocked: list[str] = []
    monkeypatch.setattr(routers_module, "_relock", lambda router, data: relocked.append(router.name) or object())
    return fresh, relocked


def test_a_broken_session_is_reached_again_and_the_read_repeated_once(reachable_again):
    fresh, relocked = reachable_again
    old = FakeRouter("gfr4", ConnectionResetError("Connection reset by peer"))
    old.transport.client.session.alive = False  # the reset tore the session down
    routers = Routers([(old, 5.0)], {}, hosts={"gfr4": {"ssh_hostname": "10.0.0.14"}})
    assert routers._call(0, lambda r: r.list_workers()) == ["http://10.0.0.11:5000"]
    assert routers.routers[0][0] is fresh and relocked == ["gfr4"] and old.transport.client.closed
    assert routers.notes["gfr4"] == ["the router's SSH session broke; reached it again, its lock taken again"]


def test_a_router_that_answers_with_an_error_is_not_reached_again(reachable_again):
    _, relocked = reachable_again
    answering = FakeRouter("gfr4", RouterError("gfr4: GET /workers: HTTP 500: boom"))
    routers = Routers([(answering, 5.0)], {}, hosts={"gfr4": {}})
    with pytest.raises(RouterError, match="HTTP 500"):
        routers._call(0, lambda r: r.list_workers())
    assert relocked == [] and routers.routers[0][0] is answering


def test_a_router_that_cannot_be_reached_again_is_one_line_at_the_reconcile(monkeypatch):
    monkeypatch.setattr(routers_module, "_broken", lambda r: True)

    def unreachable(name, data):
        raise routers_module.Unreachable(f"{name}: cannot SSH to 10.0.0.14:22: Connection refused")

    monkeypatch.setattr(routers_module, "connect", unreachable)
    routers = Routers(
        [(FakeRouter("gfr4", OSError("Socket is closed")), 5.0)], {"gpu1": "http://10.0.0.11:5000"}, hosts={"gfr4": {}}
    )
    said = routers.reconcile({"gpu1": True})
    assert list(said) == ["gfr4"] and said["gfr4"].startswith("router gfr4: worker list: ")
    assert "cannot SSH to 10.0.0.14:22" in said["gfr4"] and "\n" not in said["gfr4"]
