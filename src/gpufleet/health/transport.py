"""How the health checks reach a vLLM server: HTTP to 127.0.0.1:<port> *on the host*, plus the container's state.

Two transports share one small interface so every check runs unchanged through SSH (production) and on loopback
(tests against a real vLLM process):

- SshTransport: HTTP rides a paramiko ``direct-tcpip`` channel to 127.0.0.1:<port> on the host, so the server's
  port never has to be reachable from the operator's network; container state comes from ``docker ps``/``inspect``
  over the same SSH connection (containers have no name: they are found by their ``gpufleet.<service>`` label).
- LoopbackTransport (loopback.py): HTTP to a local port; the "container" is the server process and its liveness.
"""

from __future__ import annotations

import http.client
import io
import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import paramiko


class TransportError(Exception):
    """The transport itself failed (SSH down, command failed): nothing can be said about the server."""


class Unreachable(TransportError):
    """The host cannot be reached over SSH."""


@dataclass(frozen=True)
class ContainerInfo:
    """What docker (or the local process table) says about the server's container."""

    id: str
    state: str  # docker's State.Status: running, exited, restarting, created, paused, dead
    started_at: float | None = None  # epoch seconds
    exit_code: int | None = None
    image: str | None = None  # the ref it was started from
    image_id: str | None = None  # sha256:... of the image actually running
    spec_hash: str | None = None  # value of the gpufleet.<service> label

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def image_short(self) -> str | None:
        """12 hex digits: the registry digest when the container was started by digest (as the deploy pins it),
        else the local image id."""
        source = self.image.rsplit("@", 1)[1] if self.image and "@" in self.image else self.image_id
        return source.split(":", 1)[-1][:12] if source else None


class Transport(Protocol):
    name: str

    def http(self, port: int, timeout: float) -> http.client.HTTPConnection:
        """A connected HTTP connection to 127.0.0.1:port on the host.

        Raises ConnectionRefusedError when nothing listens there, Unreachable when the host is unreachable.
        """

    def container(self, service: str) -> ContainerInfo | None:
        """The service's container (the running one, else the newest), or None when there is none."""

    def logs(self, service: str, tail: int = 30) -> list[str]:
        """The container's last log lines (stdout and stderr)."""


class _ChannelReader(io.RawIOBase):
    """A paramiko Channel as a raw binary stream, so io.BufferedReader can wrap it: http.client needs peek()
    for chunked (streamed) bodies, which paramiko's own ChannelFile lacks."""

    def __init__(self, chan: paramiko.Channel):
        self._chan = chan

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._chan.recv(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _ChannelSocket:
    """The socket surface http.client uses, over a paramiko Channel."""

    def __init__(self, chan: paramiko.Channel):
        self.chan = chan

    def sendall(self, data: bytes) -> None:
        self.chan.sendall(data)

    def settimeout(self, timeout: float | None) -> None:
        self.chan.settimeout(timeout)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_ChannelReader(self.chan))

    def close(self) -> None:
        self.chan.close()


class _ChannelHTTPConnection(http.client.HTTPConnection):
    """http.client over an already-open paramiko Channel."""

    def __init__(self, chan: paramiko.Channel, port: int, timeout: float):
        super().__init__("127.0.0.1", port, timeout=timeout)
        self.sock = self._chan = _ChannelSocket(chan)
        self._handing_over = False

    def connect(self) -> None:  # the channel is the connection; http.client must not dial anything
        if self.sock is None:
            raise ConnectionError("the SSH channel was handed to a response and cannot be reused")

    def getresponse(self) -> http.client.HTTPResponse:
        self._handing_over = True
        try:
            return super().getresponse()
        finally:
            self._handing_over = False

    def close(self) -> None:
        if self._handing_over:
            # A "Connection: close" response takes over the connection and still reads its body from the
            # channel; a socket survives this through makefile()'s reference, a channel would not.
            self.sock = None
            super().close()
            return
        super().close()
        self._chan.close()


def pick_container(inspected: Iterable[dict[str, Any]], label: str) -> ContainerInfo | None:
    """From `docker inspect` JSON objects pick the running container, else the newest one."""
    infos = [_from_inspect(obj, label) for obj in inspected]
    if not infos:
        return None
    running = [i for i in infos if i.running]
    return running[0] if running else max(infos, key=lambda i: i.started_at or 0.0)


def _from_inspect(obj: dict[str, Any], label: str) -> ContainerInfo:
    state = obj.get("State") or {}
    config = obj.get("Config") or {}
    return ContainerInfo(
        id=obj.get("Id", "")[:12],
        state=state.get("Status", "unknown"),
        started_at=_parse_docker_time(state.get("StartedAt")),
        exit_code=state.get("ExitCode"),
        image=config.get("Image"),
        image_id=obj.get("Image"),
        spec_hash=(config.get("Labels") or {}).get(label),
    )


