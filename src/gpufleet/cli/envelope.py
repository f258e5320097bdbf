"""The CLI's contract (docs/cli.md): exit statuses, the one JSON document of the commands, and bad input."""

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
    """The command could not start from what it was given: exit status 2."""

    exit_code = EXIT_BAD_INPUT


class Problems(click.ClickException):
    """Problems found while working: exit status 1, one line each."""

    exit_code = EXIT_PROBLEMS


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a host or router: a stable id, what is wrong, and the fix."""

    id: str
    message: str
    fix: str

    def line(self, host: str) -> str:
        """`host: message (fix: fix)`."""
        return one_line(f"{host}: {self.message} (fix: {self.fix})")

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, "message": self.message, "fix": self.fix}

    @classmethod
    def from_line(cls, id: str, line: str, host: str, fix: str) -> Problem:
        """A `host: what (fix: how)` line split up."""
        message = line.removeprefix(f"{host}: ")
        head, sep, tail = message.rpartition(" (fix: ")
        if sep and tail.endswith(")"):
            return cls(id, head, tail[:-1])
        return cls(id, message, fix)


def row(host: str, problems: Sequence[Problem], **fields: Any) -> dict[str, Any]:
    """One host's or router's row of the document."""
    return {"host": host, "ok": not problems, "problems": [p.as_dict() for p in problems], **fields}


def document(
    command: str,
    hosts: Sequence[Mapping[str, Any]],
    routers: Sequence[Mapping[str, Any]],
    error: str | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The command's document: ok when every row is and nothing stopped the command."""
    ok = error is None and all(r["ok"] for r in (*hosts, *routers))
    return {"command": command, "ok": ok, "error": error, **fields, "hosts": list(hosts), "routers": list(routers)}


def stopped(command: str, line: str, as_json: bool) -> Problems:
    """The Problems to raise for a command stopped before any row; under --json the document says so too."""
    if as_json:
        emit(document(command, [], [], error=line))
    return Problems(line)


def emit(doc: Mapping[str, Any]) -> None:
    click.echo(json.dumps(doc, indent=2))


def exit_status(doc: Mapping[str, Any]) -> int:
    return EXIT_OK if doc["ok"] else EXIT_PROBLEMS


def load_inventory(inventory: str, host: str | None = None) -> tuple[list[HostData], list[HostData]]:
    """(routers, vLLM hosts) of the inventory, all of them whatever `--host` selects; raises BadInput."""
    try:
        routers, vllm_hosts = load_roles(inventory)
    except GpufleetError as e:
        raise unreadable(inventory, e) from None
    if not routers and not vllm_hosts:
        raise BadInput(f"{inventory}: no hosts in the inventory (fix: list hosts in it, as in inventories/lab.py)")
    if host is not None and host not in {name for name, _ in (*routers, *vllm_hosts)}:
        raise BadInput(one_line(f"{host}: no such host in {inventory} (fix: check --host)"))
    return routers, vllm_hosts


def unreadable(inventory: str, error: GpufleetError) -> BadInput:
    """The inventory's own error, with a fix where the line has none."""
    line = str(error)
    if "(fix: " not in line:
        line += f" (fix: correct {inventory}: `python3 {inventory}` shows the whole error)"
    return BadInput(line)
