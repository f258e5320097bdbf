"""The CLI's contract (docs/cli.md): exit statuses, the one JSON document of status, verify, history, rollout and
rollback, and loading an inventory as bad input.

Exit status: 0 all good, 1 problems found (a host or router not ok, a failed rollout), 2 bad usage or input (click's
own usage errors; an inventory missing, unloadable or empty; a --host it does not have; an invalid setting).

    >>> doc = document("verify", [row("gpu-box-1", [Problem("dead", "/health answered 503", "read the logs")])], [])
    >>> doc["ok"], doc["hosts"][0]["ok"], doc["hosts"][0]["problems"][0]["id"]
    (False, False, 'dead')
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import click

from gpufleet.errors import GpufleetError, one_line
from gpufleet.inventory import HostData, load_roles

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT = 0, 1, 2


class BadInput(click.ClickException):
    """The command could not start from what it was given (inventory, setting, option): exit status 2, apart from
    the 1 that says it found problems."""

    exit_code = EXIT_BAD_INPUT


class Problems(click.ClickException):
    """A problem found while working (a host, a router, the fleet): exit status 1, one line each."""

    exit_code = EXIT_PROBLEMS


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a host or router: a stable id, what is wrong, and the fix (never empty)."""

    id: str
    message: str
    fix: str

    def line(self, host: str) -> str:
        """The text form every command prints: `host: message (fix: fix)`, one line."""
        return one_line(f"{host}: {self.message} (fix: {self.fix})")

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, "message": self.message, "fix": self.fix}

    @classmethod
    def from_line(cls, id: str, line: str, host: str, fix: str) -> Problem:
        """A problem line made elsewhere (`host: what (fix: how)`) split into message and fix; `fix` when the line
        carries none."""
        message = line.removeprefix(f"{host}: ")
        head, sep, tail = message.rpartition(" (fix: ")
        if sep and tail.endswith(")"):
            return cls(id, head, tail[:-1])
        return cls(id, message, fix)


def row(host: str, problems: Sequence[Problem], **fields: Any) -> dict[str, Any]:
    """One host's or router's row of the document: host, ok, problems, then the command's own fields."""
    return {"host": host, "ok": not problems, "problems": [p.as_dict() for p in problems], **fields}


def document(command: str, hosts: Sequence[Mapping[str, Any]], routers: Sequence[Mapping[str, Any]],
             error: str | None = None, **fields: Any) -> dict[str, Any]:
    """{"command", "ok", "error", <the command's own keys>, "hosts", "routers"}: ok when every row is and nothing
    stopped the command (error: the one line that did, else null)."""
    ok = error is None and all(r["ok"] for r in (*hosts, *routers))
    return {"command": command, "ok": ok, "error": error, **fields, "hosts": list(hosts), "routers": list(routers)}


def stopped(command: str, line: str, as_json: bool) -> Problems:
    """A command stopped by a problem it found before any host's row (a refusal, a host out of reach): under --json
    the document says so too. Raise what it returns."""
    if as_json:
        emit(document(command, [], [], error=line))
    return Problems(line)


def emit(doc: Mapping[str, Any]) -> None:
    click.echo(json.dumps(doc, indent=2))


def exit_status(doc: Mapping[str, Any]) -> int:
    return EXIT_OK if doc["ok"] else EXIT_PROBLEMS


def load_inventory(inventory: str, host: str | None = None) -> tuple[list[HostData], list[HostData]]:
    """(routers, replicas): every one of the inventory (a router is checked against all the replicas, whatever
    `--host` selects); BadInput when the file is missing, does not load, lists no host, or has no `host`."""
    try:
        routers, replicas = load_roles(inventory)
    except GpufleetError as e:
        raise unreadable(inventory, e) from None
    if not routers and not replicas:
        raise BadInput(f"{inventory}: no hosts in the inventory (fix: list hosts in it, as in inventories/lab.py)")
    if host is not None and host not in {name for name, _ in (*routers, *replicas)}:
        raise BadInput(one_line(f"{host}: no such host in {inventory} (fix: check --host)"))
    return routers, replicas


def unreadable(inventory: str, error: GpufleetError) -> BadInput:
    """The inventory's own error (not found, its Python error), with a fix where the line has none."""
    line = str(error)
    if "(fix: " not in line:
        line += f" (fix: correct {inventory}: `python3 {inventory}` shows the whole error)"
    return BadInput(line)
