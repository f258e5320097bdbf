"""vllm-router's worker API and metrics, asked on the router host (docs/router.md).

The fence lets root in, and sshd tunnels as the login user, so a request is curl in a root shell.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from gpufleet.errors import GpufleetError, one_line
from gpufleet.health.api import fetch
from gpufleet.names import LOOPBACK
from gpufleet.remote.ssh import needs_sudo
from gpufleet.remote.transport import MAX_BODY_BYTES, SshTransport, Transport, TransportError
from gpufleet.router.spec import NFT, fence_table
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.metrics import Sample, samples

TIMEOUT_S = 10.0


class RouterError(GpufleetError):
    """The router refused or did not answer a request."""


@dataclass(frozen=True)
class Router:
    """One router: its host's transport and its loopback ports."""

    name: str
    transport: Transport
    port: int
    metrics_port: int
    members_file: str | None = None  # its worker set, replayed after a restart
    # Samples metrics() left out as NaN or infinite, for the caller to report and clear.
    non_finite: list[str] = field(default_factory=list, compare=False, repr=False)

    def get_json(self, path: str, timeout: float = TIMEOUT_S) -> Any:
        status, body = self.request("GET", path, timeout)
        if status != 200:
            raise RouterError(one_line(f"{self.name}: GET {path}: HTTP {status}: {excerpt(body)}"))
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            raise RouterError(one_line(f"{self.name}: GET {path}: not JSON: {excerpt(body)}")) from None

    def post(self, path: str, timeout: float = TIMEOUT_S) -> str:
        status, body = self.request("POST", path, timeout)
        if status != 200:
            raise RouterError(one_line(f"{self.name}: POST {path}: HTTP {status}: {excerpt(body)}"))
        return body

    def request(self, method: str, path: str, timeout: float) -> tuple[int, str]:
        """(status, body) of one request to the router's port."""
        url = shlex.quote(f"http://{LOOPBACK}:{self.port}{path}")
        # The status first, then the body cut at the transport's cap.
        script = (
            f'b=$(mktemp) || exit 1; c=$(curl -sS -X {method} --max-time {timeout:g} -o "$b" '
            f'-w \'%{{http_code}}\' {url}); r=$?; echo "$c"; head -c {MAX_BODY_BYTES} "$b"; rm -f "$b"; '
            "exit $r"
        )
        status, out, err = self.as_root(script, timeout + 10)
        code, _, body = out.partition("\n")
        if status != 0 or not code.isdigit():
            raise RouterError(one_line(f"{self.name}: {method} {path}: {err.strip() or f'exit status {status}'}"))
        return int(code), body

    def as_root(self, script: str, timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of a script run as root on the router host."""
        if not isinstance(self.transport, SshTransport):
            raise RouterError(f"{self.name}: not reached over SSH: its worker API cannot be asked")
        sudo = "sudo -n " if needs_sudo(self.transport.client) else ""
        try:
            return self.transport.shell(f"{sudo}sh -c {shlex.quote(script)}", timeout=timeout)
        except TransportError as error:
            raise RouterError(one_line(str(error))) from None

    def fenced(self) -> bool:
        """Is the nftables fence around the router's port loaded?"""
        status, _, _ = self.as_root(f"{NFT} list table inet {fence_table(self.port)} >/dev/null", TIMEOUT_S)
        return status == 0

    def add_worker(self, url: str, timeout: float) -> None:
        self.post(f"/add_worker?url={quote(url, safe='')}", timeout)

    def remove_worker(self, url: str) -> None:
        self.post(f"/remove_worker?url={quote(url, safe='')}")

    def list_workers(self) -> list[str]:
        return [str(u) for u in self.get_json("/list_workers").get("urls", [])]

    def metrics(self) -> list[Sample]:
        """The router's finite metric samples; the others are named in non_finite."""
        answer = fetch(self.transport, self.metrics_port, "/metrics", timeout=TIMEOUT_S)
        if answer.status != 200:
            raise RouterError(one_line(f"{self.name}: GET /metrics: HTTP {answer.status}"))
        every = _parsed(answer.text, self.name)
        for name, labels, value in every:
            if not math.isfinite(value) and (key := _key(name, labels, value)) not in self.non_finite:
                self.non_finite.append(key)
        return [s for s in every if math.isfinite(s[2])]


def router_samples(text: str, router: str = "router") -> list[Sample]:
    """The finite samples of the router's Prometheus text."""
    return [s for s in _parsed(text, router) if math.isfinite(s[2])]


def _parsed(text: str, router: str) -> list[Sample]:
    try:
        return samples(text)
    except ValueError as error:
        raise RouterError(one_line(f"{router}: GET /metrics: {error}")) from None


def _key(name: str, labels: dict[str, str], value: float) -> str:
    inside = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inside}}} {value:g}" if inside else f"{name} {value:g}"
