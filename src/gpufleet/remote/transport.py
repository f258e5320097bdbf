"""How the health checks reach a vLLM server: HTTP to a port *on the host*, and the container's state.

SshTransport tunnels over SSH; the tests' LoopbackTransport has the same interface. See docs/verify.md.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import json
import logging
import re
import shlex
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import paramiko

from gpufleet.names import LOOPBACK, container_label_key

# A body, its headers and one read-ahead buffer; a larger answer is a finding.
MAX_BODY_BYTES = 1 << 20
MAX_ANSWER_BYTES = MAX_BODY_BYTES + (64 << 10) + io.DEFAULT_BUFFER_SIZE
EVIDENCE_BYTES = 80


class RefusedTunnelRecords(logging.Filter):
    """Drops paramiko's ERROR record for a refused tunnel: a loading server would print it many times."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Secsh channel ") and " open FAILED: " in message)


_REFUSED_TUNNEL_RECORDS = RefusedTunnelRecords()


class TransportError(Exception):
    """The transport itself failed."""


class Unreachable(TransportError):
    """The host cannot be reached over SSH."""


@dataclass(frozen=True)
class ContainerInfo:
    id: str
    state: str  # docker's State.Status
    started_at: float | None = None  # epoch seconds
    exit_code: int | None = None
    image: str | None = None  # the ref it was started from
    image_id: str | None = None  # the image actually running
    spec_hash: str | None = None
    model: str | None = None  # repo@commit
    # Checks reach the server here, so a local listener that bound the published port first never gets the API key.
    address: str | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def image_short(self) -> str | None:
        """12 hex digits of the registry digest it was started by, else of the local image id."""
        source = self.image.rsplit("@", 1)[1] if self.image and "@" in self.image else self.image_id
        return source.split(":", 1)[-1][:12] if source else None


class Transport(Protocol):
    name: str

    def http(self, port: int, timeout: float, max_bytes: int = MAX_ANSWER_BYTES,
             address: str = LOOPBACK) -> DeadlineHTTPConnection:  # fmt: skip
        """A connected, single-use HTTP connection to address:port on the host.

        timeout is one deadline for connecting and the whole answer. Raises ConnectionRefusedError, Unreachable or
        TimeoutError.
        """

    def container(self, service: str) -> ContainerInfo | None:
        """The service's running container, else its newest, else None."""

    def logs(self, service: str, tail: int = 30) -> list[str]:
        """The container's last log lines."""


