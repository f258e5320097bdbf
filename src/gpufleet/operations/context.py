"""Per-host deploy context: the host snapshot read once by preflight, and values resolved while executing.

pyinfra 3 runs an operation's generator once while preparing (to learn whether it will change anything) and
again while executing. Both runs decide from the same snapshot, so the executed commands are the ones the plan
announced; only values that cannot exist before execution (the digest a tag resolves to) are read from `resolved`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import Host
from pyinfra.context import ctx_host

from gpufleet.facts.host import HostSnapshot


@dataclass
class HostContext:
    snapshot: HostSnapshot
    settings: dict[str, Any]
    resolved: dict[str, str] = field(default_factory=dict)  # e.g. "image_ref" -> repo@sha256:...


_CONTEXTS: dict[tuple[int, str], HostContext] = {}


def _key(host: Host) -> tuple[int, str]:
    return (id(host.state), host.name)


def set_context(host: Host, context: HostContext) -> None:
    _CONTEXTS[_key(host)] = context


def context(host: Host | None = None) -> HostContext:
    host = host or ctx_host.get()
    try:
        return _CONTEXTS[_key(host)]
    except KeyError:
        raise RuntimeError(f"{host.name}: gpufleet operations need the preflight snapshot first "
                           "(call gpufleet.deploys.qwen35.preflight)") from None


def snapshot() -> HostSnapshot:
    return context().snapshot


def use_sudo(host: Host) -> bool:
    """Root-level commands run through sudo unless pyinfra logs in as root (then sudo may not even exist)."""
    return (host.data.get("ssh_user") or "root") != "root" and host.name != "@local"


def fail(host: Host, message: str) -> bool:
    """Report a failure of a Python callback on one line (pyinfra marks the host failed on False)."""
    from pyinfra import logger

    host.log_styled(message, fg="red", log_func=logger.error)
    return False


class Hidden:
    """A secret passed through pyinfra (operation and FunctionCommand arguments show up in debug logs and reprs)."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Hidden(***)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Hidden) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)