def _parse_docker_time(text: str | None) -> float | None:
    # Docker writes RFC 3339 with nanoseconds ("2026-11-29T21:02:31.123456789Z"); "0001-01-01..." = never started.
    if not text or text.startswith("0001-"):
        return None
    m = re.fullmatch(r"(.+T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?", text)
    if m is None:
        return None
    base, frac, tz = m.groups()
    # datetime takes at most microseconds; docker gives nanoseconds.
    stamp = datetime.fromisoformat(f"{base}.{(frac or '0')[:6].ljust(6, '0')}{'+00:00' if tz in (None, 'Z') else tz}")
    return stamp.timestamp()


class SshTransport:
    """Checks through an open paramiko.SSHClient. sudo must not prompt (the deploy user has NOPASSWD).

    >>> client = paramiko.SSHClient(); client.load_system_host_keys(); client.connect("gpu1", username="deploy")
    >>> check(SshTransport(client, name="gpu1"), expected)
    """

    def __init__(self, client: paramiko.SSHClient, name: str | None = None, sudo: bool = True):
        self.client = client
        self.name = name or _peer_name(client)
        self._sudo = "sudo -n " if sudo else ""

    def _transport(self) -> paramiko.Transport:
        t = self.client.get_transport()
        if t is None or not t.is_active():
            raise Unreachable(f"{self.name}: SSH connection is not open")
        return t

    def http(self, port: int, timeout: float) -> http.client.HTTPConnection:
        try:
            chan = self._transport().open_channel("direct-tcpip", ("127.0.0.1", port), ("127.0.0.1", 0), timeout=timeout)
        except paramiko.ChannelException as e:
            # sshd answers "Connect failed" (code 2) when its own connect() to 127.0.0.1:port is refused.
            if e.code == paramiko.common.OPEN_FAILED_CONNECT_FAILED:
                raise ConnectionRefusedError(f"{self.name}: 127.0.0.1:{port} refused the connection") from e
            raise TransportError(f"{self.name}: sshd refused the tunnel to port {port}: {e.text}") from e
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise Unreachable(f"{self.name}: SSH failed: {e}") from e
        chan.settimeout(timeout)
        return _ChannelHTTPConnection(chan, port, timeout)

    def run(self, command: str, timeout: float = 30.0) -> tuple[int, str, str]:
        """Run a shell command on the host: (exit status, stdout, stderr)."""
        self._transport()  # a closed client has no transport: say "unreachable", not AttributeError
        try:
            _, out, err = self.client.exec_command(command, timeout=timeout)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
            return out.channel.recv_exit_status(), stdout, stderr
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise Unreachable(f"{self.name}: SSH failed: {e}") from e

    def container(self, service: str) -> ContainerInfo | None:
        label = f"gpufleet.{service}"
        ids = f"$({self._sudo}docker ps -aq --filter label={shlex.quote(label)})"
        # One round trip: list by label, inspect what was found (inspect with no ids would fail). A failing
        # `docker ps` (daemon down, no sudo) must fail the command, not read as "no container".
        cmd = f'ids={ids} || exit $?; if [ -z "$ids" ]; then echo "[]"; else {self._sudo}docker inspect $ids; fi'
        rc, out, err = self.run(cmd)
        if rc != 0:
            raise TransportError(f"{self.name}: docker inspect failed: {(err or out).strip()[:200]}")
        try:
            return pick_container(json.loads(out or "[]"), label)
        except ValueError as e:
            raise TransportError(f"{self.name}: unexpected docker inspect output: {out.strip()[:120]!r}") from e

    def logs(self, service: str, tail: int = 30) -> list[str]:
        info = self.container(service)
        if info is None:
            return []
        _, out, err = self.run(f"{self._sudo}docker logs --tail {int(tail)} {shlex.quote(info.id)} 2>&1")
        return (out + err).splitlines()[-tail:]


def _peer_name(client: paramiko.SSHClient) -> str:
    t = client.get_transport()
    try:
        return str(t.getpeername()[0]) if t else "?"
    except OSError:
        return "?"


def transport_from_pyinfra_host(host: Any) -> SshTransport:
    """Reuse a pyinfra 3.x host's SSH connection (its paramiko client lives at host.connector.client).

    Connects the host first if pyinfra has not yet done so.
    """
    connector = getattr(host, "connector", None)
    client = getattr(connector, "client", None)
    if client is None:
        host.connect(raise_exceptions=True)
        client = getattr(host.connector, "client", None)
    if not isinstance(client, paramiko.SSHClient):
        raise TransportError(f"{host.name}: not an SSH host (connector {type(connector).__name__})")
    return SshTransport(client, name=host.name)


__all__ = [
    "ContainerInfo",
    "SshTransport",
    "Transport",
    "TransportError",
    "Unreachable",
    "pick_container",
    "transport_from_pyinfra_host",
]