class _DeadlineReader(io.RawIOBase):
    """A raw stream for io.BufferedReader: http.client needs peek(), which paramiko's ChannelFile lacks."""

    def __init__(self, sock: _DeadlineSocket):
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._sock.recv(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._sock.reader_closed()
        super().close()


class _DeadlineSocket:
    """A socket or paramiko Channel with one deadline for the whole exchange and a cap on the bytes read.

    Each read gets only what is left of the deadline, so a dripping server cannot hold a request (docs/health.md).
    """

    def __init__(self, raw: Any, deadline: float, timeout: float, max_bytes: int):
        self._raw, self._deadline, self._timeout, self._max_bytes = raw, deadline, timeout, max_bytes
        self.received = 0
        self.head = b""  # quoted when the answer is not HTTP
        self._readers = 0
        self._closed = False

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            got = f"{self.received} bytes" if self.received else "nothing"
            raise DeadlineExceeded(f"no complete answer within {self._timeout:g} s ({got} received)", self.head)
        self._raw.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self._arm()
        try:
            self._raw.sendall(data)
        except TimeoutError:
            self._arm()  # raises DeadlineExceeded if that was the cause
            raise

    def recv(self, size: int) -> bytes:
        if self.received >= self._max_bytes:
            raise AnswerTooLarge(f"answer over {self._max_bytes} bytes", self.head)
        self._arm()
        try:
            data = self._raw.recv(min(size, self._max_bytes - self.received))
        except TimeoutError:
            self._arm()
            raise
        self.received += len(data)
        if len(self.head) < EVIDENCE_BYTES:
            self.head += data[: EVIDENCE_BYTES - len(self.head)]
        return data

    def settimeout(self, timeout: float | None) -> None:
        pass  # the deadline decides

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def reader_closed(self) -> None:
        self._readers -= 1
        if self._closed and self._readers <= 0:
            self._raw.close()

    def close(self) -> None:
        # A "Connection: close" response still reads its body after this; an open reader keeps the stream alive.
        self._closed = True
        if self._readers <= 0:
            self._raw.close()


class DeadlineHTTPConnection(http.client.HTTPConnection):
    """http.client over an already-connected socket or channel, for one request under one deadline."""

    def __init__(self, raw: Any, port: int, timeout: float, deadline: float, max_bytes: int):
        super().__init__("127.0.0.1", port, timeout=timeout)
        # Kept after http.client lets go of the socket.
        self.wire = self.sock = _DeadlineSocket(raw, deadline, timeout, max_bytes)

    def connect(self) -> None:
        if self.sock is None:
            raise ConnectionError("the connection was used for one request and closed")


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before its answer was complete."""

    def __init__(self, message: str, head: bytes = b""):
        super().__init__(message)
        self.head = head


class BadAnswer(Exception):
    """Something answered, but not with usable HTTP."""


class AnswerTooLarge(BadAnswer):
    """The server sent more than the request allows."""

    def __init__(self, message: str, head: bytes = b""):
        super().__init__(message)
        self.head = head


def pick_container(inspected: Iterable[dict[str, Any]], label: str) -> ContainerInfo | None:
    """The running container among `docker inspect` objects, else the newest."""
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
        model=(config.get("Labels") or {}).get(f"{label}.model"),
        address=_network_address(obj.get("NetworkSettings")),
    )


def _network_address(settings: object) -> str | None:
    networks = settings.get("Networks") if isinstance(settings, dict) else None
    for network in (networks or {}).values() if isinstance(networks, dict) else ():
        address = network.get("IPAddress") if isinstance(network, dict) else None
        if isinstance(address, str) and address:
            try:
                return str(ipaddress.ip_address(address))
            except ValueError:
                continue
    return None


def _parse_docker_time(text: str | None) -> float | None:
    # RFC 3339 with nanoseconds; year 1 means never started.
    if not text or text.startswith("0001-"):
        return None
    m = re.fullmatch(r"(.+T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?", text)
    if m is None:
        return None
    base, frac, tz = m.groups()
    stamp = datetime.fromisoformat(f"{base}.{(frac or '0')[:6].ljust(6, '0')}{'+00:00' if tz in (None, 'Z') else tz}")
    return stamp.timestamp()


class SshTransport:
    """Checks through an open paramiko.SSHClient; sudo must not prompt. Open one with ssh.open_ssh."""

    def __init__(self, client: paramiko.SSHClient, name: str | None = None, sudo: bool = True):
        self.client = client
        self.name = name or _peer_name(client)
        self._sudo = "sudo -n " if sudo else ""
        # A logger's filters see only its own records, so it goes on paramiko's own logger.
        logging.getLogger("paramiko.transport").addFilter(_REFUSED_TUNNEL_RECORDS)

    def _transport(self) -> paramiko.Transport:
        t = self.client.get_transport()
        if t is None or not t.is_active():
            raise Unreachable(f"{self.name}: SSH connection is not open")
        return t

    def http(self, port: int, timeout: float, max_bytes: int = MAX_ANSWER_BYTES,
             address: str = LOOPBACK) -> DeadlineHTTPConnection:  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            chan = self._transport().open_channel("direct-tcpip", (address, port), (LOOPBACK, 0), timeout=timeout)
        except paramiko.ChannelException as e:
            # sshd's own connect() failed; its text tells a refusal from a reset (a proxy before a loading server).
            if e.code == paramiko.common.OPEN_FAILED_CONNECT_FAILED:
                if "reset" in (e.text or "").lower():
                    raise ConnectionResetError(f"{self.name}: {address}:{port} reset the connection") from e
                raise ConnectionRefusedError(f"{self.name}: {address}:{port} refused the connection") from e
            raise TransportError(f"{self.name}: sshd refused the tunnel to port {port}: {e.text}") from e
        except (paramiko.SSHException, OSError, EOFError) as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name}: the tunnel to port {port} did not open within {timeout:g} s") from e
            raise Unreachable(f"{self.name}: SSH failed: {e}") from e
        return DeadlineHTTPConnection(chan, port, timeout, deadline, max_bytes)

    def shell(self, command: str, timeout: float = 30.0) -> tuple[int, str, str]:
        """Run a shell command on the host: (exit status, stdout, stderr)."""
        self._transport()  # raises Unreachable for a closed client
        try:
            _, out, err = self.client.exec_command(command, timeout=timeout)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
            return out.channel.recv_exit_status(), stdout, stderr
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise Unreachable(f"{self.name}: SSH failed: {e}") from e

    def container(self, service: str) -> ContainerInfo | None:
        label = container_label_key(service)
        ids = f"$({self._sudo}docker ps -aq --filter label={shlex.quote(label)})"
        # One round trip. A failing `docker ps` must fail the command, not read as "no container".
        cmd = f'ids={ids} || exit $?; if [ -z "$ids" ]; then echo "[]"; else {self._sudo}docker inspect $ids; fi'
        rc, out, err = self.shell(cmd)
        if rc != 0:
            raise TransportError(f"{self.name}: docker inspect failed: {(err or out).strip()[:200]}")
        try:
            return pick_container(json.loads(out or "[]"), label)
        except (ValueError, TypeError, AttributeError) as e:
            raise TransportError(f"{self.name}: unexpected docker inspect output: {out.strip()[:120]!r}") from e

    def logs(self, service: str, tail: int = 30) -> list[str]:
        info = self.container(service)
        if info is None:
            return []
        status, out, err = self.shell(f"{self._sudo}docker logs --tail {int(tail)} {shlex.quote(info.id)} 2>&1")
        # A --rm container may be gone by now; the caller then reads the unit's journal.
        return (out + err).splitlines()[-tail:] if status == 0 else []


def _peer_name(client: paramiko.SSHClient) -> str:
    t = client.get_transport()
    try:
        return str(t.getpeername()[0]) if t else "?"
    except OSError:
        return "?"


__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_BODY_BYTES",
    "AnswerTooLarge",
    "BadAnswer",
    "ContainerInfo",
    "DeadlineExceeded",
    "DeadlineHTTPConnection",
    "SshTransport",
    "Transport",
    "TransportError",
    "Unreachable",
    "pick_container",
]
